"""The 8-bit state codes (fused_stable/state_format.py, code format v2) on their own: the maps' promises, and the
three implementations agreeing bit for bit.

- The torch reference (state_format.encode_* / decode_*): every decode strictly monotone in the code; every code
  decodes and re-encodes to itself; every value lies within half a code of its code, measured against the
  pseudo roots computed independently in fp64 (frexp, not bit tricks); no second moment decodes to 0 that v1
  kept; a block whose largest magnitude is below FLT_MIN stored as zeros.
- The Triton kernels' `_encode` / `_decode` (kernels/state_codes.py, through TRITON_INTERPRET=1) and the C++
  header the compiled CPU op uses (backends/torch/state_codes.h, built here with torch's cpp_extension and the
  op's flags) give the reference's codes, scales and decoded values bit for bit, on random wide-spread blocks,
  zeros, denormals, all-denormal blocks, infinities, NaNs (every input has a defined code in v2) and values at
  and next to the rounding boundaries; the C++ also on partial last blocks (n < 128, the tensor's tail).
"""

from __future__ import annotations

import hashlib
import math
import pathlib

import pytest
import torch
import triton
import triton.language as tl
from helpers import interpret_available

from fused_stable import state_format
from fused_stable.kernels.state_codes import _decode, _encode
from fused_stable.state_format import QUANT_BLOCK, ROOT2, ROOT4, SIGNED, UNSIGNED

KINDS = {SIGNED: ("exp_avg", 127), UNSIGNED: ("exp_avg_sq", 255)}
HEADER = pathlib.Path(state_format.__file__).parent / "backends" / "torch" / "state_codes.h"


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """The same bits, NaNs included (their patterns too: the scale of a NaN block is that NaN's bits)."""
    differ = _bits(actual) != _bits(expected)
    assert not bool(differ.any()), f"{what}: {int(differ.sum())} differ, first at {differ.nonzero()[0].tolist()}"


def _ties(kind: int) -> torch.Tensor:
    """Values at and one ulp beside each code's rounding boundary (y * levels + 0.5 an integer), in blocks whose
    largest is 1.0 (so the ratio is the value): the inverse pseudo root of (k + 0.5) / levels."""
    levels = KINDS[kind][1]
    shift, constant = (1, ROOT2) if kind == SIGNED else (2, ROOT4)
    y = (torch.arange(levels, dtype=torch.float32) + 0.5) / levels
    r = ((_bits(y) - constant) << shift).view(torch.float32)
    near = torch.cat([r, torch.nextafter(r, torch.ones_like(r)), torch.nextafter(r, torch.zeros_like(r))])
    near = torch.cat([near, near.new_zeros((-near.numel()) % (QUANT_BLOCK - 1))]).view(-1, QUANT_BLOCK - 1)
    return torch.cat([torch.ones(near.shape[0], 1), near], dim=1)


def blocks(kind: int, seed: int = 0) -> torch.Tensor:
    """[blocks, QUANT_BLOCK] fp32 values that exercise the maps: lognormal blocks of three spreads, zeros,
    denormals, an all-denormal block, an all-zero block, infinities and NaNs, and the rounding boundaries."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.tensor([1.0, 3.0, 6.0]).repeat_interleave(16)[:, None]
    x = torch.exp(torch.randn(48, 1, generator=gen) * 4 + spread * torch.randn(48, QUANT_BLOCK, generator=gen))
    if kind == SIGNED:
        x = x * torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)
    x[::5, :7] = 0.0
    x[1::5, 3:9] = 1e-40  # denormals beside normal values
    special = torch.zeros(6, QUANT_BLOCK)
    special[0] = torch.rand(QUANT_BLOCK, generator=gen) * 1e-39  # the whole block below FLT_MIN: stored as zeros
    special[2, 5], special[2, 9] = float("inf"), 3.0
    special[3, 7], special[3, 1] = float("nan"), 2.0
    special[4, 0], special[4, 1:] = -float("inf") if kind == SIGNED else float("inf"), 1.5
    special[5] = torch.full((QUANT_BLOCK,), 2.0**-126)  # exactly FLT_MIN: kept
    return torch.cat([x, special, _ties(kind)])


# ------------------------------------------------------------------------------------------------------------
# the reference's maps


@pytest.mark.parametrize("kind", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_every_code_decodes_monotonically_and_re_encodes_to_itself(kind):
    levels = KINDS[kind][1]
    codes = torch.arange(-levels if kind == SIGNED else 0, levels + 1, dtype=torch.int16)[None, :]
    for scale in torch.tensor([1.0, 3.7e-3, 2.0**100]):
        decoded = state_format.DECODERS[kind](codes, scale[None])[0]
        assert bool((decoded[1:] > decoded[:-1]).all()), "the decode is not strictly increasing in the code"
        assert float(decoded[-1]) == float(scale) and float(decoded[codes[0] == 0]) == 0.0
        # blocks of the top code's value (the scale) and 127 decoded values each
        values = torch.cat([decoded, decoded.new_zeros((-decoded.numel()) % (QUANT_BLOCK - 1))])
        values = values.view(-1, QUANT_BLOCK - 1)
        again, again_scale = state_format.ENCODERS[kind](torch.cat([decoded[-1:].expand(len(values), 1), values], 1))
        assert bool((again_scale == scale).all())
        assert torch.equal(again[:, 1:].reshape(-1)[: codes.numel()].short(), codes[0])


def _pseudo_root_fp64(r: torch.Tensor, times: int) -> torch.Tensor:
    """The pseudo square root taken `times` times, in fp64 from its definition: for r = 4^k (1 + t), t in [0, 1):
    2^k (1 + t / 2); for r = 2 * 4^k (1 + t): 2^k (1.5 + t / 2)."""
    for _ in range(times):
        mantissa, exponent = torch.frexp(r)  # r = mantissa * 2^exponent, mantissa in [0.5, 1)
        e = exponent - 1  # r = (2 * mantissa) * 2^e, 2 * mantissa in [1, 2)
        t = 2 * mantissa - 1
        k = torch.div(e, 2, rounding_mode="floor")
        odd = (e - 2 * k).to(r.dtype)
        r = torch.where(r > 0, torch.ldexp(1 + odd * 0.5 + t / 2, k), torch.zeros_like(r))
    return r


@pytest.mark.parametrize("kind", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_each_value_lies_within_half_a_code_of_its_code(kind):
    """Nearest rounding in the pseudo root's domain, checked against the fp64 definition: |levels * proot(|x| / s)
    - |c|| <= 1/2 plus the fp32 arithmetic's rounding (measured: at most 2e-5 of a code). The bound the
    v1 -> v2 conversion is held to (test_state_versions.py)."""
    name, levels = KINDS[kind]
    x = blocks(kind)[:48]  # the finite, random blocks
    codes, scale = state_format.ENCODERS[kind](x)
    ratio = x.double().abs() / scale.double()[:, None]
    position = levels * _pseudo_root_fp64(ratio, 1 if kind == SIGNED else 2)
    assert float((position - codes.double().abs()).abs().max()) <= 0.5 + 1e-4
    assert torch.equal(torch.sign(codes.float()) * (codes != 0), torch.sign(x) * (codes != 0))


def test_no_second_moment_decodes_to_zero_that_v1_kept():
    """proot4(r) >= r^(1/4), v1's map: a v2 code is 0 only where v1's is (on the same block)."""
    x = blocks(UNSIGNED)[:48]
    v2, _ = state_format.encode_unsigned(x)
    v1, _ = state_format.encode_unsigned_v1(x)
    assert not bool(((v2 == 0) & (v1 != 0)).any())
    assert bool((v2.int() >= v1.int() - 1).all())  # and never more than the rounding below v1's code


@pytest.mark.parametrize("kind", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_a_block_below_flt_min_is_stored_as_zeros_and_non_finite_blocks_decode_non_finite(kind):
    x = blocks(kind)[48:54]
    codes, scale = state_format.ENCODERS[kind](x)
    assert float(scale[0]) == 0.0 and not bool(codes[0].any())
    assert float(scale[5]) == 2.0**-126 and bool((codes[5] == KINDS[kind][1]).all())
    assert math.isinf(float(scale[2])) and math.isnan(float(scale[3])) and math.isinf(float(scale[4]))
    decoded = state_format.DECODERS[kind](codes, scale)
    assert not bool(torch.isfinite(decoded[2:5]).any())


# ------------------------------------------------------------------------------------------------------------
# the Triton kernels


@triton.jit
def _codec_kernel(x_ptr, codes_ptr, scale_ptr, out_ptr, ROWS: tl.constexpr, Q: tl.constexpr, SIGNED_: tl.constexpr):
    """Encodes ROWS blocks, stores the codes and scales, and decodes the codes it made."""
    offsets = tl.arange(0, ROWS)[:, None] * Q + tl.arange(0, Q)[None, :]
    codes, scale = _encode(tl.load(x_ptr + offsets), SIGNED_)
    tl.store(codes_ptr + offsets, codes)
    tl.store(scale_ptr + tl.arange(0, ROWS), scale)
    tl.store(out_ptr + offsets, _decode(codes, scale, SIGNED_))


def _triton_codec(x: torch.Tensor, kind: int):
    rows = 1 << (x.shape[0] - 1).bit_length()
    padded = torch.cat([x, x.new_zeros(rows - x.shape[0], QUANT_BLOCK)])
    codes = torch.empty(padded.shape, dtype=state_format.CODE_DTYPES[kind])
    scale, out = torch.empty(rows), torch.empty_like(padded)
    _codec_kernel[(1,)](padded, codes, scale, out, rows, QUANT_BLOCK, kind == SIGNED)
    n = x.shape[0]
    return codes[:n], scale[:n], out[:n]


@pytest.mark.skipif(not interpret_available(), reason="TRITON_INTERPRET=1 was not set before triton import")
@pytest.mark.parametrize("kind", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
def test_triton_codes_are_the_references_bit_for_bit(kind):
    x = blocks(kind)
    codes, scale, decoded = _triton_codec(x, kind)
    expected_codes, expected_scale = state_format.ENCODERS[kind](x)
    assert torch.equal(codes, expected_codes)
    _assert_bits_equal(scale, expected_scale, "scales")
    _assert_bits_equal(decoded, state_format.DECODERS[kind](expected_codes, expected_scale), "decoded values")


# ------------------------------------------------------------------------------------------------------------
# the C++ header

_HARNESS = r"""
#include <torch/extension.h>
#include "state_codes.h"
using namespace fused_stable::state_codes;

// encode then decode each row of x [rows, 128] over its first n elements (the rest left as zeros)
std::vector<torch::Tensor> codec(torch::Tensor x, bool is_signed, int64_t n) {
  const int64_t rows = x.size(0), q = x.size(1);
  auto codes = torch::zeros({rows, q}, is_signed ? torch::kInt8 : torch::kUInt8);
  auto scale = torch::empty({rows}, torch::kFloat);
  auto out = torch::zeros({rows, q}, torch::kFloat);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_ptr<float>() + r * q;
    float* decoded = out.data_ptr<float>() + r * q;
    if (is_signed) {
      int8_t* c = codes.data_ptr<int8_t>() + r * q;
      scale.data_ptr<float>()[r] = encode_signed(row, c, n);
      decode_signed(c, scale.data_ptr<float>()[r], decoded, n);
    } else {
      uint8_t* c = codes.data_ptr<uint8_t>() + r * q;
      scale.data_ptr<float>()[r] = encode_unsigned(row, c, n);
      decode_unsigned(c, scale.data_ptr<float>()[r], decoded, n);
    }
  }
  return {codes, scale, out};
}
"""


@pytest.fixture(scope="module")
def cpp_codec():
    from torch.utils import cpp_extension

    from fused_stable.backends.torch import cpu_ops

    if not cpu_ops.available():  # as test_cpu_ops.py: no C++ compiler here, so no compiled op to agree with
        pytest.skip("the compiled CPU ops could not be built here")
    digest = hashlib.sha256(HEADER.read_bytes() + _HARNESS.encode()).hexdigest()[:12]
    return cpp_extension.load_inline(
        name=f"fused_stable_state_codes_test_{digest}",
        cpp_sources=[_HARNESS],
        functions=["codec"],
        extra_include_paths=[str(HEADER.parent)],
        extra_cflags=cpu_ops.CFLAGS,
        verbose=False,
    )


@pytest.mark.parametrize("kind", [SIGNED, UNSIGNED], ids=["signed", "unsigned"])
@pytest.mark.parametrize("n", [QUANT_BLOCK, 77], ids=["whole", "tail"])
def test_cpp_codes_are_the_references_bit_for_bit(cpp_codec, kind, n):
    """n = 77: a tensor's last, partial block; the reference pads it with zeros, which change nothing."""
    x = blocks(kind)
    x[:, n:] = 0.0
    codes, scale, decoded = cpp_codec.codec(x, kind == SIGNED, n)
    expected_codes, expected_scale = state_format.ENCODERS[kind](x)
    assert torch.equal(codes, expected_codes)
    _assert_bits_equal(scale, expected_scale, "scales")
    expected = state_format.DECODERS[kind](expected_codes, expected_scale)
    expected[:, n:] = 0.0  # the harness decodes only the block's n elements
    _assert_bits_equal(decoded, expected, "decoded values")
