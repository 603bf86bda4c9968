"""With lr_schedule=, param_groups[g]["lr"] shows the lr the next step uses (what framework monitors read), set on the
device by the step itself; the base lr lives in group["initial_lr"]; state dicts keep loading both ways."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from helpers import CPU_BACKENDS, HAS_CUDA, backend_param, no_host_reads
from torch.optim.lr_scheduler import LambdaLR

from fused_stable import FusedAdamW, schedules

SCHEDULE = schedules.warmup_cosine(12, 3, min_lr_ratio=0.1)
BASES = (0.1, 0.5)
INF_STEPS = {5}


def make(backend, tensor_lr=True, schedule=SCHEDULE, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)) for shape in [(4, 3), (7,), (2, 2)]]
    second_lr = torch.tensor(BASES[1], device=device) if tensor_lr else BASES[1]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": second_lr}]
    return params, FusedAdamW(groups, lr=BASES[0], weight_decay=0.1, lr_schedule=schedule, backend=backend)


def set_grads(params, step):
    gen = torch.Generator().manual_seed(10 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    if step in INF_STEPS:
        params[0].grad[0, 0] = float("inf")


def shown(opt):
    return [float(group["lr"]) for group in opt.param_groups]


@pytest.mark.parametrize(
    "backend, device",
    [
        *[pytest.param(backend_param(b).values[0], "cpu", id=b, marks=backend_param(b).marks) for b in CPU_BACKENDS],
        pytest.param(
            "triton",
            "cuda",
            id="triton-cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")],
        ),
    ],
)
def test_group_lr_before_each_step_is_the_lr_that_step_uses(backend, device):
    params, opt = make(backend, device=device)
    for step in range(10):
        applied = int(opt.applied_steps)
        before = shown(opt)
        assert before == pytest.approx([b * SCHEDULE.factor(applied) for b in BASES], rel=1e-6, abs=1e-9), step
        set_grads(params, step)
        with no_host_reads():
            opt.step()
        # exactly the lr the step computed with (group 0's is last_lr); a skipped step leaves it where it was
        assert before[0] == float(opt.last_lr)
        assert int(opt.applied_steps) == applied + (step not in INF_STEPS)
    assert all(type(g["lr"]) is torch.Tensor and g["lr"].dim() == 0 for g in opt.param_groups)
    assert [g["initial_lr"] for g in opt.param_groups][0] == BASES[0]


@pytest.mark.parametrize("backend", [backend_param(b) for b in CPU_BACKENDS])
def test_an_lr_assigned_to_the_group_becomes_its_base_lr(backend):
    params, opt = make(backend)
    for step in range(4):
        set_grads(params, step)
        opt.step()
    opt.param_groups[0]["lr"] = 0.2  # e.g. a guard's rollback that cuts the lr
    set_grads(params, 4)
    opt.step()
    assert float(opt.last_lr) == pytest.approx(0.2 * SCHEDULE.factor(4), rel=1e-6)
    assert opt.param_groups[0]["initial_lr"] == 0.2
    assert shown(opt) == pytest.approx([0.2 * SCHEDULE.factor(5), BASES[1] * SCHEDULE.factor(5)], rel=1e-6)


@pytest.mark.parametrize("backend", [backend_param(b) for b in CPU_BACKENDS])
def test_base_lrs_reads_and_set_base_lrs_sets_the_configured_lr(backend):
    """What a caller that rescales the lr uses (the guard's rollback): the base lr under a schedule, with the shown
    lr following a new base at once, and an lr assigned to a group since the last step counted."""
    params, opt = make(backend, tensor_lr=False)
    for step in range(4):
        set_grads(params, step)
        opt.step()
    factor = SCHEDULE.factor(int(opt.applied_steps))
    assert opt.base_lrs() == list(BASES) and shown(opt) == pytest.approx([b * factor for b in BASES], rel=1e-6)
    opt.set_base_lrs([0.2, 0.4])
    assert opt.base_lrs() == [0.2, 0.4]
    assert shown(opt) == pytest.approx([0.2 * factor, 0.4 * factor], rel=1e-6)  # before any step
    set_grads(params, 4)
    opt.step()
    assert float(opt.last_lr) == pytest.approx(0.2 * factor, rel=1e-6)
    opt.param_groups[1]["lr"] = 0.3  # assigned: the group's base from now on, before the next step too
    assert opt.base_lrs() == [0.2, 0.3]
    with pytest.raises(ValueError, match="2 param groups: give one lr per group"):
        opt.set_base_lrs([0.1])
    _, plain = make(backend, schedule=None)
    assert plain.base_lrs()[0] == BASES[0] and float(plain.base_lrs()[1]) == BASES[1]
    plain.set_base_lrs([0.05, 0.06])
    assert [g["lr"] for g in plain.param_groups] == [0.05, 0.06]


def test_without_a_schedule_the_groups_are_untouched():
    params, opt = make("torch", schedule=None)
    set_grads(params, 0)
    opt.step()
    assert opt.param_groups[0]["lr"] == BASES[0] and "initial_lr" not in opt.param_groups[0]


def _round_trip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_saves_base_lrs_and_loads_both_ways():
    params, opt = make("torch", tensor_lr=False)
    for step in range(7):
        set_grads(params, step)
        opt.step()
    state = _round_trip(opt.state_dict())
    assert [g["lr"] for g in state["param_groups"]] == list(BASES)  # plain floats, as before schedules were shown
    assert [g["initial_lr"] for g in state["param_groups"]] == list(BASES)

    params2, opt2 = make("torch", tensor_lr=False)
    with torch.no_grad():
        for p, q in zip(params, params2):
            q.copy_(p)
    opt2.load_state_dict(state)
    assert shown(opt2) == shown(opt)
    set_grads(params, 7), set_grads(params2, 7)
    opt.step(), opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(params, params2))

    # torch's AdamW takes it (a float lr, which its default foreach path needs) and steps
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW([{"params": torch_params[:2]}, {"params": torch_params[2:]}])
    torch_opt.load_state_dict(_round_trip(opt.state_dict()))
    set_grads(torch_params, 8)
    torch_opt.step()


def test_a_torch_adamw_with_lambdalr_state_resumes_at_its_base_lr():
    """torch's LR schedulers keep the base lr in initial_lr and the scheduled one in lr: the base is taken."""
    params, _ = make("torch", schedule=None)
    torch_opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": BASES[1]}], lr=BASES[0])
    scheduler = LambdaLR(torch_opt, SCHEDULE.factor)
    for _ in range(5):
        set_grads(params, 0)  # finite
        torch_opt.step()
        scheduler.step()
    state = _round_trip(torch_opt.state_dict())
    assert state["param_groups"][0]["lr"] != BASES[0]
    _, opt = make("torch", tensor_lr=False)
    opt.load_state_dict(state)
    assert [g["initial_lr"] for g in opt.param_groups] == list(BASES)
    assert int(opt.applied_steps) == 5
    assert shown(opt) == pytest.approx([g["lr"] for g in state["param_groups"]], rel=1e-6)


def test_pickle_deepcopy_and_a_later_param_group_keep_the_shown_lrs():
    params, opt = make("torch")
    for step in range(4):
        set_grads(params, step)
        opt.step()
    expected = shown(opt)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert shown(clone) == expected
        assert clone.param_groups[0]["initial_lr"] == BASES[0]
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(5))], "lr": 0.3})
    assert shown(opt) == pytest.approx(expected + [0.3 * SCHEDULE.factor(4)], rel=1e-6)
    assert [g["initial_lr"] for g in opt.param_groups][::2] == [BASES[0], 0.3]


def test_a_torch_scheduler_on_top_of_lr_schedule_is_refused_and_changes_nothing():
    """docs/optimizer.md: a torch LR scheduler on a FusedAdamW with lr_schedule= would compound the two schedules;
    the next step refuses it with one line, before anything moves."""
    params, opt = make("torch")
    set_grads(params, 0)
    opt.step()
    LambdaLR(opt, lambda step: 0.5)  # writes 0.5 x the base lr into group["lr"]
    before = [p.detach().clone() for p in params]
    applied = int(opt.applied_steps)
    set_grads(params, 1)
    with pytest.raises(ValueError, match="a torch LR scheduler drives this FusedAdamW, which already has lr_schedule"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before)) and int(opt.applied_steps) == applied


def test_an_assigned_lr_beside_the_hf_device_schedule_is_a_new_base_lr():
    """The HF integration's DeviceScheduleLR writes no lr: accepted, and an lr assigned beside it is a base lr."""
    from fused_stable.integrations.hf import DeviceScheduleLR

    params, opt = make("torch")
    DeviceScheduleLR(opt)
    opt.param_groups[0]["lr"] = 0.05  # a new base lr (the guard's rollback lowers it so)
    set_grads(params, 0)
    opt.step()
    assert opt.param_groups[0]["initial_lr"] == 0.05
    assert shown(opt)[0] == pytest.approx(0.05 * SCHEDULE.factor(1), rel=1e-6)
