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


@triton.jit
def _decode(codes, scale, SIGNED: tl.constexpr):
    """8-bit codes [rows, QUANT_BLOCK] and their rows' scales [rows] -> fp32 (state_format.decode_*)."""
    if SIGNED:
        q = codes.to(tl.float32) * (1.0 / 127.0)
        return q * tl.abs(q) * scale[:, None]
    else:
        q = codes.to(tl.float32) * (1.0 / 255.0)
        root = q * q * scale[:, None]
        return root * root


@triton.jit
def _encode(x, SIGNED: tl.constexpr):
    """fp32 [rows, QUANT_BLOCK] -> (8-bit codes, each row's scale) (state_format.encode_*): the scale is the row's
    largest |x| (signed) or sqrt(x) (unsigned), the code the rounded square root of the ratio, ties up."""
    if SIGNED:
        magnitude = tl.abs(x)
    else:
        magnitude = tl.sqrt_rn(x)
    scale = tl.max(magnitude, axis=1)
    inverse = tl.where(scale > 0.0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
    root = tl.sqrt_rn(tl.minimum(magnitude * inverse[:, None], 1.0))
    if SIGNED:
        code = tl.floor(root * 127.0 + 0.5)
        return tl.where(x < 0.0, -code, code).to(tl.int8), scale
    else:
        return tl.floor(root * 255.0 + 0.5).to(tl.uint8), scale


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
    step, the elements' indices in the tensor); the low 16 bits plus 16 random ones carry into the kept half."""
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
