"""state_dict round trips: FusedAdamW <-> torch.optim.AdamW through torch.save / torch.load(weights_only=True)."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import BACKEND_PARAMS, assert_close

from fused_stable import FusedAdamW

SHAPES = [(17,), (4, 9), (1025,)]


def through_disk(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def grads_for(step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def train(opt, params, steps, clip):
    for s in steps:
        for p, g in zip(params, grads_for(s)):
            p.grad = g.clone().to(p.dtype)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()


def fresh_params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("direction", ["fused-to-torch", "torch-to-fused"])
def test_round_trip_with_torch_continues_identically(backend, direction):
    make_fused = lambda ps: FusedAdamW(ps, lr=1e-2, weight_decay=0.05, max_grad_norm=None, backend=backend)  # noqa: E731
    make_torch = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05)  # noqa: E731
    first, second = (make_fused, make_torch) if direction == "fused-to-torch" else (make_torch, make_fused)
    # reference: one optimizer of the second kind for all 6 steps, started from the first's state after 3
    params_a = fresh_params()
    opt_a = first(params_a)
    train(opt_a, params_a, range(3), None)
    saved = through_disk(opt_a.state_dict())

    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    opt_b = second(params_b)
    opt_b.load_state_dict(saved)
    train(opt_b, params_b, range(3, 6), None)

    params_c = fresh_params()
    opt_c = torch.optim.AdamW(params_c, lr=1e-2, weight_decay=0.05)
    train(opt_c, params_c, range(6), None)
    for b, c in zip(params_b, params_c):
        assert_close(b, c, 1e-5, 1e-6, "params after resuming")
    for b, c in zip(params_b, params_c):
        assert_close(opt_b.state[b]["exp_avg"], opt_c.state[c]["exp_avg"], 1e-5, 1e-6, "exp_avg")
        assert float(opt_b.state[b]["step"]) == 6.0


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fused_round_trip_is_exact_and_keeps_counters(backend):
    params = fresh_params()
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, backend=backend)
    train(opt, params, range(2), None)
    params[0].grad = torch.full(SHAPES[0], float("nan"))
    for p in params[1:]:
        p.grad = torch.ones(p.shape)
    opt.step()
    assert opt.skipped_steps.item() == 1
    saved = through_disk(opt.state_dict())
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(saved["param_groups"][0]) >= {"lr", "betas", "eps", "weight_decay", "amsgrad", "params"}

    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = FusedAdamW(clone, lr=1e-2, max_grad_norm=1.0, backend=backend)
    opt2.load_state_dict(saved)
    assert opt2.skipped_steps.item() == 1 and opt2.applied_steps.item() == 2
    train(opt, params, range(2, 5), None)
    train(opt2, clone, range(2, 5), None)
    for a, b in zip(params, clone):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], opt2.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_loaded_state_is_not_shared_with_the_source(backend):
    params = fresh_params()
    opt = FusedAdamW(params, lr=1e-2, backend=backend)
    train(opt, params, range(1), None)
    state = opt.state_dict()  # live tensors, not saved to disk
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = FusedAdamW(clone, lr=1e-2, backend=backend)
    opt2.load_state_dict(state)
    train(opt2, clone, range(1, 2), None)
    assert not torch.equal(opt.state[params[0]]["exp_avg"], opt2.state[clone[0]]["exp_avg"])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_bf16_params_keep_fp32_moments_through_save_and_load(backend):
    params = fresh_params(torch.bfloat16)
    opt = FusedAdamW(params, lr=1e-2, backend=backend, master_weights=True)
    train(opt, params, range(2), None)
    saved = through_disk(opt.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == torch.float32
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = FusedAdamW(clone, lr=1e-2, backend=backend, master_weights=True)
    opt2.load_state_dict(saved)
    for p, q in zip(params, clone):
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert opt2.state[q][key].dtype == torch.float32, key
            assert torch.equal(opt2.state[q][key], opt.state[p][key]), key
    # and the base class's cast would have lost bits: prove the test can tell
    lossy = opt.state[params[0]]["exp_avg"].to(torch.bfloat16).float()
    assert not torch.equal(lossy, opt.state[params[0]]["exp_avg"])


def test_mismatched_state_dict_is_refused_and_changes_nothing():
    params = fresh_params()
    opt = FusedAdamW(params, lr=1e-2, backend="torch")
    train(opt, params, range(1), None)
    other = [
        torch.nn.Parameter(torch.zeros(5)),
        torch.nn.Parameter(torch.zeros(2, 2)),
        torch.nn.Parameter(torch.zeros(3)),
    ]
    other_opt = FusedAdamW(other, lr=1e-2, backend="torch")
    train_other = [torch.ones(5), torch.ones(2, 2), torch.ones(3)]
    for p, g in zip(other, train_other):
        p.grad = g
    other_opt.step()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(through_disk(other_opt.state_dict()))
    for key, value in before.items():
        assert torch.equal(opt.state[params[0]][key], value)
    differentiable = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], differentiable=True)
    with pytest.raises(ValueError, match="differentiable=True"):
        opt.load_state_dict(differentiable.state_dict())
    assert opt.param_groups[0]["differentiable"] is False


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_deepcopy_of_the_optimizer_keeps_settings_and_counters(backend):
    import copy

    params = fresh_params()
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, clip="zscore", backend=backend)
    train(opt, params, range(2), None)
    params[0].grad = torch.full(SHAPES[0], float("inf"))
    opt.step()
    twin_params, twin = copy.deepcopy((params, opt))  # together, so the twin's state keys are its own params
    assert twin.policy == opt.policy and twin.backend == opt.backend
    assert torch.equal(twin._istate, opt._istate) and twin.skipped_steps.item() == 1
    train(opt, params, range(2, 4), None)
    train(twin, twin_params, range(2, 4), None)
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)


def test_a_state_saved_before_the_worst_step_window_loads_and_continues():
    """Counter layout 1 (no worst-step window: 14 fp32 and 8 int64 slots) loads into the leading slots; the
    window starts empty; a state from a newer layout with more slots is refused in one line."""
    from fused_stable import layout

    params = fresh_params()
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, clip="zscore", zscore_warmup=2, backend="torch")
    train(opt, params, range(4), None)
    saved = through_disk(opt.state_dict())
    old = {
        **saved,
        "fused_stable": {
            "fstate": saved["fused_stable"]["fstate"][:14],
            "istate": saved["fused_stable"]["istate"][:8],
            "layout": 1,
        },
    }
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = FusedAdamW(clone, lr=1e-2, max_grad_norm=1.0, clip="zscore", zscore_warmup=2, backend="torch")
    opt2.load_state_dict(old)
    assert torch.equal(opt2._fstate[:14], opt._fstate[:14]) and torch.equal(opt2._istate[:8], opt._istate[:8])
    assert opt2.worst_step.item() == -1 and opt2.worst_step_zscore.item() == float("-inf")
    train(opt, params, range(4, 6), None)
    train(opt2, clone, range(4, 6), None)
    assert all(torch.equal(a, b) for a, b in zip(params, clone))
    assert opt2.worst_step.item() in (4, 5)  # the window filled again from the steps after the load
    newer = {**saved, "fused_stable": {**saved["fused_stable"], "fstate": torch.zeros(layout.F_SIZE + 1)}}
    before = {name: t.clone() for name, t in (("fstate", opt2._fstate), ("exp_avg", opt2.state[clone[0]]["exp_avg"]))}
    with pytest.raises(ValueError, match="newer fused_stable"):
        opt2.load_state_dict(newer)
    assert torch.equal(before["fstate"], opt2._fstate) and torch.equal(
        before["exp_avg"], opt2.state[clone[0]]["exp_avg"]
    )
