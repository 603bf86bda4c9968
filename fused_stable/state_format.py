"""How a parameter's AdamW moments are stored: the state formats, the rule that picks one per tensor, and the
conversions between them (plain torch; the update kernel and the torch backend compute in the same format).

A param group's `state_precision` ("fp32", the default, "bf16" or "8bit") chooses the format of its params'
moments, `exp_avg`, `exp_avg_sq` and amsgrad's `max_exp_avg_sq`, the way a param's dtype chooses how its
values are stored; each tensor's format is then fixed by its state's dtypes (`format_of`), so a state dict
says what it holds. Formats:

  FP32  the moments as fp32 tensors shaped like the param (torch.optim.AdamW's state).
  BF16  the moments as bf16 tensors shaped like the param. The update rounds exp_avg to nearest and exp_avg_sq
        stochastically (`round_stochastic_bf16`): with beta2 = 0.999 an exp_avg_sq moves 0.1% per step, under
        half a bf16 ulp (0.2-0.4%), so nearest rounding would freeze it (max_exp_avg_sq, a running maximum, rounds
        to nearest). The random bits are a hash of (the param's position in the optimizer, its step, the element):
        no generator state, the same on both backends, and a resumed run draws the same bits.
  Q8    8-bit blockwise: every QUANT_BLOCK consecutive elements (in the param's memory order; each tensor starts
        a new block) share one fp32 scale s, the block's largest magnitude, stored beside the codes under the
        moment's key + "_scale". Code format v2 (see "Q8 codes" below: no square root, no division per element):
          exp_avg      int8 codes c in [-127, 127]:  exp_avg = +-psquare2(|c| / 127) * s
          exp_avg_sq   uint8 codes c in [0, 255]:    exp_avg_sq = psquare4(c / 255) * s
        with psquare2 / psquare4 the inverses of a pseudo square root / fourth root on the fp32 bit pattern
        (piecewise linear, exact at powers of 4 / 16). (max_exp_avg_sq as exp_avg_sq.) Codes round to nearest,
        ties up. A saved state dict tags each param's 8-bit codes with their format (CODES_KEY); untagged codes
        are v1 (square-root companding, every 8-bit state saved before v2) and are converted on load. Tensors
        of fewer than MIN_QUANTISED_NUMEL elements keep fp32 moments (what bitsandbytes and torchao do: norms,
        biases and LoRA's small vectors cost little and are the most sensitive).

The arithmetic below is the update kernel's, operation by operation in fp32 (kernels/update.py, and the compiled
CPU op's backends/torch/state_codes.h): the same fp32 moments give the same codes and scales on every backend.
Why these maps and this block size, with the measurements: docs/optimizer.md, "Low-precision state".
"""

from __future__ import annotations

import torch

from .rules import CODECS  # every rule's state names -> codec kind
from .rules import codec_of as codec_of
from .rules.declaration import SIGNED as SIGNED
from .rules.declaration import UNSIGNED as UNSIGNED

STATE_PRECISIONS = ("fp32", "bf16", "8bit")
# a tensor's format, as the update kernel's STATE_FORMAT constexpr takes it
FP32, BF16, Q8 = 0, 1, 2
FORMAT_NAMES = {FP32: "fp32", BF16: "bf16", Q8: "8bit"}

# Elements per quantisation block: one warp's share of the update kernel's loop step (32 threads x 4 elements),
# so a block's absmax is a reduction inside one warp, with shuffles and no shared memory (docs/design.md)
QUANT_BLOCK = 128
MIN_QUANTISED_NUMEL = 4096  # smaller tensors keep fp32 moments in "8bit" groups (bitsandbytes' rule)
EXP_AVG_LEVELS = 127.0  # int8 codes -127..127
EXP_AVG_SQ_LEVELS = 255.0  # uint8 codes 0..255

# A state's 8-bit codec kind, declared by its rule (rules/declaration.py: SIGNED for a value of either sign, a
# momentum; UNSIGNED for a value >= 0, a second moment); the registry knows which state has which

SCALE_SUFFIX = "_scale"
CODE_DTYPES = {SIGNED: torch.int8, UNSIGNED: torch.uint8}  # the 8-bit codes of each codec kind
_STORAGE = {FP32: torch.float32, BF16: torch.bfloat16}


def state_keys() -> tuple[str, ...]:
    """Every state name some rule keeps (the tensors the formats store), and their scales' keys."""
    return tuple(CODECS)


def scale_keys() -> tuple[str, ...]:
    return tuple(key + SCALE_SUFFIX for key in state_keys())


def check_precision(value, where: str = "state_precision") -> str:
    if value not in STATE_PRECISIONS:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, STATE_PRECISIONS))}, got {value!r}")
    return value


def format_for(precision: str, numel: int) -> int:
    """The format a tensor of `numel` elements gets in a group of this `state_precision` (the small-tensor rule)."""
    if precision == "8bit":
        return Q8 if numel >= MIN_QUANTISED_NUMEL else FP32
    return BF16 if precision == "bf16" else FP32


def format_of(state: dict, first_state: str = "exp_avg") -> int | None:
    """The format a param's state is stored in, from its rule's first state (None without one, or in another
    dtype)."""
    return moment_format(state[first_state]) if first_state in state else None


def moment_format(value) -> int | None:
    """A stored moment's format from its dtype (None for one no format stores, e.g. torch's fp16 moments)."""
    dtype = getattr(value, "dtype", None)
    if dtype in (torch.int8, torch.uint8):
        return Q8
    return {torch.bfloat16: BF16, torch.float32: FP32}.get(dtype)


def num_blocks(numel: int) -> int:
    return -(-numel // QUANT_BLOCK)


def moment_dtype(key: str, fmt: int) -> torch.dtype:
    return CODE_DTYPES[codec_of(key)] if fmt == Q8 else _STORAGE[fmt]


def zero_moment(p: torch.Tensor, key: str, fmt: int) -> dict[str, torch.Tensor]:
    """A zero moment for param `p`: laid out like `p` (its memory order is the kernels' and the blocks'), plus the
    scales in Q8. Zero codes with zero scales decode to exactly zero."""
    values = {key: torch.zeros_like(p, dtype=moment_dtype(key, fmt), memory_format=torch.preserve_format)}
    if fmt == Q8:
        values[key + SCALE_SUFFIX] = torch.zeros(num_blocks(p.numel()), dtype=torch.float32, device=p.device)
    return values


def memory_order(t: torch.Tensor) -> list[int]:
    """The dims of `t` from the largest stride to the smallest: `t.permute(order)` walks memory in order."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d))


def flat(t: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """`t`'s elements as one dim, in `order` (a dim order from `memory_order`; None: `t`'s own memory order)."""
    order = memory_order(t) if order is None else order
    return (t if order == sorted(order) else t.permute(order)).reshape(-1)


# ------------------------------------------------------------------------------------------------------------
# Q8 codes, on values laid out as [blocks, QUANT_BLOCK] (each tensor zero-padded to whole blocks: zeros change no
# block's scale): the update kernel's `_encode_*` / `_decode_*` (kernels/state_codes.py) and the compiled op's
# (backends/torch/state_codes.h), operation by operation.
#
# Code format v2 (CODES_V2, the one written): every map is a "pseudo root" on the fp32 bit pattern, no square root
# and no division per element. For x >= 0, (bits(x) >> 1) + ROOT2 halves the exponent and carries the mantissa
# linearly: a piecewise-linear square root, exact at powers of 4, monotone, >= sqrt(x); (bits(x) >> 2) + ROOT4 is
# the same root taken twice (exact at powers of 16). Decoding inverts it exactly on the bit pattern (the
# exponent doubled back, a shift left). Per block: s = the block's largest |x| (a block whose largest is below
# FLT_MIN, the smallest normal fp32, stores s = 0: flushed to zero, so 1 / s is always finite); r = |x| * (1 / s)
# with the ratio's bits clamped to 1.0's (an r above 1 by an ulp, a NaN or an infinity counts as 1, so every
# input has a defined code):
#   signed   (exp_avg)     c = +-floor(127 * proot2(r) + 0.5),  x = +-psquare2(|c| / 127) * s
#   unsigned (exp_avg_sq)  c =   floor(255 * proot4(r) + 0.5),  x =   psquare4(c / 255) * s
# Code format v1 (CODES_V1, every 8-bit state saved before the tag existed): square roots,
#   signed c = round(127 sqrt(|x| / s)), unsigned c = round(255 sqrt(sqrt(x) / s)) with s the largest sqrt(x);
# kept to decode (and convert) old states.

CODES_V1, CODES_V2 = 1, 2
CODES_VERSION = CODES_V2  # the format this version writes
# in a saved state dict, beside a param's 8-bit codes: the format they are in (absent: v1, saved before it existed)
CODES_KEY = "state_format_version"
FLT_MIN = 2.0**-126  # the smallest normal fp32: a block whose largest magnitude is below it is stored as zeros
FLT_MIN_BITS = 0x00800000
_ONE_BITS = 0x3F800000  # bits of 1.0
_MAGNITUDE = 0x7FFFFFFF
_SIGN = -(2**31)  # 0x80000000 as an int32
ROOT2 = 0x1FC00000  # (bits >> 1) + ROOT2: 1.0 -> 1.0 (0x3F800000 >> 1 = 0x1FC00000)
ROOT4 = 0x2FA00000  # (bits >> 2) + ROOT4: 1.0 -> 1.0 (0x3F800000 - (0x3F800000 >> 2))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _float(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float32)


def magnitude_and_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|x| [blocks, QUANT_BLOCK] (the sign bit cleared, a NaN's too) and the blocks' scales: the largest, taken
    as an integer max of the bits (>= 0, their order is the floats'; a NaN's lie above infinity's, so a NaN
    anywhere makes the scale that NaN, bit for bit on every backend), 0 below FLT_MIN."""
    bits = _bits(x) & _MAGNITUDE
    scale = bits.amax(dim=1)
    return _float(bits), _float(torch.where(scale < FLT_MIN_BITS, torch.zeros_like(scale), scale))


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))[:, None]


def pseudo_root(ratio: torch.Tensor, shift: int, constant: int) -> torch.Tensor:
    """proot2 (shift 1, ROOT2) or proot4 (shift 2, ROOT4) of ratios in [0, 1]: the ratio's magnitude bits clamped to
    1.0's (so a NaN or infinity gives 1), shifted, plus the constant."""
    bits = torch.clamp(_bits(ratio) & _MAGNITUDE, max=_ONE_BITS)
    return _float((bits >> shift) + constant)


def pseudo_square(q: torch.Tensor, shift: int, constant: int) -> torch.Tensor:
    """The inverse of `pseudo_root` on q in [-1, 1] (q's sign kept): ((bits(|q|) - constant) << shift), 0 for q = 0."""
    bits = _bits(q)
    magnitude = torch.clamp((bits & _MAGNITUDE) - constant, min=0) << shift
    return _float(magnitude | (bits & _SIGN))


def encode_signed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg -> (int8 codes, per-block scales), v2: s = the block's max |x|, c = round(127 proot2(|x| / s)) with
    x's sign."""
    magnitude, scale = magnitude_and_scale(x)
    code = torch.floor(pseudo_root(magnitude * _inverse(scale), 1, ROOT2) * EXP_AVG_LEVELS + 0.5)
    return torch.where(x < 0, -code, code).to(torch.int8), scale


def decode_signed(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [blocks, QUANT_BLOCK] and scales [blocks] -> exp_avg (fp32), v2."""
    q = codes.to(torch.float32) * (1.0 / EXP_AVG_LEVELS)
    return pseudo_square(q, 1, ROOT2) * scale[:, None]


def encode_unsigned(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg_sq -> (uint8 codes, per-block scales), v2: s = the block's max x, c = round(255 proot4(x / s))."""
    magnitude, scale = magnitude_and_scale(x)
    code = torch.floor(pseudo_root(magnitude * _inverse(scale), 2, ROOT4) * EXP_AVG_SQ_LEVELS + 0.5)
    return code.to(torch.uint8), scale


def decode_unsigned(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 codes [blocks, QUANT_BLOCK] and scales [blocks] -> exp_avg_sq (fp32), v2."""
    q = codes.to(torch.float32) * (1.0 / EXP_AVG_SQ_LEVELS)
    return pseudo_square(q, 2, ROOT4) * scale[:, None]


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root rounded to nearest, as the kernels' `tl.sqrt_rn` (and Triton's interpreter): torch 2.13's
    CPU fp32 `sqrt` is off by an ulp for ~16% of inputs; the fp64 root rounded to fp32 is the correctly rounded one."""
    return x.double().sqrt().to(x.dtype)


def encode_signed_v1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v1: exp_avg -> (int8 codes, scales): s = the block's max |x|, c = round(127 * sqrt(|x| / s)), x's sign."""
    magnitude = x.abs()
    scale = magnitude.amax(dim=1)
    code = torch.floor(sqrt_rn(torch.clamp(magnitude * _inverse(scale), max=1.0)) * EXP_AVG_LEVELS + 0.5)
    return torch.where(x < 0, -code, code).to(torch.int8), scale


def decode_signed_v1(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """v1: int8 codes [blocks, QUANT_BLOCK] and scales [blocks] -> exp_avg (fp32)."""
    q = codes.to(torch.float32) * (1.0 / EXP_AVG_LEVELS)
    return q * q.abs() * scale[:, None]


def encode_unsigned_v1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v1: exp_avg_sq -> (uint8 codes, scales): r = sqrt(x), s = the block's max r, c = round(255 sqrt(r / s))."""
    root = sqrt_rn(x)
    scale = root.amax(dim=1)
    code = torch.floor(sqrt_rn(torch.clamp(root * _inverse(scale), max=1.0)) * EXP_AVG_SQ_LEVELS + 0.5)
    return code.to(torch.uint8), scale


def decode_unsigned_v1(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """v1: uint8 codes [blocks, QUANT_BLOCK] and scales [blocks] -> exp_avg_sq (fp32)."""
    q = codes.to(torch.float32) * (1.0 / EXP_AVG_SQ_LEVELS)
    root = q * q * scale[:, None]
    return root * root


ENCODERS = {SIGNED: encode_signed, UNSIGNED: encode_unsigned}  # by codec kind, in CODES_VERSION
DECODERS = {SIGNED: decode_signed, UNSIGNED: decode_unsigned}
# by code format, then codec kind: what a saved state's codes decode with
DECODERS_BY_VERSION = {
    CODES_V1: {SIGNED: decode_signed_v1, UNSIGNED: decode_unsigned_v1},
    CODES_V2: DECODERS,
}
ENCODERS_BY_VERSION = {
    CODES_V1: {SIGNED: encode_signed_v1, UNSIGNED: encode_unsigned_v1},
    CODES_V2: ENCODERS,
}


def _as_blocks(values: torch.Tensor) -> torch.Tensor:
    blocks = num_blocks(values.numel())
    padded = torch.zeros(blocks * QUANT_BLOCK, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    return padded.view(blocks, QUANT_BLOCK)


def encode(x: torch.Tensor, key: str, like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A moment (any layout) as Q8 codes laid out like `like` (its param; default: `x`), and their scales."""
    codec = codec_of(key)
    out = torch.empty_like(x if like is None else like, dtype=CODE_DTYPES[codec], memory_format=torch.preserve_format)
    values = flat(x, memory_order(out)).to(torch.float32)  # in the codes' memory order: the blocks' order
    codes, scale = ENCODERS[codec](_as_blocks(values))
    flat_view(out).copy_(codes.view(-1)[: values.numel()])
    return out, scale


def decode(codes: torch.Tensor, scale: torch.Tensor, key: str, version: int = CODES_VERSION) -> torch.Tensor:
    """Q8 codes in code format `version` (laid out like their param) and scales -> the fp32 moment, laid out the
    same way."""
    values = flat(codes)
    decoded = DECODERS_BY_VERSION[version][codec_of(key)](_as_blocks(values), scale)
    out = torch.empty_like(codes, dtype=torch.float32, memory_format=torch.preserve_format)
    flat_view(out).copy_(decoded.view(-1)[: values.numel()])
    return out


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor in its memory order (what the kernels walk); raises for a non-dense one."""
    order = memory_order(t)
    return (t if order == sorted(order) else t.permute(order)).view(-1)


# ------------------------------------------------------------------------------------------------------------
# stochastic rounding of bf16 exp_avg_sq: uint32 arithmetic (held in int64 tensors), kernels/state_codes.py's `mix32`


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), in halves so the int64 product cannot overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32): every input bit moves about half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x735A2D97)
    return x ^ (x >> 15)


def random_key(position: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Per tensor and step: the key its elements' random bits are drawn with (position: the param's index in the
    optimizer's flat param order; step: its `step` counter after this step's increment)."""
    return mix32((position & 0xFFFFFFFF) ^ mix32(step.to(torch.int64) & 0xFFFFFFFF))


def random_bits(key: torch.Tensor, element: torch.Tensor) -> torch.Tensor:
    """Per element (its index in its whole param's memory order: a shard's local index plus its first element's,
    sharding.element_offset, so every mesh draws the same bits): 32 random bits, from its tensor's key."""
    return mix32((element & 0xFFFFFFFF) ^ key)


def round_stochastic_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounding up (in magnitude) with probability equal to the dropped fraction: the dropped low 16
    bits plus 16 random ones carry into the kept half exactly that often."""
    word = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    word = (word + (bits & 0xFFFF)) & 0xFFFF0000
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.view(torch.float32).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------------------
# whole states


def to_fp32(state: dict, key: str, version: int | None = None) -> torch.Tensor:
    """One moment of a param's state as an fp32 tensor shaped like the param, from any format; 8-bit codes in
    code format `version` (None: the state's CODES_KEY, else CODES_VERSION: a live state's codes are current)."""
    value = state[key]
    if value.dtype in (torch.int8, torch.uint8):
        version = int(state.get(CODES_KEY, CODES_VERSION)) if version is None else version
        return decode(value, state[key + SCALE_SUFFIX], key, version)
    return value.to(torch.float32)


def saved_codes_version(entry: dict) -> int:
    """The code format of a saved state dict entry's 8-bit codes: its CODES_KEY, else v1 (saved before the tag
    existed); raises for a format this version cannot read."""
    version = int(entry.get(CODES_KEY, CODES_V1))
    if version not in DECODERS_BY_VERSION:
        raise ValueError(
            f"this optimizer state holds 8-bit codes in format v{version}, this fused_stable reads "
            f"v{min(DECODERS_BY_VERSION)}-v{max(DECODERS_BY_VERSION)}: upgrade fused_stable to load it"
        )
    return version


def codes_tag(version: int = CODES_VERSION) -> torch.Tensor:
    """The CODES_KEY value saved beside 8-bit codes: a 0-dim int64 tensor, as `step` is a 0-dim tensor (code that
    walks a state's tensors, moves them or compares them with torch.equal takes it as it takes `step`)."""
    return torch.tensor(version, dtype=torch.int64)


def tag_untagged_codes(state_dict: dict) -> dict:
    """Marks, in place, every entry of a saved optimizer state dict that holds 8-bit codes without a CODES_KEY as
    v1 (what an untagged state is), and returns it. For loaders that merge a saved state over a template of the
    live optimizer's (torch.distributed.checkpoint's set_optimizer_state_dict with full_state_dict keeps a
    template key the saved state lacks: the live state's v2 tag would then stand beside v1 codes); call it on the
    saved state before handing it to such a loader. load_state_dict needs no help."""
    for entry in state_dict.get("state", {}).values():
        if isinstance(entry, dict) and CODES_KEY not in entry and holds_codes(entry):
            entry[CODES_KEY] = codes_tag(CODES_V1)
    return state_dict


def holds_codes(state: dict) -> bool:
    """Whether a param's state holds 8-bit codes (the states CODES_KEY is saved beside)."""
    return any(key in state and moment_format(state[key]) == Q8 for key in state_keys())


def convert(state: dict, fmt: int, like: torch.Tensor, version: int = CODES_VERSION) -> None:
    """Re-stores every moment of a param's state in `fmt`, laid out like `like` (the param), in place; a moment
    already in `fmt` is left as it is, but 8-bit codes in another code format (`version`) are decoded as that
    format decodes them and encoded in CODES_VERSION."""
    for key in state_keys():
        if key not in state:
            continue
        if moment_format(state[key]) == fmt and (fmt != Q8 or version == CODES_VERSION):
            continue
        value = to_fp32(state, key, version)
        state.pop(key + SCALE_SUFFIX, None)
        if fmt == Q8:
            state[key], state[key + SCALE_SUFFIX] = encode(value, key, like)
        else:
            state[key] = value.to(_STORAGE[fmt])


def planned_bytes(numel: int, precision: str, states: int = 2, whole_numel: int | None = None) -> int:
    """Bytes the `states` state tensors (AdamW: 2, 3 with amsgrad) of a tensor of `numel` elements take in a group
    of this `state_precision` (scales included); `whole_numel`, the whole param's size when the tensor is a shard
    of it, decides the format."""
    fmt = format_for(precision, numel if whole_numel is None else whole_numel)
    per_moment = numel * (1 if fmt == Q8 else 2 if fmt == BF16 else 4)
    if fmt == Q8:
        per_moment += 4 * num_blocks(numel)
    return per_moment * states


def moment_bytes(state: dict) -> int:
    """Bytes a param's moments take (codes and scales included; `step` and master weights not)."""
    keys = state_keys() + scale_keys()
    return sum(t.numel() * t.element_size() for k, t in state.items() if k in keys and isinstance(t, torch.Tensor))
