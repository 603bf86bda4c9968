"""Newton-Schulz's symmetric products by row blocks (issue 50 item 6, rules/muon/newton_schulz.py): the Gram X X^T
and its square A A (= A A^T) computed from the blocks on and above the diagonal, those below their transposes.

- `symmetric_product` is the whole product (fp64: to its rounding), any batch, rows not a multiple of the blocks;
- the choice: blocks on a CPU unless its bf16 products run on AMX, never on CUDA, the environment over both, and
  ONEDNN_MAX_CPU_ISA (a cap on oneDNN, which runs torch's bf16 CPU products) seen;
- the blocks run when chosen (their products counted) and FusedMuon.describe() / the sft line say so;
- on a CPU whose bf16 products are not AMX's (an AMX CPU capped at AVX512-BF16, in a fresh process) the blocked
  iteration and FusedMuon's step are torch.optim.Muon's bits (measured there); on a CPU without AMX at all (an AMD
  EPYC with AVX512-BF16, not measured) they are held to the fp64 iteration as closely as torch's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import CountDeviceOps

from fused_stable import FusedMuon
from fused_stable.rules import muon
from fused_stable.rules.muon import newton_schulz
from fused_stable.rules.muon.newton_schulz import (
    BLOCKS_ENV,
    gram_blocks,
    gram_blocks_choice,
    orthogonalize_stack,
    symmetric_product,
)
from fused_stable.train.run.setup import muon_split_text

HERE = os.path.dirname(os.path.abspath(__file__))
COEFFICIENTS = muon.NS_COEFFICIENTS


def _stack(n: int, rows: int, cols: int, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("n, rows, cols, blocks", [(1, 8, 5, 2), (3, 13, 7, 3), (2, 577, 40, 3), (2, 9, 9, 4)])
def test_symmetric_product_is_the_whole_product(n, rows, cols, blocks):
    """fp64, so the blocks' sums and the whole product's differ by rounding only (1e-12 relative, measured
    below 1e-15): a block misplaced, untransposed or missing is O(1) off."""
    x = _stack(n, rows, cols)
    whole = x @ x.mT
    got = symmetric_product(x, blocks)
    assert torch.equal(got, got.mT), "the blocks below the diagonal are the transposes of those above"
    torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)
    add = whole + 1.0  # symmetric, as the Gram it stands for
    torch.testing.assert_close(
        symmetric_product(x, blocks, add=add, beta=-4.775, alpha=2.0315),
        torch.baddbmm(add, x, x.mT, beta=-4.775, alpha=2.0315),
        rtol=1e-12,
        atol=1e-12,
    )


def test_row_blocks_are_about_192_rows_and_at_most_four():
    assert [gram_blocks(rows) for rows in (1, 383, 384, 576, 767, 768, 4096)] == [1, 1, 2, 3, 3, 4, 4]


@pytest.fixture
def cpu(monkeypatch):
    """Unsets the environment's choices; returns a setter for the CPU's AMX and AVX512-BF16 (cpuid) and the
    ONEDNN_MAX_CPU_ISA cap, the cached answers cleared."""
    for name in (BLOCKS_ENV, newton_schulz.ENV, "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)

    def set_cpu(amx: bool, avx512_bf16: bool, cap: str | None = None) -> None:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        if cap is not None:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        newton_schulz._cpu_uses_amx.cache_clear()
        newton_schulz._cpu_multiplies_bf16.cache_clear()

    yield set_cpu
    newton_schulz._cpu_uses_amx.cache_clear()
    newton_schulz._cpu_multiplies_bf16.cache_clear()


def test_blocks_where_bf16_products_are_not_amxs(cpu):
    cpu(amx=True, avx512_bf16=True)
    assert gram_blocks_choice("cpu", torch.bfloat16)[0] is False  # AMX: whole Grams are faster, other bits
    assert gram_blocks_choice("cpu", torch.float32)[0] is True  # fp32 products are not AMX's
    cpu(amx=False, avx512_bf16=True)
    assert gram_blocks_choice(torch.device("cuda"), torch.bfloat16)[0] is False  # not measured there
    assert gram_blocks_choice(torch.device("cuda"), torch.float32)[0] is False
    blocks, why = gram_blocks_choice("cpu", torch.bfloat16)
    assert blocks and "blocks above the diagonal" in why
    cpu(amx=True, avx512_bf16=True, cap="avx512_core_bf16")  # AMX capped away: its products are AVX512-BF16's
    assert gram_blocks_choice("cpu", torch.bfloat16)[0] is True
    assert newton_schulz.newton_schulz_choice("cpu")[0] == "bf16"
    cpu(amx=True, avx512_bf16=True, cap="AVX512_CORE_AMX")
    assert gram_blocks_choice("cpu", torch.bfloat16)[0] is False
    cpu(amx=False, avx512_bf16=True, cap="avx512_core_fp16")  # above AVX512-BF16 (oneDNN's AVX10_1_512)
    assert newton_schulz.newton_schulz_choice("cpu")[0] == "bf16"
    cpu(amx=True, avx512_bf16=True, cap="AVX512_CORE")  # below bf16 products: emulated, so fp32
    assert newton_schulz.newton_schulz_choice("cpu")[0] == "fp32"


def test_the_environment_overrides_the_blocks_and_a_bad_value_is_one_line(cpu, monkeypatch):
    cpu(amx=True, avx512_bf16=True)
    monkeypatch.setenv(BLOCKS_ENV, "1")
    assert gram_blocks_choice("cpu", torch.bfloat16) == (True, f"{BLOCKS_ENV}=1")
    monkeypatch.setenv(BLOCKS_ENV, "0")
    assert gram_blocks_choice("cpu", torch.float32) == (False, f"{BLOCKS_ENV}=0")
    monkeypatch.setenv(BLOCKS_ENV, "yes")
    with pytest.raises(ValueError, match=f"{BLOCKS_ENV}='yes': set it to 1"):
        gram_blocks_choice("cpu", torch.float32)


def _products(stack: torch.Tensor, **options) -> list[str]:
    with CountDeviceOps() as ops:
        orthogonalize_stack(stack, COEFFICIENTS, 1, muon.EPS, dtype=torch.float32, **options)
    return [op for op in ops.ops if "bmm" in op]


def test_the_blocks_run_when_chosen(cpu, monkeypatch):
    """One iteration of a wide 400-row stack (2 blocks): the Gram's 3 block products, its square's 3, then the
    update's whole one, where the whole iteration takes 1 + 2; a tall stack's first Gram is its transposed view's,
    whole (torch's layout); under 384 rows one block is the whole product."""
    wide = _stack(2, 400, 450, torch.float32)
    assert _products(wide, blocks=False) == ["aten.bmm.default"] + ["aten.baddbmm.default"] * 2
    assert _products(wide, blocks=True) == ["aten.bmm.default"] * 3 + ["aten.baddbmm.default"] * 4
    assert _products(wide.mT.contiguous(), blocks=True) == ["aten.bmm.default"] + ["aten.baddbmm.default"] * 4
    assert len(_products(_stack(2, 383, 450, torch.float32), blocks=True)) == 3
    cpu(amx=False, avx512_bf16=False)  # the choice by device: fp32 products, blocks
    assert len(_products(wide)) == 7
    monkeypatch.setenv(BLOCKS_ENV, "0")
    assert len(_products(wide)) == 3


def test_describe_counts_the_matrices_by_blocks(cpu, monkeypatch):
    cpu(amx=False, avx512_bf16=True)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(400, 384), (383, 1000), (64, 64)]]
    experts = torch.nn.Parameter(torch.zeros(3, 400, 500))
    opt = FusedMuon([{"params": [*params, experts], "use_muon": True}])
    schulz = opt.describe()["newton_schulz"]
    assert schulz["gram_blocks"] == 1 + 3  # the 400 x 384 matrix and the three experts
    assert "blocks above the diagonal" in schulz["blocks_why"]
    line = muon_split_text(SimpleNamespace(optimizer=opt), muon_lora=False)
    assert line.endswith(f", its Gram products by blocks for 4 matrices ({schulz['blocks_why']})"), line
    monkeypatch.setenv(BLOCKS_ENV, "0")
    assert opt.describe()["newton_schulz"]["gram_blocks"] == 0
    assert "Gram" not in muon_split_text(SimpleNamespace(optimizer=opt), muon_lora=False)


# the fresh process's check: ONEDNN_MAX_CPU_ISA must be set before torch loads oneDNN
_CAPPED = r"""
import json, torch
from torch.optim._muon import _zeropower_via_newtonschulz
from fused_stable import FusedMuon
from fused_stable.rules import muon
from fused_stable.rules.muon.newton_schulz import gram_blocks_choice, orthogonalize_stack

def exact(g):
    a, b, c = muon.NS_COEFFICIENTS
    x = g.double().T if g.size(0) > g.size(1) else g.double()
    x = x / x.norm().clamp(min=muon.EPS)
    for _ in range(muon.NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x

gen = torch.Generator().manual_seed(0)
out = {"blocks": gram_blocks_choice("cpu", torch.bfloat16)[0], "bits": True, "error": 0.0, "torch_error": 0.0}
for shape in [(400, 520), (1536, 576), (577, 577)]:  # (1536, 576): a tall first Gram blocked is other bits
    stack = torch.randn(2, *shape, generator=gen)
    got = orthogonalize_stack(stack, muon.NS_COEFFICIENTS, muon.NS_STEPS, muon.EPS)
    for g, result in zip(stack, got):
        theirs = _zeropower_via_newtonschulz(g.clone(), muon.NS_COEFFICIENTS, muon.NS_STEPS, muon.EPS)
        out["bits"] &= torch.equal(result, theirs)
        out["error"] = max(out["error"], float((result.double() - exact(g)).abs().max()))
        out["torch_error"] = max(out["torch_error"], float((theirs.double() - exact(g)).abs().max()))
shapes = [(400, 520), (400, 520), (520, 400)]
ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
opt = FusedMuon([{"params": ours, "use_muon": True, "lr": 0.02}])
reference = torch.optim.Muon(theirs, lr=0.02)
for _ in range(3):
    for p, q in zip(ours, theirs):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    opt.step()
    reference.step()
out["step_bits"] = all(torch.equal(p, q) for p, q in zip(ours, theirs))
out["described"] = opt.describe()["newton_schulz"]["gram_blocks"]
print(json.dumps(out))
"""


@pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(), reason="the check caps oneDNN at AVX512-BF16")
def test_blocked_iteration_is_torchs_with_avx512_bf16_products():
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", newton_schulz.ENV: "bf16"}
    env.pop(BLOCKS_ENV, None)
    run = subprocess.run([sys.executable, "-c", _CAPPED], env=env, capture_output=True, text=True, cwd=HERE)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["blocks"] and out["described"] == 3, out
    # as near the fp64 iteration as torch's bf16 (measured: both 3.6e-3 where the bits are equal)
    assert 0 < out["error"] <= 1.25 * out["torch_error"], out
    if torch.cpu._is_amx_tile_supported():  # an AMX CPU capped at AVX512-BF16: measured torch's bits
        assert out["bits"] and out["step_bits"], out


def test_a_step_keeps_the_choice_it_was_built_with(monkeypatch):
    """The blocks are chosen once, when FusedMuon's step is built (as the dtype): the environment changed later
    does not split one run's steps between two arithmetics (its describe() reads the environment anew)."""
    monkeypatch.setenv(BLOCKS_ENV, "1")
    param = torch.nn.Parameter(_stack(1, 400, 400, torch.float32)[0])
    param.grad = _stack(1, 400, 400, torch.float32, seed=1)[0]
    opt = FusedMuon([{"params": [param], "use_muon": True}])
    opt.step()
    opt.step()  # the first step made the states, and the second its plan with them: built from here on
    monkeypatch.setenv(BLOCKS_ENV, "0")
    with CountDeviceOps() as ops:
        opt.step()
    bmm = sum("bmm" in op for op in ops.ops)
    assert bmm == muon.NS_STEPS * 7, ops.ops  # 3 + 3 block products and the update's, each iteration
