"""A compiled step: torch.compile of a function that calls opt.step() (or scaler.step(opt)) traces FusedAdamW's
step as one custom op (fused_stable/compiled.py), without graph breaks, and computes exactly what eager steps do.

Every test runs 20 steps with an eager optimizer and a compiled one side by side, on the same grads, and compares
params, every state tensor and the device counters bit for bit: the op runs the same backend as an eager step.
Each test also checks that the compiled function really ran the op (a silent fallback to eager, e.g. after too
many recompilations, would otherwise pass) and never recompiled.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from helpers import HAS_CUDA, backend_param

import fused_stable
from fused_stable import FusedAdamW, FusedLion, FusedSGD, compiled, schedules

STEPS = 20
# dynamo before torch 2.13 cannot trace an attribute write on an optimizer (GradScaler's protocol sets
# opt.grad_scale): there scaler.step(opt) breaks the graph and opt.step() compiles as a graph of its own
SCALER_FULLGRAPH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
INF_STEPS = {6, 13}  # steps whose grads carry an inf: skipped (and, with a scaler, the scale backs off)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def op_calls(monkeypatch):
    """How often the custom op's implementation ran (it looks its plan up through _plan_for on every call)."""
    calls = []
    plan_for = compiled._plan_for
    monkeypatch.setattr(compiled, "_plan_for", lambda *args: calls.append(1) or plan_for(*args))
    return calls


def make_params(device, dtypes=(torch.float32,)):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (33, 3), (1,), (130,)]
    return [
        torch.nn.Parameter(torch.randn(shape, generator=gen).to(device=device, dtype=dtypes[i % len(dtypes)]))
        for i, shape in enumerate(shapes)
    ]


def grads_for(step, params, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=gen).mul_(3.0 * scale).to(device=p.device, dtype=p.dtype) for p in params]
    if step in INF_STEPS:
        grads[2][1, 1] = float("inf")
    return grads


def make_optimizer(params, backend, optimizer=FusedAdamW, **overrides):
    half = len(params) // 2
    kwargs = dict(
        lr=2e-2, weight_decay=0.1, max_grad_norm=1.0, lr_schedule=schedules.warmup_cosine(STEPS, 4), backend=backend
    )
    kwargs.update(overrides)
    device = params[0].device
    groups = [{"params": params[:half]}, {"params": params[half:], "lr": torch.tensor(1e-2, device=device)}]
    return optimizer(groups, **kwargs)


def assert_same_state(opt_a, opt_b, params_a, params_b):
    for index, (p, q) in enumerate(zip(params_a, params_b)):
        assert torch.equal(p, q), f"param {index}"
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), f"param {index}: state {key!r}"
    assert torch.equal(opt_a._fstate, opt_b._fstate) and torch.equal(opt_a._istate, opt_b._istate)
    assert torch.equal(opt_a.step_buffers.hparams, opt_b.step_buffers.hparams)  # with the lrs param_groups show
    assert all(g["lr"].data_ptr() == view.data_ptr() for g, view in zip(opt_b.param_groups, opt_b._shown_lrs))


def run_side_by_side(backend, device="cpu", dtypes=(torch.float32,), set_to_none=True, steps=STEPS, **overrides):
    """Eager and compiled (inductor, fullgraph=True) steps on the same grads; a tensor lr that changes."""
    params_a, params_b = make_params(device, dtypes), make_params(device, dtypes)
    opt_a = make_optimizer(params_a, backend, **overrides)
    opt_b = make_optimizer(params_b, backend, **overrides)

    @torch.compile(fullgraph=True)
    def compiled_step():
        opt_b.step()

    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(steps):
            for params, opt, run in ((params_a, opt_a, opt_a.step), (params_b, opt_b, compiled_step)):
                for p, g in zip(params, grads_for(step, params)):
                    if set_to_none or p.grad is None:
                        p.grad = g
                    else:
                        p.grad.copy_(g)
                run()
                opt.param_groups[1]["initial_lr"].fill_(1e-2 * (1 + step % 3))  # the base lr (a schedule runs)
                opt.zero_grad(set_to_none=set_to_none)
    return opt_a, opt_b, params_a, params_b


@pytest.mark.parametrize(
    "backend, steps",
    [
        pytest.param("torch", STEPS, id="torch"),
        pytest.param("interpret", 8, id="interpret", marks=backend_param("interpret").marks),
    ],
)
def test_compiled_fullgraph_step_equals_eager(backend, steps, op_calls):
    """The torch backend (CPU) and the Triton kernels (through Triton's interpreter: slow, so fewer steps)."""
    opt_a, opt_b, params_a, params_b = run_side_by_side(backend, steps=steps)
    assert len(op_calls) == steps
    assert_same_state(opt_a, opt_b, params_a, params_b)
    skipped = len([s for s in INF_STEPS if s < steps])
    assert int(opt_b.skipped_steps) == skipped == 1 + (steps > 13)
    assert int(opt_b.applied_steps) == steps - skipped
    torch.testing.assert_close(opt_b.per_tensor_grad_norms(), opt_a.per_tensor_grad_norms(), rtol=0, atol=0)


RULES_AFTER_ADAMW = {
    "lion": (FusedLion, dict(lr=2e-3, weight_decay=0.5), {"step", "exp_avg"}),
    "sgd": (FusedSGD, dict(lr=2e-2, momentum=0.9, nesterov=True, weight_decay=0.5), {"step", "momentum_buffer"}),
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("rule", list(RULES_AFTER_ADAMW))
def test_compiled_step_of_every_rule_equals_eager(rule, precision, op_calls):
    """Every rule takes the same route: its step compiles to the one op and computes what eager does."""
    optimizer, hparams, state_keys = RULES_AFTER_ADAMW[rule]
    opt_a, opt_b, params_a, params_b = run_side_by_side(
        "torch", optimizer=optimizer, state_precision=precision, **hparams
    )
    assert len(op_calls) == STEPS
    assert_same_state(opt_a, opt_b, params_a, params_b)
    assert set(opt_b.state[params_b[0]]) == state_keys
    assert int(opt_b.skipped_steps) == len(INF_STEPS)


def test_compiled_step_with_persistent_grads_and_low_precision_params(op_calls):
    """Grads kept between steps (zero_grad(set_to_none=False)); bf16 and fp16 params with fp32 master copies
    (the op's tensor list has holes where an fp32 param has no master)."""
    opt_a, opt_b, params_a, params_b = run_side_by_side(
        "torch", dtypes=(torch.float32, torch.bfloat16, torch.float16), set_to_none=False, master_weights=True
    )
    assert len(op_calls) == STEPS
    assert_same_state(opt_a, opt_b, params_a, params_b)


def scaled_run(scaler_cls, compile_step, backend="torch"):
    """20 steps of scaler.scale(loss).backward(); compiled or eager scaler.step(opt); scaler.update()."""
    params = make_params("cpu")
    opt = make_optimizer(params, backend)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=4)
    scales = []

    def scaler_step():
        scaler.step(opt)

    run = compile_step(scaler_step) if compile_step else scaler_step
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(STEPS):
            grads = grads_for(step, params)
            loss = sum((p * g).sum() for p, g in zip(params, grads))
            scaler.scale(loss).backward()
            run()
            scaler.update()
            scales.append(scaler.get_scale())
            opt.zero_grad()
    return params, opt, scales


@pytest.mark.parametrize(
    "scaler_cls, fullgraph",
    [(fused_stable.GradScaler, SCALER_FULLGRAPH), (torch.amp.GradScaler, False)],
    ids=["fused_stable.GradScaler-fullgraph", "torch.amp.GradScaler"],
)
def test_compiled_scaler_step_equals_eager(scaler_cls, fullgraph, op_calls):
    """fused_stable's GradScaler.step traces whole (fullgraph=True). torch's is on dynamo's skip list (all of
    torch.amp is), so the compiled function breaks the graph there and opt.step() compiles as a graph of its own."""
    params_a, opt_a, scales_a = scaled_run(scaler_cls, None)
    params_b, opt_b, scales_b = scaled_run(scaler_cls, lambda fn: torch.compile(fn, fullgraph=fullgraph))
    assert len(op_calls) == STEPS
    assert_same_state(opt_a, opt_b, params_a, params_b)
    assert scales_b == scales_a
    assert [scales_a[i] / scales_a[i - 1] for i in sorted(INF_STEPS)] == [0.5] * len(INF_STEPS)  # backed off
    assert int(opt_b.skipped_steps) == len(INF_STEPS)


def test_whole_training_step_compiles_with_the_optimizer_inside(op_calls):
    """forward, backward and step in one compiled function (backward breaks the graph, as for any optimizer)."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [FusedAdamW(m.parameters(), lr=1e-2, max_grad_norm=0.5) for m in models]
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def train_step(model, opt):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled_train_step = torch.compile(train_step)
    for _ in range(STEPS):
        eager_loss = train_step(models[0], opts[0])
        compiled_loss = compiled_train_step(models[1], opts[1])
    assert len(op_calls) == STEPS
    # the compiled forward and backward round differently from eager ones (inductor fuses them): close, not equal
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(models[1].parameters(), models[0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_eager_steps_do_not_use_the_op(op_calls):
    params = make_params("cpu")
    opt = make_optimizer(params, "torch")
    for step in range(3):
        for p, g in zip(params, grads_for(step, params)):
            p.grad = g
        opt.step()
    assert op_calls == []


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_compiled_triton_step_equals_eager_on_cuda(op_calls):
    opt_a, opt_b, params_a, params_b = run_side_by_side("triton", device="cuda")
    assert len(op_calls) == STEPS
    assert_same_state(opt_a, opt_b, params_a, params_b)
    assert int(opt_b.skipped_steps) == len(INF_STEPS)


def test_a_traced_step_is_forgotten_with_its_optimizer(op_calls):
    """The op's record of a traced step holds the optimizer's tensors; it goes when the optimizer does."""
    import gc
    import weakref

    gc.collect()
    before = set(compiled._steps)
    params = make_params("cpu")
    opt = make_optimizer(params, "torch")
    for p, g in zip(params, grads_for(0, params)):
        p.grad = g
    torch.compile(opt.step, fullgraph=True)()
    assert len(op_calls) == 1 and len(set(compiled._steps) - before) == 1
    ref = weakref.ref(opt)
    del opt
    torch._dynamo.reset()  # the compiled code holds the optimizer too
    gc.collect()
    assert ref() is None and set(compiled._steps) <= before
