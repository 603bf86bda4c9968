"""8-bit Muon momentum (issue 50 item 4): a Muon group with state_precision="8bit" keeps each matrix's momentum
buffer as AdamW exp_avg's signed blockwise codes (state_format.py) under torch's key `momentum_buffer`, with its
block scales under `momentum_buffer_scale` (a matrix under MIN_QUANTISED_NUMEL elements keeps an fp32 buffer).

The oracle is exact: torch.optim.Muon (on the grads times the fused step's clip coefficient, as
test_fused_muon.py) with each coded buffer replaced after every step by the codec's round trip
(`state_format.decode(state_format.encode(buf))`) is the 8-bit run bit for bit, params and codes: a step decodes,
does torch's arithmetic in fp32, encodes once. Against the fp32 run the distance is bounded from the codec's own
error, measured on the run's buffers (see test_the_8bit_run_stays_within_the_codecs_error_of_the_fp32_run).
"""

from __future__ import annotations

import io

import pytest
import torch

from fused_stable import FusedMuon, state_format
from fused_stable.rules.muon import torch as muon_torch

# three matrices above the 8-bit threshold (one of each orientation, two of one shape: a batch) and one below it
SHAPES = [(128, 64), (128, 64), (64, 96), (17, 5)]
CODED = 3
KEY, SCALE = "momentum_buffer", "momentum_buffer_scale"
STEPS = 6
MAX_NORM = 1.0
LR = 0.02


@pytest.fixture(params=["host", "device"])
def decisions(request, monkeypatch):
    """Both kinds of decisions: read on the host (CPU), or selected with torch.where (what CUDA runs)."""
    monkeypatch.setattr(muon_torch, "DECIDE_ON_HOST", request.param == "host")
    return request.param


def _init():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=gen) * 3 for shape in SHAPES]


def _make(params, precision="8bit", **muon):
    group = {"params": params, "use_muon": True, "lr": LR, **muon}
    return FusedMuon([group], max_grad_norm=MAX_NORM, state_precision=precision, backend="torch")


def _run(opt, params, steps, grads=_grads) -> list[torch.Tensor]:
    """Steps `opt`; returns each step's clip coefficient, recomputed from the grad_norm read-out as the decision
    kernel computes it."""
    coefficients = []
    for step in steps:
        for p, g in zip(params, grads(step)):
            p.grad = g.clone()
        opt.step()
        norm = opt.grad_norm.clone()
        coefficients.append(torch.minimum(torch.tensor(1.0), torch.tensor(MAX_NORM) / (norm + torch.tensor(1e-6))))
    return coefficients


def _fused(precision="8bit", steps=STEPS, **muon):
    params = [torch.nn.Parameter(t.clone()) for t in _init()]
    opt = _make(params, precision, **muon)
    return params, opt, _run(opt, params, range(steps))


def _round_trip(buffer: torch.Tensor) -> torch.Tensor:
    return state_format.decode(*state_format.encode(buffer, KEY), KEY)


def _torch_with_codec(coefficients, **muon):
    """torch.optim.Muon on the grads times `coefficients`, each coded buffer through the codec after each step."""
    params = [torch.nn.Parameter(t.clone()) for t in _init()]
    reference = torch.optim.Muon(params, lr=LR, **muon)
    for step, coefficient in enumerate(coefficients):
        for p, g in zip(params, _grads(step)):
            p.grad = g * coefficient
        reference.step()
        for p in params[:CODED]:
            buffer = reference.state[p][KEY]
            buffer.copy_(_round_trip(buffer))
    return params, reference


@pytest.mark.parametrize("muon", [{}, {"nesterov": False}], ids=["nesterov", "plain"])
def test_8bit_momentum_is_torch_muon_with_the_codec_after_each_step(decisions, muon):
    ours, opt, coefficients = _fused(**muon)
    theirs, reference = _torch_with_codec(coefficients, **muon)
    assert all(float(c) < 1.0 for c in coefficients), "the grads are clipped on every step"
    for index, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"param {index}: {(a - b).abs().max():.3g} off"
        state, buffer = opt.state[a], reference.state[b][KEY]
        if index < CODED:
            codes, scale = state_format.encode(buffer, KEY)
            assert state[KEY].dtype == torch.int8 and state[SCALE].shape == (state_format.num_blocks(a.numel()),)
            assert torch.equal(state[KEY], codes) and torch.equal(state[SCALE], scale), f"codes of param {index}"
        else:  # below the threshold: an fp32 buffer, torch's own
            assert SCALE not in state and torch.equal(state[KEY], buffer)
        assert torch.equal(opt.state_fp32(a, KEY), buffer)


def test_a_skipped_step_leaves_params_codes_and_scales_bit_identical(decisions):
    """An inf in one matrix's grad skips the step: every param, code, scale and `step` bit-identical (on device
    decisions the old codes are selected: re-encoding their decoding need not give them back); the next step goes
    on as the run without the bad step."""

    def bad(step):
        grads = _grads(step)
        if step == 2:
            grads[1][3, 4] = float("inf")
        return grads

    params = [torch.nn.Parameter(t.clone()) for t in _init()]
    opt = _make(params)
    _run(opt, params, range(2))
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    _run(opt, params, [2], bad)
    assert int(opt.skipped_steps) == 1
    for index, (p, old, state) in enumerate(zip(params, before, states)):
        assert torch.equal(p.detach(), old), f"param {index} moved on a skipped step"
        for key, value in state.items():
            assert torch.equal(opt.state[p][key], value), f"{key} of param {index} moved on a skipped step"
    _run(opt, params, [3])
    clean = [torch.nn.Parameter(t.clone()) for t in _init()]
    clean_opt = _make(clean)
    _run(clean_opt, clean, [0, 1, 3])
    assert all(torch.equal(a, b) for a, b in zip(params, clean))
    # codes a state may hold that re-encoding would not give back (a loaded or hand-made state whose blocks'
    # largest code is under 127: their decoding re-encodes with another scale): a skip keeps them too
    codes = opt.state[params[0]][KEY]
    codes.copy_(codes // 2)
    held = {k: v.clone() for k, v in opt.state[params[0]].items()}
    _run(opt, params, [2], bad)
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in held.items())


def test_the_8bit_run_stays_within_the_codecs_error_of_the_fp32_run():
    """The codec's error, measured on this run's fp32 buffers: e = the largest relative (Frobenius) error of a
    buffer's round trip (measured 0.71%). Each step's Newton-Schulz input, the Nesterov mix g + m (B - g), moves by
    at most m e ||B||, so to first order each step's update moves by at most its share e, and the run by at most
    STEPS x e of one step, lr x sqrt(rows / cols) x the update's largest element (at most its largest singular
    value, ~1.2 with Keller Jordan's coefficients; taken as 2 for the first-order approximation). Measured 6.6e-4
    after 6 steps, bound 2.4e-3; the fp32 buffer below the threshold is torch's, and its param's bits too."""
    exact, exact_opt, _ = _fused("fp32")
    ours, _, _ = _fused("8bit")
    rounded = max(
        float((_round_trip(exact_opt.state[p][KEY]) - exact_opt.state[p][KEY]).norm() / exact_opt.state[p][KEY].norm())
        for p in exact[:CODED]
    )
    assert 0 < rounded < 0.02, rounded
    bound = STEPS * rounded * LR * 2**0.5 * 2
    for index, (a, b) in enumerate(zip(ours, exact)):
        difference = float((a - b).detach().abs().max())
        assert difference <= bound, (index, difference, bound)
        assert (difference == 0) == (index >= CODED), index  # the fp32 buffer below the threshold: torch's bits


def test_a_resumed_8bit_run_continues_bit_for_bit_and_torch_states_load_both_ways(tmp_path):
    """A state dict round trip mid-run (torch.save / torch.load) continues bit for bit; torch_state_dict() is
    torch.optim.Muon's (fp32 `momentum_buffer`, the codes decoded), and torch's state loads into an 8-bit group as
    the codes of its buffers."""
    whole, whole_opt, _ = _fused(steps=4)
    params = [torch.nn.Parameter(t.clone()) for t in _init()]
    opt = _make(params)
    _run(opt, params, range(2))
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    entry = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)["state"][0]
    assert entry[KEY].dtype == torch.int8 and SCALE in entry and state_format.CODES_KEY in entry
    resumed = _make(params)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    _run(resumed, params, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(params, whole))
    for a, b in zip(params, whole):
        assert all(torch.equal(resumed.state[a][k], whole_opt.state[b][k]) for k in whole_opt.state[b])

    mine = whole_opt.torch_state_dict()
    assert all(set(entry) == {"step", KEY} and entry[KEY].dtype == torch.float32 for entry in mine["state"].values())
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    reference = torch.optim.Muon(theirs, lr=LR)
    reference.load_state_dict(mine)
    for p, q in zip(whole, theirs):
        assert torch.equal(reference.state[q][KEY], whole_opt.state_fp32(p, KEY))

    loaded = _make([torch.nn.Parameter(p.detach().clone()) for p in whole])
    loaded.load_state_dict(reference.state_dict())
    for p, q in zip(loaded.param_groups[0]["params"], theirs):
        state = loaded.state[p]
        if p.numel() >= state_format.MIN_QUANTISED_NUMEL:
            codes, scale = state_format.encode(reference.state[q][KEY], KEY)
            assert torch.equal(state[KEY], codes) and torch.equal(state[SCALE], scale)
        else:
            assert torch.equal(state[KEY], reference.state[q][KEY])


def test_8bit_momentum_state_bytes_are_what_opt_state_holds():
    params = [torch.nn.Parameter(t.clone()) for t in _init()]
    opt = _make(params)
    planned = opt.state_bytes()
    _run(opt, params, [0])
    held = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    coded = sum(p.numel() + 4 * state_format.num_blocks(p.numel()) for p in params[:CODED])
    assert planned == opt.state_bytes() == held == coded + 4 * params[CODED].numel() + 4 * len(params)
