"""fp16-style dynamic loss scaling: fused_stable.GradScaler and torch's, against torch's documented recipe."""

from __future__ import annotations

import pytest
import torch
from helpers import BACKEND_PARAMS, assert_close, no_host_reads

import fused_stable
from fused_stable import FusedAdamW

SHAPES = [(5,), (33, 3), (1025,)]
STEPS = 10
INF_STEPS = {3, 4, 7}  # overflow steps: the scale must back off and the update must be skipped


def designed_inputs(step):
    """Inputs whose gradient of sum(w * x) is x itself; some steps carry an inf (an overflow)."""
    gen = torch.Generator().manual_seed(step)
    xs = [torch.randn(s, generator=gen) * 10 for s in SHAPES]
    if step in INF_STEPS:
        xs[1][2, 1] = float("inf") if step != 4 else float("nan")
    return xs


def loss_of(params, xs):
    return sum((p * x).sum() for p, x in zip(params, xs))


def initial_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def scaler_kwargs():
    return dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)


def run_torch_recipe():
    params = initial_params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs())
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss_of(params, designed_inputs(step))).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return params, scales


def run_fused(backend, scaler_cls, explicit_unscale):
    params = initial_params()
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, backend=backend)
    scaler = scaler_cls("cpu", **scaler_kwargs())
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss_of(params, designed_inputs(step))).backward()
        if explicit_unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return params, scales, opt


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize(
    "scaler_cls, explicit_unscale",
    [
        (fused_stable.GradScaler, False),
        (fused_stable.GradScaler, True),
        (torch.amp.GradScaler, False),
        (torch.amp.GradScaler, True),
    ],
    ids=["fused-scaler", "fused-scaler-unscale_", "torch-scaler", "torch-scaler-unscale_"],
)
def test_same_params_and_scale_sequence_as_torch_recipe(backend, scaler_cls, explicit_unscale):
    ref_params, ref_scales = run_torch_recipe()
    params, scales, opt = run_fused(backend, scaler_cls, explicit_unscale)
    assert scales == ref_scales
    assert ref_scales[3] < ref_scales[2]  # the overflow really backed off the scale
    for a, b in zip(params, ref_params):
        assert_close(a, b, 1e-5, 1e-6, "params")
    assert opt.skipped_steps.item() == len(INF_STEPS)
    assert opt.applied_steps.item() == STEPS - len(INF_STEPS)
    assert float(opt.state[params[0]]["step"]) == STEPS - len(INF_STEPS)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fused_scaler_step_and_update_make_no_host_reads(backend):
    params = initial_params()
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, backend=backend)
    scaler = fused_stable.GradScaler("cpu", **scaler_kwargs())
    for step in range(5):
        opt.zero_grad()
        scaler.scale(loss_of(params, designed_inputs(step))).backward()
        with no_host_reads():
            scaler.step(opt)
            scaler.update()
    assert opt.skipped_steps.item() == 2


def test_fused_scaler_skips_torch_inf_check_pass(monkeypatch):
    """torch's scaler runs `_amp_foreach_non_finite_check_and_unscale_` over every grad before stepping a
    FusedAdamW; ours leaves the check to the optimizer's norm pass."""
    calls = {"n": 0}
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counting)
    for cls, expected in ((torch.amp.GradScaler, 1), (fused_stable.GradScaler, 0)):
        calls["n"] = 0
        params = initial_params()
        opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, backend="torch")
        scaler = cls("cpu", **scaler_kwargs())
        scaler.scale(loss_of(params, designed_inputs(0))).backward()
        scaler.step(opt)
        scaler.update()
        assert calls["n"] == expected, cls


def test_fused_scaler_with_a_plain_optimizer_behaves_like_torch():
    params = initial_params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = fused_stable.GradScaler("cpu", **scaler_kwargs())
    scaler.scale(loss_of(params, designed_inputs(3))).backward()  # an overflow step
    before = [p.detach().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert scaler.get_scale() == 2.0**9


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("flag", [0.0, 1.0], ids=["found_inf-0", "found_inf-1"])
def test_a_scaler_found_inf_skips_the_step_even_with_finite_grads(backend, flag):
    """GradScaler's protocol hands the optimizer `grad_scale` and `found_inf`; the step is skipped when found_inf
    is set even if this optimizer's own grads are finite (a sharded scaler all-reduces found_inf, so a rank whose
    grads are finite must skip with the others), and applied when it is not."""
    params = initial_params()
    before = [p.detach().clone() for p in params]
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, backend=backend)
    for p, x in zip(params, designed_inputs(0)):
        p.grad = x * 8.0  # finite, scaled by 8
    opt.grad_scale, opt.found_inf = torch.tensor(8.0), torch.tensor(flag)
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf
    skipped = flag == 1.0
    assert int(opt.skipped_steps) == int(skipped) and bool(opt.last_step_skipped) == skipped
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b) == skipped
        assert float(opt.state[p]["step"]) == (0.0 if skipped else 1.0)
    assert float(opt.grad_norm) == pytest.approx(
        float(torch.stack([x.norm() for x in designed_inputs(0)]).norm()), rel=1e-5
    )  # unscaled by 8
