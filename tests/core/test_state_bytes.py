"""`state_bytes()` (what the trainer's header and the DeepSpeed integration report) equals the bytes opt.state holds
once every param has stepped, for every rule and state precision, and is the same figure before the first step;
`state_fp32(p, name)` gives any stored state as fp32 whatever its precision."""

from __future__ import annotations

import pytest
import torch

from fused_stable import FusedAdafactor, FusedAdamW, FusedLion, FusedMuon, muon_param_groups
from fused_stable.state_format import MIN_QUANTISED_NUMEL

PRECISIONS = ("fp32", "bf16", "8bit")


def _held(opt) -> int:
    """The bytes of every tensor opt.state holds."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    # a matrix above the 8-bit threshold, odd sizes, a bias and a small matrix that keep fp32 in "8bit"
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 96), torch.nn.Linear(96, 80), torch.nn.ReLU(), torch.nn.Linear(80, 7)
    )
    assert 80 * 96 >= MIN_QUANTISED_NUMEL > 80 * 7
    return model.to(dtype)


def _step(model, opt) -> None:
    out = model(torch.arange(12).reshape(3, 4)).float().square().mean()
    out.backward()
    opt.step()


FACTORIES = {
    "adamw": lambda m, precision: FusedAdamW(m.parameters(), state_precision=precision, backend="torch"),
    "adamw-amsgrad": lambda m, precision: FusedAdamW(
        m.parameters(), amsgrad=True, state_precision=precision, backend="torch"
    ),
    "adamw-masters": lambda m, precision: FusedAdamW(
        m.parameters(), master_weights=True, state_precision=precision, backend="torch"
    ),
    "lion": lambda m, precision: FusedLion(m.parameters(), state_precision=precision, backend="torch"),
    "muon": lambda m, precision: FusedMuon(
        [{**g, "state_precision": precision} for g in muon_param_groups(m)],
        state_precision=precision,
        backend="torch",
    ),
}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_state_bytes_equals_what_opt_state_holds(name, precision):
    dtype = torch.bfloat16 if name == "adamw-masters" else torch.float32
    model = _model(dtype)
    opt = FACTORIES[name](model, precision)
    planned = opt.state_bytes()
    _step(model, opt)
    assert all(p in opt.state for p in model.parameters())
    assert opt.state_bytes() == _held(opt) == planned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adafactor_state_bytes_equals_what_opt_state_holds(dtype):
    """Adafactor's factored states (row_var + col_var of each matrix, variance of each bias) in the param's dtype,
    counted by its matrix.py; its only state precision is fp32 (bf16 and 8-bit are refused: test_fused_adafactor)."""
    model = _model(dtype)
    opt = FusedAdafactor(model.parameters(), backend="torch")
    planned = opt.state_bytes()
    _step(model, opt)
    assert all(p in opt.state for p in model.parameters())
    assert opt.state_bytes() == _held(opt) == planned
    factored = sum((p.shape[0] + p.shape[1]) * p.element_size() for p in model.parameters() if p.ndim == 2)
    vectors = sum(p.numel() * p.element_size() for p in model.parameters() if p.ndim == 1)
    assert planned == factored + vectors + 4 * len(list(model.parameters()))


def test_a_muon_groups_momentum_is_counted():
    """Muon's momentum buffers are the rule's state (its matrix.py's state_bytes), not left out."""
    model = _model()
    opt = FusedMuon(muon_param_groups(model), backend="torch")
    _step(model, opt)
    muon_params = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    assert muon_params and opt.state_bytes() == _held(opt)
    buffers = sum(opt.state[p]["momentum_buffer"].numel() * 4 for p in muon_params)
    assert buffers == sum(p.numel() * 4 for p in muon_params)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_state_fp32_decodes_every_precision(precision):
    """The same model and grads with fp32 state and with `precision`: after one step the accessor's fp32 values
    are the fp32 state itself (fp32), or within the format's resolution of it."""
    runs = {}
    for kind in ("fp32", precision):
        model = _model()
        opt = FusedAdamW(model.parameters(), state_precision=kind, backend="torch")
        _step(model, opt)
        runs[kind] = (opt, model[1].weight)
    (exact_opt, exact_weight), (opt, weight) = runs["fp32"], runs[precision]
    for name in ("exp_avg", "exp_avg_sq"):
        value = opt.state_fp32(weight, name)
        exact = exact_opt.state[exact_weight][name]
        assert value.dtype == torch.float32 and value.shape == weight.shape
        if precision == "fp32":
            assert torch.equal(value, exact) and value.data_ptr() != exact.data_ptr()  # a copy
        else:  # bf16: under one ulp (2**-7 relative: stochastic rounding); 8-bit: a code step of the block's max
            bound = 2**-7 * exact.abs() if precision == "bf16" else 2 / 127 * exact.abs().max()
            assert ((value - exact).abs() <= bound + 1e-30).all()
    with pytest.raises(KeyError, match="keeps no state 'momentum_buffer'"):
        opt.state_fp32(weight, "momentum_buffer")
