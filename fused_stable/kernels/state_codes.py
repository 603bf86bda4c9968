"""The update kernel's moments in their state format (fused_stable/state_format.py): pointers of the format's
dtype, the 8-bit codes' decode and encode, and bf16 stochastic rounding. kernels/update.py's `_update_block`
loads and stores every moment through `load_moment` / `store_moment`."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import to_storage

# ------------------------------------------------------------------------------------------------------------
# the moments in their state format (fused_stable/state_format.py): fp32, bf16, or 8-bit codes with one fp32 scale
# per QUANT_BLOCK elements. In 8-bit a block of BLOCK elements is [BLOCK // QUANT_BLOCK, QUANT_BLOCK], one row per
# quantisation block, so a block's scale is a reduction along a row: one warp's elements (4 per thread), shuffles
# only. The torch backend computes the same maps in state_format.py, operation by operation.


@triton.jit
def moment_pointer(
    address, STATE_FORMAT: tl.constexpr, SIGNED: tl.constexpr, FMT_BF16: tl.constexpr, FMT_Q8: tl.constexpr
):
    if STATE_FORMAT == FMT_Q8:
        if SIGNED:
            return address.to(tl.pointer_type(tl.int8))
        else:
            return address.to(tl.pointer_type(tl.uint8))
    elif STATE_FORMAT == FMT_BF16:
        return address.to(tl.pointer_type(tl.bfloat16))
    else:
        return address.to(tl.pointer_type(tl.float32))


# state_format's code format v2: pseudo roots on the fp32 bit pattern (no square root, no division per element)
# (as constexpr defaults of the jit functions, not module globals: Triton re-checks a global every launch, ~1 us)
ONE_BITS = 0x3F800000  # state_format._ONE_BITS: 1.0
MAGNITUDE = 0x7FFFFFFF
FLT_MIN_BITS = 0x00800000  # state_format.FLT_MIN_BITS: 2**-126, the smallest normal fp32


@triton.jit
def _pseudo_root(
    ratio,
    SHIFT: tl.constexpr,
    CONSTANT: tl.constexpr,
    _MAGNITUDE: tl.constexpr = MAGNITUDE,
    _ONE_BITS: tl.constexpr = ONE_BITS,
):
    """state_format.pseudo_root: the ratio's magnitude bits clamped to 1.0's, shifted, plus the constant."""
    bits = tl.minimum(ratio.to(tl.int32, bitcast=True) & _MAGNITUDE, _ONE_BITS)
    return ((bits >> SHIFT) + CONSTANT).to(tl.float32, bitcast=True)


@triton.jit
def _pseudo_square(q, SHIFT: tl.constexpr, CONSTANT: tl.constexpr, _MAGNITUDE: tl.constexpr = MAGNITUDE):
    """state_format.pseudo_square: ((bits(|q|) - constant) << shift), 0 for q = 0, q's sign kept."""
    bits = q.to(tl.int32, bitcast=True)
    magnitude = tl.maximum((bits & _MAGNITUDE) - CONSTANT, 0) << SHIFT
    return (magnitude | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _decode(codes, scale, SIGNED: tl.constexpr):
    """8-bit codes [rows, QUANT_BLOCK] and their rows' scales [rows] -> fp32 (state_format.decode_*)."""
    if SIGNED:
        q = codes.to(tl.float32) * (1.0 / 127.0)
        return _pseudo_square(q, 1, 0x1FC00000) * scale[:, None]
    else:
        q = codes.to(tl.float32) * (1.0 / 255.0)
        return _pseudo_square(q, 2, 0x2FA00000) * scale[:, None]


@triton.jit
def _encode(x, SIGNED: tl.constexpr, _MAGNITUDE: tl.constexpr = MAGNITUDE, _FLT_MIN_BITS: tl.constexpr = FLT_MIN_BITS):
    """fp32 [rows, QUANT_BLOCK] -> (8-bit codes, each row's scale) (state_format.encode_*): the scale is the row's
    largest |x| (0 below FLT_MIN; a NaN if any is NaN), the code the rounded pseudo root (square for signed,
    fourth for unsigned) of |x| / scale, ties up."""
    magnitude_bits = x.to(tl.int32, bitcast=True) & _MAGNITUDE  # |x|, its sign bit cleared (a NaN's too)
    # the largest as an integer max of the bits (>= 0: their order is the floats'; a NaN's lie above infinity's, so
    # a NaN anywhere makes the scale a NaN), 0 below FLT_MIN (the smallest normal's bits)
    scale_bits = tl.max(magnitude_bits, axis=1)
    scale = tl.where(scale_bits < _FLT_MIN_BITS, 0, scale_bits).to(tl.float32, bitcast=True)
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    inverse = tl.where(scale > 0.0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
    ratio = magnitude * inverse[:, None]
    if SIGNED:
        code = tl.floor(_pseudo_root(ratio, 1, 0x1FC00000) * 127.0 + 0.5)
        return tl.where(x < 0.0, -code, code).to(tl.int8), scale
    else:
        return tl.floor(_pseudo_root(ratio, 2, 0x2FA00000) * 255.0 + 0.5).to(tl.uint8), scale


@triton.jit
def mix32(x):
    """state_format.mix32: a 32-bit integer hash (Wellons' lowbias32), on uint32."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _round_stochastic_bf16(x, random):
    """state_format.round_stochastic_bf16 with state_format.random_bits: `random` is (this tensor's key for this
    step, the elements' indices in the whole param); the low 16 bits plus 16 random ones carry into the kept half."""
    key, elements = random
    noise = mix32(elements.to(tl.uint32) ^ key)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (noise & 0xFFFF)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: the low half is zero


@triton.jit
def load_moment(
    pointer, scale_rows, mask, row_mask, STATE_FORMAT: tl.constexpr, SIGNED: tl.constexpr, FMT_Q8: tl.constexpr
):
    other = None if mask is None else 0.0
    if STATE_FORMAT == FMT_Q8:
        codes = tl.load(pointer, mask=mask, other=None if mask is None else 0)
        return _decode(codes, tl.load(scale_rows, mask=row_mask, other=other), SIGNED)
    else:
        return tl.load(pointer, mask=mask, other=other).to(tl.float32)


@triton.jit
def store_moment(
    pointer,
    scale_rows,
    x,
    mask,
    row_mask,
    random,
    STATE_FORMAT: tl.constexpr,
    SIGNED: tl.constexpr,
    FMT_BF16: tl.constexpr,
    FMT_Q8: tl.constexpr,
    STOCHASTIC: tl.constexpr = False,
):
    """Stores fp32 values in the state format; bf16 rounds to nearest even, or stochastically with `random` (see
    `_round_stochastic_bf16`) when STOCHASTIC."""
    if STATE_FORMAT == FMT_Q8:
        codes, scale = _encode(x, SIGNED)
        tl.store(pointer, codes, mask=mask)
        tl.store(scale_rows, scale, mask=row_mask)
    elif STATE_FORMAT == FMT_BF16:
        if STOCHASTIC:
            tl.store(pointer, _round_stochastic_bf16(x, random), mask=mask)
        else:
            tl.store(pointer, to_storage(x, tl.bfloat16), mask=mask)
    else:
        tl.store(pointer, x, mask=mask)
