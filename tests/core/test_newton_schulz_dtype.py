"""Newton-Schulz's dtype by device (issue 50 item 6): bf16 (torch.optim.Muon's) on CUDA and on a CPU with native
bf16 products, fp32 on a CPU without them (where torch's bf16 matmul is emulated, several times slower), the
environment's FUSED_STABLE_NEWTON_SCHULZ over both; FusedMuon.describe() and the sft split line say which and why.
The suite pins bf16 (tests/conftest.py); these tests set the choice themselves."""

from __future__ import annotations

import pytest
import torch
from torch.optim import _muon as torch_muon

from fused_stable import FusedMuon
from fused_stable.rules import muon
from fused_stable.rules.muon import newton_schulz
from fused_stable.rules.muon.newton_schulz import ENV, newton_schulz_choice, orthogonalize

SHAPES = [(48, 32), (32, 48), (32, 32), (48, 32)]


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Unsets the suite's pin; returns a setter for whether this CPU 'multiplies bf16 natively'."""
    monkeypatch.delenv(ENV, raising=False)

    def native(value: bool) -> None:
        monkeypatch.setattr(newton_schulz, "_cpu_multiplies_bf16", lambda: value)

    return native


@pytest.mark.parametrize("native", [True, False])
def test_the_choice_follows_the_cpu_and_cuda_keeps_torchs(cpu_bf16, native):
    cpu_bf16(native)
    dtype, why = newton_schulz_choice("cpu")
    assert dtype == ("bf16" if native else "fp32")
    assert ("natively" in why) if native else ("no native bf16 products" in why)
    assert newton_schulz_choice(torch.device("cuda")) == ("bf16", "torch.optim.Muon's dtype")


def test_the_environment_overrides_the_choice_and_a_bad_value_is_one_line(cpu_bf16, monkeypatch):
    cpu_bf16(True)
    monkeypatch.setenv(ENV, "fp32")
    assert newton_schulz_choice("cpu") == ("fp32", f"{ENV}=fp32")
    assert newton_schulz_choice("cuda")[0] == "fp32"
    monkeypatch.setenv(ENV, "float16")
    with pytest.raises(ValueError, match=f"{ENV}='float16': Newton-Schulz runs in bf16 or fp32"):
        newton_schulz_choice("cpu")


def _matrices() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _fp64_newton_schulz(g: torch.Tensor) -> torch.Tensor:
    """torch's iteration (torch/optim/_muon.py) in fp64: the exact result both dtypes approximate."""
    a, b, c = muon.NS_COEFFICIENTS
    x = g.double()
    tall = g.size(0) > g.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=muon.EPS)
    for _ in range(muon.NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_fp32_newton_schulz_is_the_iteration_in_fp32(monkeypatch):
    """fp32's result is the fp64 iteration's within fp32 rounding (measured 7.8e-7 at most), bf16's (torch's)
    within bf16 rounding only (measured 1.0e-2): more exact, not torch's bits."""
    updates = _matrices()
    exact = [_fp64_newton_schulz(u) for u in updates]
    errors = {}
    for name in ("fp32", "bf16"):
        monkeypatch.setenv(ENV, name)
        got = orthogonalize(updates, muon.NS_COEFFICIENTS, muon.NS_STEPS, muon.EPS)
        assert all(r.dtype == newton_schulz._DTYPES[name] for r in got)
        errors[name] = max(float((r.double() - e).abs().max()) for r, e in zip(got, exact))
    assert errors["fp32"] < 1e-5 < 1e-3 < errors["bf16"], errors


def _fp32_zeropower(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's _zeropower_via_newtonschulz with its bf16 cast made an fp32 one."""
    a, b, c = ns_coefficients
    ortho = grad.float()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if grad.size(0) > grad.size(1) else ortho


def test_fused_muon_in_fp32_is_torch_muon_with_an_fp32_iteration_and_says_so(cpu_bf16, monkeypatch):
    """On a CPU without native bf16 products FusedMuon runs torch.optim.Muon's step with the iteration in fp32
    (torch's own function with its cast changed, monkeypatched), bit for bit, and describe() says so."""
    cpu_bf16(False)
    params = [torch.nn.Parameter(m.clone()) for m in _matrices()]
    theirs = [torch.nn.Parameter(m.clone()) for m in _matrices()]
    opt = FusedMuon([{"params": params, "use_muon": True, "lr": 0.02}], backend="torch")
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _fp32_zeropower)
    reference = torch.optim.Muon(theirs, lr=0.02)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(params, theirs):
            p.grad = torch.randn(p.shape, generator=gen) * 0.1
            q.grad = p.grad.clone()
        opt.step()
        reference.step()
    assert all(torch.equal(p, q) for p, q in zip(params, theirs))
    assert opt.describe()["newton_schulz"]["dtype"] == "fp32"
    assert "no native bf16 products" in opt.describe()["newton_schulz"]["why"]
