"""Device-side lr schedules, master weights for low-precision params, and the fp64 reference for bf16/fp16."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import (
    BACKEND_PARAMS,
    TOLERANCES,
    assert_close,
    assert_update_close,
    describe_dtype,
    reference_adamw_fp64,
    ulp_distance,
)

from fused_stable import FusedAdamW, schedules

HF = {
    "cosine": (schedules.warmup_cosine, transformers.get_cosine_schedule_with_warmup),
    "linear": (schedules.warmup_linear, transformers.get_linear_schedule_with_warmup),
}


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_factor_matches_transformers(kind):
    total, warmup = 50, 7
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if kind == "constant":
        ours = schedules.constant(warmup)
        hf = transformers.get_constant_schedule_with_warmup(opt, warmup)
    else:
        ours = HF[kind][0](total, warmup)
        hf = HF[kind][1](opt, warmup, total)
    for n in range(total):
        expected = hf.lr_lambdas[0](n)
        assert ours.factor(n) == pytest.approx(expected, abs=1e-12)
        assert ours.factor_tensor(torch.tensor(n)).item() == pytest.approx(expected, abs=1e-6)
    # past the end the factor holds its final value
    assert ours.factor(total + 10) == pytest.approx(ours.factor(total))


def test_min_lr_ratio_matches_transformers_cosine_with_min_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = transformers.get_cosine_with_min_lr_schedule_with_warmup(opt, 5, 40, min_lr_rate=0.1)
    ours = schedules.warmup_cosine(40, 5, min_lr_ratio=0.1)
    for n in range(40):
        assert ours.factor(n) == pytest.approx(hf.lr_lambdas[0](n), abs=1e-12)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_schedule_runs_on_device_and_skipped_steps_do_not_advance_it(backend):
    total, warmup, base_lr = 20, 4, 0.5
    sched = schedules.warmup_cosine(total, warmup)
    params = [torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(3))]
    opt = FusedAdamW(
        [{"params": [params[0]]}, {"params": [params[1]], "lr": 0.1}], lr=base_lr, lr_schedule=sched, backend=backend
    )
    skipped_at = {2, 3, 9}
    applied = 0
    for step in range(12):
        for p in params:
            p.grad = torch.randn(p.shape)
        if step in skipped_at:
            params[1].grad[0] = float("nan")
        opt.step()
        if step in skipped_at:
            assert opt.last_step_skipped.item()
        else:
            assert opt.last_lr.item() == pytest.approx(base_lr * sched.factor(applied), rel=1e-6)
            applied += 1
    assert opt.applied_steps.item() == applied == 12 - len(skipped_at)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_scheduled_update_equals_torch_with_the_same_lr_sequence(backend):
    """Each step's update equals torch AdamW's under transformers' schedule to 1e-6 of the update (measured:
    <= 1.6e-7 on both backends). Seeded, and compared update by update: an fp32 bias correction that loses
    accuracy (e.g. exp(x) - 1 for 1 - beta2**t instead of expm1) errs by ~1e-5 of every update, whatever the
    data, which a parameter-level tolerance would not see."""
    gen = torch.Generator().manual_seed(0)
    sched = schedules.warmup_linear(10, 3)
    init = 0.01 * torch.randn(64, generator=gen)
    ours, theirs = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt = FusedAdamW([ours], lr=0.1, lr_schedule=sched, backend=backend)
    ref = torch.optim.AdamW([theirs], lr=0.1)
    hf = transformers.get_linear_schedule_with_warmup(ref, 3, 10)
    for step in range(8):
        g = torch.randn(64, generator=gen)
        ours.grad, theirs.grad = g.clone(), g.clone()
        before, ref_before = ours.detach().clone(), theirs.detach().clone()
        opt.step(), ref.step(), hf.step()
        if step == 0:  # warm-up factor 0: no update, but the moments and the step count advance
            assert torch.equal(ours, before) and torch.equal(theirs, ref_before)
            continue
        assert_update_close(before, ours, ref_before, theirs, 1e-6, f"update {step}")
    assert_close(ours, theirs, 1e-5, 1e-7, "scheduled params")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=describe_dtype)
@pytest.mark.parametrize("master", [False, True], ids=["no-master", "master"])
def test_low_precision_params_against_fp64_reference(backend, dtype, master):
    gen = torch.Generator().manual_seed(3)
    shapes = [(7,), (1025,), (3, 11)]
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(6)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt = FusedAdamW(params, max_grad_norm=1.0, master_weights=master, backend=backend, **hp)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    ref_p, ref_m, ref_v = reference_adamw_fp64(init, grads, max_norm=1.0, round_to=None if master else dtype, **hp)
    rtol, atol = TOLERANCES[dtype]
    elements_off = 0
    for i, p in enumerate(params):
        state = opt.state[p]
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
        assert_close(state["exp_avg"], ref_m[i], 1e-4, 1e-6, f"exp_avg {i}")
        assert_close(state["exp_avg_sq"], ref_v[i], 1e-4, 1e-9, f"exp_avg_sq {i}")
        if master:
            assert_close(state["master_param"], ref_p[i], 1e-5, 1e-6, f"master {i}")
            assert torch.equal(p.detach(), state["master_param"].to(dtype)), "param is the rounded master"
        else:
            assert_close(p, ref_p[i], rtol, atol, f"param {i}")  # within one ulp...
            elements_off += int((ulp_distance(p, ref_p[i], dtype) > 0).sum())
    # ...and equal except where fp32 rounding meets a tie (measured: none on this seed; see TOLERANCES)
    assert elements_off <= 2, f"{elements_off} of 1065 params differ from the same-rounding reference"


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_master_weights_keep_tiny_updates_that_bf16_rounding_loses(backend):
    results = {}
    for master in (False, True):
        p = torch.nn.Parameter(torch.full((16,), 1.0, dtype=torch.bfloat16))
        # Adam's update is about lr per step: 1e-4 is far below bf16's resolution at 1.0 (2**-7)
        opt = FusedAdamW([p], lr=1e-4, weight_decay=0.0, master_weights=master, backend=backend)
        for _ in range(100):
            p.grad = torch.ones(16, dtype=torch.bfloat16)
            opt.step()
        results[master] = p.detach().float()
    assert torch.all(results[False] == 1.0), "without master weights every update rounds away"
    assert torch.all(results[True] < 1.0), "with master weights 100 updates of 1e-4 add up"
    assert results[True][0].item() == pytest.approx(0.98828125, abs=2**-8)  # bf16 nearest to 1 - 100 * 1e-4
