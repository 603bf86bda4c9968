"""The cached step plan is keyed on what it encodes: every change a step could miss rebuilds it, on both backends.

A step only re-reads the grads (fused_stable/plan.py); these tests change, between steps, each other thing a
plan and its device tables encode (a param's size at the same address, its storage, a state tensor, the
params in a group, grad storage) and check that the step follows, against torch.optim.AdamW doing the same.
Also: CUDA-graph safety of uploads (simulated on CPU), torch's step hooks and profiler range, the device guard.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BACKEND_PARAMS, assert_close
from torch.optim.optimizer import register_optimizer_step_pre_hook

import fused_stable
from fused_stable import FusedAdamW
from fused_stable.kernels import tables


def pair(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes]
    return [torch.nn.Parameter(t.clone()) for t in init], [torch.nn.Parameter(t.clone()) for t in init]


def step_both(opt, ref, ours, theirs, grads):
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    ref.step()


def random_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) for p in params]


def assert_params_equal(ours, theirs, what):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a, b, 1e-5, 1e-6, f"{what}: param {i}")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_param_resized_at_the_same_address_rebuilds_the_plan(backend):
    """`p.data = p.data[:n]` keeps the address; its next grad sits where the old one did, with fewer elements."""
    ours, theirs = pair((100,), (7,))
    opt, ref = FusedAdamW(ours, lr=1e-2, max_grad_norm=1.0, backend=backend), torch.optim.AdamW(theirs, lr=1e-2)
    buffer = torch.randn(100)
    for a, b in zip(ours, theirs):
        a.grad, b.grad = (buffer if a.numel() == 100 else torch.ones(7)), torch.ones(b.shape)
    theirs[0].grad = buffer.clone()
    opt.step(), torch.nn.utils.clip_grad_norm_(theirs, 1.0), ref.step()
    address = ours[0].data_ptr()
    for p in (ours[0], theirs[0]):
        p.data = p.data[:60]
    assert ours[0].data_ptr() == address
    ours[0].grad = buffer[:60]  # the same grad address as last step, 60 elements instead of 100
    theirs[0].grad = buffer[:60].clone()
    # ours[1] keeps its grad tensor: every grad address is last step's, so only the size check can see the resize
    theirs[1].grad = ours[1].grad.clone()  # (both clips scaled the grads in place last step)
    # its moments still have 100 elements: the step must say so, not walk them with the old size
    with pytest.raises(ValueError, match="does not fit its parameter"):
        opt.step()
    opt.state[ours[0]].clear()  # start that param afresh, as torch does with an empty state
    ref.state[theirs[0]].clear()
    opt.step(), torch.nn.utils.clip_grad_norm_(theirs, 1.0), ref.step()
    assert_params_equal(ours, theirs, "after the resize")
    assert opt.state[ours[0]]["exp_avg"].numel() == 60


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_state_tensor_replaced_in_opt_state_is_the_one_updated(backend):
    ours, theirs = pair((33,), (5, 4))
    opt, ref = FusedAdamW(ours, lr=1e-2, max_grad_norm=1.0, backend=backend), torch.optim.AdamW(theirs, lr=1e-2)
    step_both(opt, ref, ours, theirs, random_grads(ours, 1))
    old = opt.state[ours[0]]["exp_avg"]
    kept = old.clone()
    opt.state[ours[0]]["exp_avg"] = torch.zeros_like(old)
    ref.state[theirs[0]]["exp_avg"] = torch.zeros_like(old)
    step_both(opt, ref, ours, theirs, random_grads(ours, 2))
    assert torch.equal(old, kept)  # the replaced tensor is no longer written
    assert_close(opt.state[ours[0]]["exp_avg"], ref.state[theirs[0]]["exp_avg"], 1e-5, 1e-7, "new exp_avg")
    assert_params_equal(ours, theirs, "after the replacement")
    opt.state[ours[1]] = {k: v.clone() for k, v in opt.state[ours[1]].items()}  # a whole state replaced
    ref.state[theirs[1]] = {k: v.clone() for k, v in ref.state[theirs[1]].items()}
    step_both(opt, ref, ours, theirs, random_grads(ours, 3))
    assert_params_equal(ours, theirs, "after replacing a whole state")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_param_replaced_in_a_group_list_is_the_one_updated(backend):
    ours, theirs = pair((9,), (12,), (12,))
    opt = FusedAdamW(ours[:2], lr=1e-2, max_grad_norm=1.0, backend=backend)
    ref = torch.optim.AdamW(theirs[:2], lr=1e-2)
    step_both(opt, ref, ours[:2], theirs[:2], random_grads(ours[:2], 1))
    opt.param_groups[0]["params"][1] = ours[2]  # edited in place, as torch's optimizers allow
    ref.param_groups[0]["params"][1] = theirs[2]
    before = ours[1].detach().clone()
    step_both(opt, ref, [ours[0], ours[2]], [theirs[0], theirs[2]], random_grads(ours[:2], 2))
    assert torch.equal(ours[1], before)
    assert_params_equal([ours[0], ours[2]], [theirs[0], theirs[2]], "after the swap")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("edit", ["append", "pop"])
def test_params_added_to_a_group_list_rebuild_the_plan(backend, edit):
    """A group's own list grown or shrunk in place (torch's optimizers allow it): the plan follows."""
    ours, theirs = pair((9,), (12,), (5, 3))
    n = 2 if edit == "append" else 3
    opt = FusedAdamW(ours[:n], lr=1e-2, max_grad_norm=1.0, backend=backend)
    ref = torch.optim.AdamW(theirs[:n], lr=1e-2)
    step_both(opt, ref, ours[:n], theirs[:n], random_grads(ours[:n], 1))
    plan = opt._plan
    if edit == "append":
        opt.param_groups[0]["params"].append(ours[2])
        ref.param_groups[0]["params"].append(theirs[2])
        n = 3
    else:
        opt.param_groups[0]["params"].pop()
        ref.param_groups[0]["params"].pop()
        n = 2
    before = ours[2].detach().clone()
    step_both(opt, ref, ours[:n], theirs[:n], random_grads(ours[:n], 2))
    assert opt._plan is not plan
    assert_params_equal(ours[:n], theirs[:n], f"after the {edit}")
    # the worst-step window has one slot per param (the kernels write it at the params' positions)
    assert opt.worst_step_grad_norms().numel() == n
    if edit == "pop":
        assert torch.equal(ours[2], before)  # no longer in the group: not updated


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_param_whose_storage_is_replaced_is_updated_in_its_new_storage(backend):
    """`p.data = t` with fresh grads (zero_grad(set_to_none=True)): the new grad storage makes the step look."""
    ours, theirs = pair((50,), (8,))
    opt, ref = FusedAdamW(ours, lr=1e-2, max_grad_norm=1.0, backend=backend), torch.optim.AdamW(theirs, lr=1e-2)
    step_both(opt, ref, ours, theirs, random_grads(ours, 1))
    fresh = torch.randn(50)
    ours[0].data, theirs[0].data = fresh.clone(), fresh.clone()
    step_both(opt, ref, ours, theirs, random_grads(ours, 2))
    assert_params_equal(ours, theirs, "after the storage swap")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_steady_steps_reuse_the_plan_and_new_grads_keep_it(backend):
    ours, theirs = pair((40,), (3, 3))
    opt, ref = FusedAdamW(ours, lr=1e-2, max_grad_norm=1.0, backend=backend), torch.optim.AdamW(theirs, lr=1e-2)
    step_both(opt, ref, ours, theirs, random_grads(ours, 1))
    plan, device_side = opt._plan, opt._plan.backend_cache
    for seed in (2, 3):  # new grad tensors each step (step_both clones): same plan, same device tables
        step_both(opt, ref, ours, theirs, random_grads(ours, seed))
    assert opt._plan is plan and plan.backend_cache is device_side and plan.grads_version >= 2
    assert_params_equal(ours, theirs, "steady steps")
    g = torch.randn(40)
    ours[0].grad, theirs[0].grad = g.clone(), g.clone()
    ours[1].grad = None  # another set of params with grads: another plan
    theirs[1].grad = None
    opt.step(), torch.nn.utils.clip_grad_norm_(theirs, 1.0), ref.step()
    assert opt._plan is not plan and opt._plan.members == [0]
    assert_params_equal(ours, theirs, "one grad missing")


def test_state_mappings_stay_plain_dicts_to_the_outside():
    p = torch.nn.Parameter(torch.randn(5))
    opt = FusedAdamW([p], lr=1e-2)
    p.grad = torch.ones(5)
    opt.step()
    saved = opt.state_dict()
    assert type(saved["state"][0]) is dict
    assert isinstance(opt.state, dict) and isinstance(opt.state[p], dict)
    assert opt.state[torch.nn.Parameter(torch.zeros(1))] == {}  # defaultdict(dict) behaviour
    import copy
    import pickle

    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert type(clone.state).__name__ == "ParamStates" and len(clone.state) == len(opt.state)


# ------------------------------------------------------------------------------------------------------------
# CUDA graphs: nothing is uploaded while a stream is capturing (simulated here; tests/core/test_cuda.py captures)


@pytest.fixture
def capturing(monkeypatch):
    """Pretends the current stream of every device is capturing a CUDA graph, when switched on."""
    state = {"on": False}
    monkeypatch.setattr(tables, "_capturing", lambda device: state["on"])
    return state


def test_capture_refuses_every_upload_with_one_clear_error(capturing, monkeypatch):
    from helpers import interpret_available

    if not interpret_available():
        pytest.skip("needs TRITON_INTERPRET=1")
    params = [torch.nn.Parameter(torch.randn(n)) for n in (30, 7)]
    lr = torch.tensor(1e-2)
    opt = FusedAdamW(params, lr=lr, max_grad_norm=1.0, backend="interpret", capturable=True)
    static = [torch.randn(p.shape) for p in params]
    for p, g in zip(params, static):
        p.grad = g
    capturing["on"] = True
    with pytest.raises(RuntimeError, match="one eager step"):
        opt.step()  # the first step builds the plan and its tables: not while capturing
    assert opt.applied_steps.item() == 0 and not opt.state  # refused before anything was allocated
    capturing["on"] = False
    opt.step()  # the eager warm-up step
    capturing["on"] = True
    opt.step()  # a step like the one a graph records: no upload
    lr.fill_(5e-3)  # a tensor lr changes on the device: fine
    opt.step()
    assert opt.applied_steps.item() == 3
    params[0].grad = static[0].clone()  # new grad storage
    with pytest.raises(RuntimeError, match="CUDA graph is being captured"):
        opt.step()
    params[0].grad = static[0]
    opt.param_groups[0]["weight_decay"] = 0.5  # a float hyper-parameter
    with pytest.raises(RuntimeError, match="changed hyper-parameters"):
        opt.step()
    opt.param_groups[0]["weight_decay"] = 1e-2
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret")  # clip_grad_norm_ on the kernels
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        fused_stable.clip_grad_norm_(params, 1.0)
    opt.step()
    assert opt.applied_steps.item() == 4


def test_the_capture_check_asks_the_tensors_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="one eager step"):
        tables.check_not_capturing(torch.device("cuda", 0), "a table")
    tables.check_not_capturing(torch.device("cpu"), "a table")  # CPU tensors are never captured


# ------------------------------------------------------------------------------------------------------------
# torch's step hooks and profiler range, taken only when used


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_step_hooks_run_and_the_profiler_sees_the_step(backend):
    p = torch.nn.Parameter(torch.randn(6))
    opt = FusedAdamW([p], lr=1e-2, backend=backend)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o is opt)))
    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global", o is opt)))
    p.grad = torch.ones(6)
    try:
        opt.step()
    finally:
        handle.remove()
    assert calls == [("global", True), ("pre", True), ("post", True)]
    opt._optimizer_step_pre_hooks.clear(), opt._optimizer_step_post_hooks.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert any(e.name == "Optimizer.step#FusedAdamW.step" for e in prof.events())
    assert opt.applied_steps.item() == 2


def test_the_device_guard_switches_only_to_another_cuda_device(monkeypatch):
    from fused_stable.backends import triton_backend

    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "device", lambda index: entered.append(index) or __import__("contextlib").nullcontext()
    )
    with triton_backend.device_guard(torch.device("cuda", 1)):
        pass
    with triton_backend.device_guard(torch.device("cuda", 0)):
        pass
    with triton_backend.device_guard(torch.device("cpu")):
        pass
    assert entered == [1]


# ------------------------------------------------------------------------------------------------------------
# the identity shortcut of the per-step check


def test_same_grads_are_recognised_only_while_every_one_is_alive():
    from fused_stable.plan import SameGrads

    grads = [torch.randn(10) for _ in range(3)]
    tracker = SameGrads()
    tracker.seen(grads)
    assert tracker.same(grads) and tracker.same(list(grads))
    other = list(grads)
    other[1] = grads[1].view(10)  # a new tensor over the same storage: not the same grads
    assert not tracker.same(other)
    old_address = grads[2].data_ptr()
    grads[2].set_(torch.randn(10))  # storage swapped in place (not looked for): the old storage stays alive
    assert any(s.data_ptr() == old_address for s in tracker.storages)
    del other
    grads[0] = torch.randn(10)  # an armed grad dies: the ids prove nothing any more, the storages are let go
    assert not tracker.alive and tracker.storages is None
    assert not tracker.same(grads)


def test_a_loop_with_new_grads_every_step_stops_arming():
    from fused_stable.plan import SameGrads

    tracker = SameGrads()
    armed = []
    for _ in range(SameGrads.RETRY + 3):
        grads = [torch.randn(4) for _ in range(5)]
        assert not tracker.same(grads)
        tracker.seen(grads)
        armed.append(tracker.alive)
    # armed once, replaced before any reuse: no arming for RETRY steps, then one more try
    assert armed[:2] == [True, False] and sum(armed) == 2 and armed[SameGrads.RETRY + 1]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_steady_grads_take_the_identity_shortcut_and_fresh_ones_the_address_check(backend):
    ours, theirs = pair((40,), (3, 3))
    opt, ref = FusedAdamW(ours, lr=1e-2, max_grad_norm=1.0, backend=backend), torch.optim.AdamW(theirs, lr=1e-2)
    grads = random_grads(ours, 1)
    for a, g in zip(ours, grads):
        a.grad = g
    for _ in range(3):
        for b, g in zip(theirs, grads):
            b.grad = g.clone()
        opt.step(), torch.nn.utils.clip_grad_norm_(theirs, 1.0), ref.step()
    assert opt._plan.same_grads.hits == 2  # steps 2 and 3 recognised the very same grad tensors
    assert_params_equal(ours, theirs, "static grads")
    step_both(opt, ref, ours, theirs, random_grads(ours, 2))  # new grad tensors: the address check again
    assert opt._plan.same_grads.hits == 0
    assert_params_equal(ours, theirs, "fresh grads")


def test_an_incomplete_state_is_a_clear_error():
    p = torch.nn.Parameter(torch.randn(5))
    opt = FusedAdamW([p], lr=1e-2)
    p.grad = torch.ones(5)
    opt.step()
    del opt.state[p]["exp_avg_sq"]
    with pytest.raises(ValueError, match=r"lacks \['exp_avg_sq'\]"):
        opt.step()
    opt.state[p].clear()
    opt.step()
    assert float(opt.state[p]["step"]) == 1.0
