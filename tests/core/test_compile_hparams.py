"""A compiled step sees every value written into param_groups between steps, as an eager step does.

torch's LR schedulers, OneCycleLR's momentum cycling, ReduceLROnPlateau and a nanoGPT-style loop write new
floats into `param_groups` between steps; a tensor lr is written in place; amsgrad and state_precision may be
flipped. Each test runs an eager FusedAdamW and a compiled one (`torch.compile(opt.step)`, dynamo's eager and
inductor backends) on the same grads with the same edits and compares params, every state tensor and the device
counters bit for bit (the op runs the eager step's backend: there is no floor to allow for). It also counts the
traces (`compiled.prepare` runs once per trace) and the op's calls: a silent fall-back to eager steps, or a
retrace per step, would be caught there. Until issue 38 a compiled step froze the hyper-parameters of its trace.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from helpers import backend_param
from torch._dynamo.utils import counters

from fused_stable import FusedAdamW, GradScaler, compiled, schedules

STEPS = 8
BACKENDS = ["eager", "inductor"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Counts(dict):
    """op calls (_plan_for runs on every call of the op) and the graphs dynamo compiled (`traces`; a trace may
    run `_init_group` more than once when dynamo restarts its analysis, so compiled.prepare is not counted)."""

    def __getitem__(self, key):
        return counters["stats"]["unique_graphs"] if key == "traces" else super().__getitem__(key)

    def __repr__(self):
        return f"calls={self['calls']}, traces={self['traces']}"


@pytest.fixture
def counts(monkeypatch):
    counters.clear()
    seen = Counts(calls=0)
    plan_for = compiled._plan_for

    def counted_plan_for(*args):
        seen["calls"] += 1
        return plan_for(*args)

    monkeypatch.setattr(compiled, "_plan_for", counted_plan_for)
    return seen


def make_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(7, 5), (5,), (33, 3), (130,)]]


def set_grads(step, params):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).mul_(3.0)


def assert_same(opt_a, opt_b, params_a, params_b):
    for index, (p, q) in enumerate(zip(params_a, params_b)):
        assert torch.equal(p, q), f"param {index}: {(p - q).abs().max():.3g} off"
        assert opt_a.state[p].keys() == opt_b.state[q].keys(), f"param {index}: state keys"
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), f"param {index}: state {key!r}"
    assert torch.equal(opt_a._fstate, opt_b._fstate) and torch.equal(opt_a._istate, opt_b._istate)


def side_by_side(make_opt, edit, dynamo_backend, steps=STEPS, param_maker=None):
    """Eager and compiled steps on the same grads; `edit(opt, driver, step)` runs after every step on each side
    (`driver` is what make_opt returned beside the optimizer: a scheduler, or None). Returns the lrs the steps
    used, for a check that the edits did something. A torch LR scheduler wraps opt.step in a function of
    torch's lr_scheduler.py, which dynamo skips: as in the issue's repro, that wrapper breaks the graph and
    FusedAdamW.step compiles as a frame of its own (fullgraph=True only without a scheduler)."""
    sides = []
    for compile_it in (False, True):
        params = (param_maker or make_params)()
        opt, driver = make_opt(params)
        fullgraph = not isinstance(driver, torch.optim.lr_scheduler.LRScheduler)
        run = torch.compile(opt.step, backend=dynamo_backend, fullgraph=fullgraph) if compile_it else opt.step
        lrs = []
        for step in range(steps):
            set_grads(step, params)
            run()
            lrs.append(float(opt.last_lr))
            edit(opt, driver, step)
        sides.append((opt, params, lrs))
    (opt_a, params_a, lrs_a), (opt_b, params_b, lrs_b) = sides
    assert lrs_b == lrs_a
    assert_same(opt_a, opt_b, params_a, params_b)
    return lrs_a


def fused(params, **kwargs):
    return FusedAdamW(params, lr=kwargs.pop("lr", 1e-2), max_grad_norm=0.5, backend="torch", **kwargs)


def lambda_lr(params):
    opt = fused(params)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 + s)


def one_cycle(params):
    opt = fused(params)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1, cycle_momentum=True)


def plateau(params):
    opt = fused(params)
    return opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)


def scheduler_step(opt, scheduler, step):
    scheduler.step()


def plateau_step(opt, scheduler, step):
    scheduler.step(1.0)  # a flat metric: the lr halves after every step


def nanogpt_step(opt, driver, step):
    """nanoGPT's loop: the lr (and here the weight decay) written by hand into every group each iteration."""
    for group in opt.param_groups:
        group["lr"] = 1e-2 * math.cos(step / STEPS)
        group["weight_decay"] = 0.1 * (step + 1)


def tensor_lr(params):
    return FusedAdamW(params, lr=torch.tensor(1e-2), max_grad_norm=0.5, backend="torch"), None


def tensor_lr_step(opt, driver, step):
    opt.param_groups[0]["lr"].fill_(1e-2 * (step + 2))


def plain(params):
    return fused(params), None


def eps_and_betas_step(opt, driver, step):
    for group in opt.param_groups:
        group["eps"] = 10.0 ** -(step % 4 + 3)
        group["betas"] = (0.9 - 0.05 * step, 0.999 - 0.01 * step)


def maximize_step(opt, driver, step):
    opt.param_groups[0]["maximize"] = step % 2 == 0


SCHEDULED = [
    pytest.param(lambda_lr, scheduler_step, id="LambdaLR"),
    pytest.param(one_cycle, scheduler_step, id="OneCycleLR-cycle_momentum"),
    pytest.param(plateau, plateau_step, id="ReduceLROnPlateau"),
    pytest.param(plain, nanogpt_step, id="hand-written-lr-and-weight_decay"),
    pytest.param(tensor_lr, tensor_lr_step, id="tensor-lr-fill_"),
]


@pytest.mark.parametrize("dynamo_backend", BACKENDS)
@pytest.mark.parametrize("make_opt, edit", SCHEDULED)
def test_hyperparameters_written_between_compiled_steps_are_used(make_opt, edit, dynamo_backend, counts):
    lrs = side_by_side(make_opt, edit, dynamo_backend)
    assert len(set(lrs)) > 2  # the edits changed the lr: a stale step would differ
    assert counts["calls"] == STEPS  # every compiled step ran the op
    # dynamo specialises on a float the first time, then makes a changed one an input (automatic dynamic): one
    # retrace per key that changes, never one per step (measured: 1 graph for a tensor lr, 2 for a scheduler's lr,
    # 3 for the hand-written lr and weight_decay)
    assert counts["traces"] <= 3, counts


@pytest.mark.parametrize("dynamo_backend", BACKENDS)
@pytest.mark.parametrize("edit", [eps_and_betas_step, maximize_step], ids=["eps-and-betas", "maximize-flipped"])
def test_other_float_and_flag_edits_are_used(edit, dynamo_backend, counts):
    side_by_side(plain, edit, dynamo_backend)
    assert counts["calls"] == STEPS


def amsgrad_and_precision_step(opt, driver, step):
    """Flips that change which state tensors a step uses: dynamo guards them, so the step is retraced. amsgrad
    turned on mid-run needs fresh state (an eager step refuses a state without max_exp_avg_sq); a new
    state_precision converts the stored moments at the next step, eager or compiled."""
    if step == 2:
        opt.param_groups[0]["amsgrad"] = True
        for p in opt.param_groups[0]["params"]:
            opt.state[p].clear()
    if step == 4:
        opt.param_groups[0]["state_precision"] = "bf16"


@pytest.mark.parametrize("dynamo_backend", BACKENDS)
def test_amsgrad_and_state_precision_changes_retrace(dynamo_backend, counts):
    side_by_side(plain, amsgrad_and_precision_step, dynamo_backend)
    assert counts["calls"] == STEPS
    assert counts["traces"] == 3, counts  # the first, then one per flip


def test_a_long_scheduled_run_stays_compiled(counts):
    """100 steps of a cosine LambdaLR: a bounded number of traces, far under dynamo's cache_size_limit (8), and
    every step through the op (past the limit dynamo would fall back to eager steps without a word)."""
    steps = 100

    def cosine(params):
        opt = fused(params)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))

    with torch._dynamo.config.patch(cache_size_limit=4):
        side_by_side(cosine, scheduler_step, "eager", steps=steps)
    assert counts["calls"] == steps and counts["traces"] <= 2, counts


def test_grad_scaler_step_sees_scheduled_lrs(counts):
    """fused_stable.GradScaler's step compiled whole, a LambdaLR driving the lr."""
    sides = []
    for compile_it in (False, True):
        params = make_params()
        opt, scheduler = lambda_lr(params)
        scaler = GradScaler("cpu", init_scale=2.0**8)

        def scaler_step(scaler=scaler, opt=opt):
            scaler.step(opt)

        run = torch.compile(scaler_step, backend="eager") if compile_it else scaler_step
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 + step)
            loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
            scaler.scale(loss).backward()
            run()
            scaler.update()
            scheduler.step()
            opt.zero_grad()
        sides.append((opt, params, float(opt.last_lr)))
    assert_same(sides[0][0], sides[1][0], sides[0][1], sides[1][1])
    assert sides[1][2] == sides[0][2] == pytest.approx(1e-2 * STEPS)
    assert counts["calls"] == STEPS


def test_device_schedule_sees_an_assigned_base_lr(counts):
    """With lr_schedule, group['lr'] = value between compiled steps is the group's new base lr, as in eager."""

    def scheduled(params):
        return fused(params, lr_schedule=schedules.warmup_cosine(STEPS, 2)), None

    def assign(opt, driver, step):
        opt.param_groups[0]["lr"] = 1e-2 * (step + 2)

    side_by_side(scheduled, assign, "eager")
    assert counts["calls"] == STEPS
    # the cost docs/optimizer.md states: the assignment replaces the shown-lr view by a float, which fails a
    # guard, so every such step retraces (a tensor base lr filled in place costs none: the test above)
    assert counts["traces"] == STEPS, counts


@pytest.mark.parametrize("dynamo_backend", BACKENDS)
def test_whole_training_step_with_the_optimizer_inside_follows_a_scheduler(dynamo_backend, counts):
    """forward, backward and step in one compiled function, LambdaLR between calls. The compiled forward and
    backward round otherwise than eager ones (inductor fuses them), so params are compared within
    test_compile.py's eager-vs-compiled floor (1e-5); the lr the last step used is compared exactly."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [FusedAdamW(m.parameters(), lr=1e-2, max_grad_norm=0.5, backend="torch") for m in models]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 + s) for opt in opts]
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def train_step(model, opt):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled_train_step = torch.compile(train_step, backend=dynamo_backend)
    for _ in range(STEPS):
        for model, opt, scheduler, run in zip(models, opts, schedulers, (train_step, compiled_train_step)):
            run(model, opt)
            scheduler.step()
    assert counts["calls"] == STEPS
    assert float(opts[1].last_lr) == float(opts[0].last_lr) == pytest.approx(1e-2 * STEPS)
    for p, q in zip(models[1].parameters(), models[0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", [backend_param("interpret")])
def test_triton_kernels_under_a_compiled_step_follow_a_scheduler(backend, counts):
    """The Triton path (through the interpreter: few steps) reads the new rows too."""

    def make(params):
        opt = FusedAdamW(params, lr=1e-2, max_grad_norm=0.5, backend=backend)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 + s)

    side_by_side(make, scheduler_step, "eager", steps=3)
    assert counts["calls"] == 3


@pytest.fixture
def traced(monkeypatch):
    """Each trace's op arguments (key, tensors, grads, lrs), to call the op as a graph run without a retrace would."""
    seen = []
    prepare = compiled.prepare

    def recording_prepare(opt, tensors, grads, lrs):
        key = prepare(opt, tensors, grads, lrs)
        seen.append((key, tensors, grads, lrs))
        return key

    monkeypatch.setattr(compiled, "prepare", recording_prepare)
    return seen


def test_an_lr_turned_from_a_float_into_a_tensor_without_a_retrace_is_refused(traced):
    """The op's other net: a trace passed no tensor lr, and the group's lr is now a tensor (dynamo retraces on
    that; a graph run without a retrace would step the old float): refused, nothing changed."""
    params = make_params()
    opt = fused(params)
    set_grads(0, params)
    torch.compile(opt.step, backend="eager", fullgraph=True)()
    key, tensors, grads, lrs = traced[-1]
    opt.param_groups[0]["lr"] = torch.tensor(1e-2)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="a group's lr changed between a float and a tensor"):
        torch.ops.fused_stable.fused_step(key, list(tensors), list(grads), list(lrs), None, None)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_stale_plan_is_refused_loudly(traced, counts):
    """The op's net under dynamo's guards: called with a trace's arguments after a param group was added (what
    a graph run without a retrace would do; dynamo's guards retrace instead, even under the
    skip_guard_eval_unsafe stance, which raises), it refuses, naming what changed, and changes nothing."""
    params = make_params()
    opt = fused(params[:2])
    run = torch.compile(opt.step, backend="eager", fullgraph=True)
    set_grads(0, params)
    run()
    key, tensors, grads, lrs = traced[-1]
    opt.add_param_group({"params": params[2:]})
    set_grads(1, params)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=r"param groups changed since this compiled step was traced \(1 param"):
        torch.ops.fused_stable.fused_step(key, list(tensors), list(grads), list(lrs), None, None)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    run()  # through dynamo: a retrace, and the step runs over both groups
    assert counts["traces"] == 2 and all(not torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("dynamo_backend", BACKENDS)
def test_a_tensor_lr_written_inside_the_compiled_function_is_used(dynamo_backend, counts):
    """lr.fill_() inside the compiled function, before the step: under inductor the op gets the written value as
    a graph value (AOTAutograd applies the write to the group's tensor only after the graph), so for the traced
    tensor the op takes its input, not the group's tensor."""
    sides = []
    for compile_it in (False, True):
        params = make_params()
        lr = torch.tensor(1e-2)
        opt = FusedAdamW(params, lr=lr, max_grad_norm=0.5, backend="torch")

        def step_at(value, lr=lr, opt=opt):
            lr.fill_(value)
            opt.step()

        run = torch.compile(step_at, backend=dynamo_backend, fullgraph=True) if compile_it else step_at
        for step in range(STEPS):
            set_grads(step, params)
            run(1e-2 * (step + 2))
        sides.append((opt, params, float(opt.last_lr)))
    assert_same(sides[0][0], sides[1][0], sides[0][1], sides[1][1])
    assert sides[1][2] == sides[0][2] == pytest.approx(1e-2 * (STEPS + 1))
    assert counts["calls"] == STEPS


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_low_precision_state_under_a_compiled_step_follows_a_scheduler(precision, counts):
    """bf16 and 8-bit moments (a 4900-element tensor, so 8-bit applies) with a LambdaLR, eager vs compiled."""
    shapes = [(70, 70), (33,)]

    made = []

    def make(params):
        made.append(fused(params, state_precision=precision))
        return made[-1], torch.optim.lr_scheduler.LambdaLR(made[-1], lambda s: 1.0 + s)

    side_by_side(
        make, scheduler_step, "eager", steps=4, param_maker=lambda: [torch.nn.Parameter(t) for t in seeded(shapes)]
    )
    assert counts["calls"] == 4
    big = made[1].param_groups[0]["params"][0]
    assert made[1].state[big]["exp_avg"].dtype == (torch.bfloat16 if precision == "bf16" else torch.int8)


def seeded(shapes):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=gen) for shape in shapes]
