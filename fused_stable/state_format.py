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
        a new block) share one fp32 scale, stored beside the codes under the moment's key + "_scale":
          exp_avg      int8 codes c in [-127, 127], scale s = the block's largest |exp_avg|:
                       exp_avg = (c / 127) * |c / 127| * s                (signed square-root companding)
          exp_avg_sq   uint8 codes c in [0, 255], scale s = the block's largest sqrt(exp_avg_sq):
                       exp_avg_sq = ((c / 255) ** 2 * s) ** 2             (square root of sqrt(v), companded)
        (max_exp_avg_sq as exp_avg_sq.) Codes round to nearest, ties up. Tensors of fewer than
        MIN_QUANTISED_NUMEL elements keep fp32 moments (what bitsandbytes and torchao do: norms, biases and
        LoRA's small vectors cost little and are the most sensitive).

The arithmetic below is the update kernel's, operation by operation in fp32 with IEEE division and square root
(kernels/update.py): the same fp32 moments give the same codes and scales on both backends. Why these maps and
this block size, with the measurements: docs/optimizer.md, "Low-precision state".
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
# block's scale): the update kernel's `_encode_*` / `_decode_*`, operation by operation


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root rounded to nearest, as the kernels' `tl.sqrt_rn` (and Triton's interpreter): torch 2.13's
    CPU fp32 `sqrt` is off by an ulp for ~16% of inputs; the fp64 root rounded to fp32 is the correctly rounded one."""
    return x.double().sqrt().to(x.dtype)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))[:, None]


def encode_signed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg -> (int8 codes, per-block scales): s = the block's max |x|, c = round(127 * sqrt(|x| / s)), x's sign."""
    magnitude = x.abs()
    scale = magnitude.amax(dim=1)
    code = torch.floor(sqrt_rn(torch.clamp(magnitude * _inverse(scale), max=1.0)) * EXP_AVG_LEVELS + 0.5)
    return torch.where(x < 0, -code, code).to(torch.int8), scale


def decode_signed(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [blocks, QUANT_BLOCK] and scales [blocks] -> exp_avg (fp32)."""
    q = codes.to(torch.float32) * (1.0 / EXP_AVG_LEVELS)
    return q * q.abs() * scale[:, None]


def encode_unsigned(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg_sq -> (uint8 codes, per-block scales): r = sqrt(x), s = the block's max r, c = round(255 sqrt(r / s))."""
    root = sqrt_rn(x)
    scale = root.amax(dim=1)
    code = torch.floor(sqrt_rn(torch.clamp(root * _inverse(scale), max=1.0)) * EXP_AVG_SQ_LEVELS + 0.5)
    return code.to(torch.uint8), scale


def decode_unsigned(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 codes [blocks, QUANT_BLOCK] and scales [blocks] -> exp_avg_sq (fp32)."""
    q = codes.to(torch.float32) * (1.0 / EXP_AVG_SQ_LEVELS)
    root = q * q * scale[:, None]
    return root * root


ENCODERS = {SIGNED: encode_signed, UNSIGNED: encode_unsigned}  # by codec kind
DECODERS = {SIGNED: decode_signed, UNSIGNED: decode_unsigned}


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


def decode(codes: torch.Tensor, scale: torch.Tensor, key: str) -> torch.Tensor:
    """Q8 codes (laid out like their param) and scales -> the fp32 moment, laid out the same way."""
    values = flat(codes)
    decoded = DECODERS[codec_of(key)](_as_blocks(values), scale)
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
    """Per element (its index in its tensor's memory order): 32 random bits, from its tensor's key."""
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


def to_fp32(state: dict, key: str) -> torch.Tensor:
    """One moment of a param's state as an fp32 tensor shaped like the param, from any format."""
    value = state[key]
    if value.dtype in (torch.int8, torch.uint8):
        return decode(value, state[key + SCALE_SUFFIX], key)
    return value.to(torch.float32)


def convert(state: dict, fmt: int, like: torch.Tensor) -> None:
    """Re-stores every moment of a param's state in `fmt`, laid out like `like` (the param), in place; a moment
    already in `fmt` is left as it is."""
    for key in state_keys():
        if key not in state or moment_format(state[key]) == fmt:
            continue
        value = to_fp32(state, key)
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
