"""FusedAdamW as a drop-in for torch.optim.AdamW: its keywords, layouts, named and meta params, and state dicts
that load both ways (amsgrad's `max_exp_avg_sq` included). Reference: torch's for-loop AdamW in fp32."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch
from helpers import BACKEND_PARAMS, assert_close, interpret_available

from fused_stable import FusedAdamW

needs_interpreter = pytest.mark.skipif(
    not interpret_available(), reason="needs TRITON_INTERPRET=1 before triton import"
)


def through_disk(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_close_rel(actual, expected, what):
    """fp32 agreement to 1e-6 relative to the tensor's largest value (values near 0 carry their neighbours' ulps)."""
    assert_close(actual, expected, 1e-6, 1e-6 * expected.detach().abs().max().item(), what)


def seeded(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# keywords


def test_every_torch_adamw_keyword_is_accepted_with_torch_defaults():
    import inspect

    torch_params = inspect.signature(torch.optim.AdamW.__init__).parameters
    ours = inspect.signature(FusedAdamW.__init__).parameters
    for name, parameter in torch_params.items():
        if name == "self":
            continue
        assert name in ours, name
        assert ours[name].default == parameter.default, (name, ours[name].default, parameter.default)
        assert ours[name].kind == parameter.kind, name  # amsgrad positional, the rest keyword-only, as torch
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdamW(
        [p], 1e-3, (0.9, 0.999), 1e-8, 1e-2, True, maximize=True, foreach=False, fused=False, capturable=True
    )
    group = opt.param_groups[0]
    assert (
        group["amsgrad"] is True and group["maximize"] is True and group["foreach"] is False and group["fused"] is False
    )


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_foreach_and_fused_have_no_effect(backend):
    results = []
    for extra in ({}, {"foreach": True}, {"fused": True}, {"foreach": False, "fused": False}):
        p = torch.nn.Parameter(seeded((5, 3), 0))
        opt = FusedAdamW([p], lr=0.1, backend=backend, **extra)
        for step in range(2):
            p.grad = seeded((5, 3), step + 1)
            opt.step()
        results.append(p.detach().clone())
    assert all(torch.equal(r, results[0]) for r in results)


def test_fused_and_foreach_together_are_refused_as_torch_does():
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        FusedAdamW([torch.nn.Parameter(torch.ones(2))], foreach=True, fused=True)


def test_differentiable_is_refused_wherever_it_arrives():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="differentiable=True.*torch.optim.AdamW"):
        FusedAdamW([p], differentiable=True)
    with pytest.raises(ValueError, match="param group with differentiable=True"):
        FusedAdamW([{"params": [p], "differentiable": True}])
    opt = FusedAdamW([p], lr=0.1)
    with pytest.raises(ValueError, match="param group with differentiable=True"):
        opt.add_param_group({"params": [q], "differentiable": True})
    assert len(opt.param_groups) == 1
    saved = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], differentiable=True).state_dict()
    with pytest.raises(ValueError, match="state dict saved with differentiable=True"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["differentiable"] is False


def test_tensor_betas_are_taken_as_floats():
    p, q = torch.nn.Parameter(seeded(4, 0)), torch.nn.Parameter(seeded(4, 0))
    opt = FusedAdamW([p], lr=0.1, betas=(torch.tensor([[0.8]]), torch.tensor(0.99)), backend="torch")
    ref = torch.optim.AdamW([q], lr=0.1, betas=(0.8, 0.99), foreach=False)
    assert opt.param_groups[0]["betas"] == (pytest.approx(0.8), pytest.approx(0.99))
    for step in range(3):
        p.grad, q.grad = seeded(4, step + 1), seeded(4, step + 1)
        opt.step(), ref.step()
    assert_close(p, q, 1e-6, 1e-7, "tensor betas")
    with pytest.raises(ValueError, match="both floats or both Tensors"):
        FusedAdamW([p], betas=(0.9, torch.tensor(0.99)))


# ---------------------------------------------------------------------------------------------------------------
# amsgrad and maximize per group, state dicts both ways


def train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


SHAPES = [(7,), (3, 5), (1,)]


def groups_of(params):
    return [{"params": params[:2], "amsgrad": True, "maximize": True}, {"params": params[2:], "lr": 3e-3}]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("direction", ["torch-to-fused", "fused-to-torch"])
def test_amsgrad_state_dicts_load_both_ways(backend, direction):
    """Three steps in one optimizer, its state through disk into the other, three more: the same as six steps of
    torch's AdamW alone (params and every state tensor, max_exp_avg_sq included)."""
    init = [seeded(s, i) for i, s in enumerate(SHAPES)]
    alone = [torch.nn.Parameter(t.clone()) for t in init]
    reference = torch.optim.AdamW(groups_of(alone), lr=1e-2, weight_decay=0.1, foreach=False)
    train(reference, alone, 3, seed=1)
    train(reference, alone, 3, seed=2)

    first_params = [torch.nn.Parameter(t.clone()) for t in init]
    make_torch = lambda ps: torch.optim.AdamW(groups_of(ps), lr=1e-2, weight_decay=0.1, foreach=False)  # noqa: E731
    make_fused = lambda ps: FusedAdamW(groups_of(ps), lr=1e-2, weight_decay=0.1, backend=backend)  # noqa: E731
    make_first, make_second = (make_torch, make_fused) if direction == "torch-to-fused" else (make_fused, make_torch)
    first = make_first(first_params)
    train(first, first_params, 3, seed=1)
    saved = through_disk(first.state_dict())
    assert "max_exp_avg_sq" in saved["state"][0] and "max_exp_avg_sq" not in saved["state"][2]
    second_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    second = make_second(second_params)
    second.load_state_dict(saved)
    assert second.param_groups[0]["amsgrad"] and second.param_groups[0]["maximize"]
    train(second, second_params, 3, seed=2)
    for index, (a, b) in enumerate(zip(second_params, alone)):
        assert_close(a, b, 1e-6, 1e-7, f"param {index}")
        assert set(second.state[a]) == set(reference.state[b])
        for key, value in reference.state[b].items():
            assert_close(second.state[a][key], value, 1e-6, 1e-9, f"{key} {index}")


def test_turning_amsgrad_on_after_steps_is_a_clear_error_and_changes_nothing():
    p = torch.nn.Parameter(seeded(5, 0))
    opt = FusedAdamW([p], lr=0.1, backend="torch")
    train(opt, [p], 2, seed=1)
    before = p.detach().clone()
    opt.param_groups[0]["amsgrad"] = True  # torch's AdamW raises KeyError('max_exp_avg_sq') here
    with pytest.raises(ValueError, match=r"lacks \['max_exp_avg_sq'\].*amsgrad=True"):
        opt.step()
    assert torch.equal(p, before) and float(opt.state[p]["step"]) == 2.0
    opt.param_groups[0]["amsgrad"] = False  # and back: the plan follows the group
    opt.step()
    assert not torch.equal(p, before)


# ---------------------------------------------------------------------------------------------------------------
# layouts: never silently wrong


class Strided(torch.nn.Module):
    """A layer whose weight is a non-dense view (every other column of a bigger tensor), trained through autograd."""

    def __init__(self, seed):
        super().__init__()
        self.weight = torch.nn.Parameter(seeded((6, 10), seed)[:, ::2])
        self.dense = torch.nn.Parameter(seeded((5, 3), seed + 1).t().contiguous().t())  # dense, transposed layout

    def forward(self, x):
        return ((x @ self.weight) @ self.dense).tanh().sum()


def train_strided(make_optimizer, steps=4):
    model = Strided(0)
    assert not model.weight.is_contiguous()
    opt = make_optimizer(model.parameters())
    for step in range(steps):
        model.zero_grad()
        model(seeded((4, 6), 100 + step)).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("options", [{}, {"amsgrad": True, "maximize": True}], ids=["plain", "amsgrad-maximize"])
def test_non_dense_params_on_the_torch_backend_match_torch(options):
    ours, opt = train_strided(lambda ps: FusedAdamW(ps, lr=0.1, max_grad_norm=0.5, backend="torch", **options))
    theirs, ref = train_strided(lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False, **options), steps=0)
    for step in range(4):  # torch's reference with the same clip
        theirs.zero_grad()
        theirs(seeded((4, 6), 100 + step)).backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
        ref.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert a.stride() == b.stride(), name  # updated in place, layout kept
        assert_close_rel(a, b, name)
        for key, value in ref.state[b].items():
            assert_close_rel(opt.state[a][key], value, f"{name} {key}")


def test_grads_whose_strides_differ_from_the_params_match_torch_and_may_change_layout():
    """Transposed grads (and back to contiguous ones, which rebuilds the step's lists) on the torch backend."""
    p, q = torch.nn.Parameter(seeded((4, 6), 0)), torch.nn.Parameter(seeded((4, 6), 0))
    r, s = torch.nn.Parameter(seeded(9, 1)), torch.nn.Parameter(seeded(9, 1))  # a regular neighbour
    opt = FusedAdamW([p, r], lr=0.1, amsgrad=True, backend="torch")
    ref = torch.optim.AdamW([q, s], lr=0.1, amsgrad=True, foreach=False)
    for step in range(5):
        g = seeded((6, 4), 10 + step).t() if step % 3 != 2 else seeded((4, 6), 10 + step)
        p.grad, q.grad = g, g.clone()
        r.grad, s.grad = seeded(9, 20 + step), seeded(9, 20 + step)
        opt.step(), ref.step()
        assert_close(p, q, 1e-6, 1e-7, f"step {step}")
    assert_close(r, s, 1e-6, 1e-7, "neighbour")
    assert_close(opt.state[p]["max_exp_avg_sq"], ref.state[q]["max_exp_avg_sq"], 1e-6, 1e-9, "max_exp_avg_sq")


@pytest.mark.torch_ops
def test_low_precision_non_dense_params_update_as_their_dense_copies():
    """bf16 with fp32 masters: the working-copy path gives bit for bit what the regular path gives, both through
    torch's `_fused_adamw_` (torch_ops). With the compiled CPU ops a dense bf16 param takes the compiled update
    instead (its own arithmetic, within torch's floor: test_cpu_ops.py::test_low_precision_params_take_the_
    compiled_update_within_torch_ops_floor) while a strided one keeps the working copies."""
    base = seeded((6, 10), 0).to(torch.bfloat16)
    strided, dense = torch.nn.Parameter(base[:, ::2]), torch.nn.Parameter(base[:, ::2].contiguous())
    opts = [FusedAdamW([t], lr=0.05, master_weights=True, backend="torch") for t in (strided, dense)]
    for step in range(3):
        g = seeded((6, 5), step + 1).to(torch.bfloat16)
        strided.grad, dense.grad = g.clone(), g.clone()
        for opt in opts:
            opt.step()
    assert torch.equal(strided, dense)
    for key in ("exp_avg", "exp_avg_sq", "master_param"):
        assert torch.equal(opts[0].state[strided][key], opts[1].state[dense][key]), key


@needs_interpreter
def test_the_kernels_refuse_such_layouts_and_the_fix_they_name_works():
    for make in (lambda: train_strided(lambda ps: FusedAdamW(ps, lr=0.1, backend="interpret"), steps=1),):
        with pytest.raises(ValueError, match="backend='torch'") as refused:
            make()
        assert "working copies" in str(refused.value)
    p = torch.nn.Parameter(seeded((4, 6), 0))
    opt = FusedAdamW([p], lr=0.1, backend="interpret")
    p.grad = seeded((6, 4), 1).t()
    with pytest.raises(ValueError, match=r"p.grad = g.contiguous\(\).*backend='torch'"):
        opt.step()
    # the named fixes: a contiguous grad on the kernels, or backend='torch' (checked against torch above)
    q = torch.nn.Parameter(seeded((4, 6), 0))
    ref = torch.optim.AdamW([q], lr=0.1, foreach=False)
    p.grad, q.grad = p.grad.contiguous(), seeded((6, 4), 1).t()
    opt.step(), ref.step()
    assert_close(p, q, 1e-6, 1e-7, "contiguous grad on the kernels")


# ---------------------------------------------------------------------------------------------------------------
# named and meta params, the interpreter switched on too late


def test_named_parameters_in_the_constructor_and_add_param_group():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    twin.load_state_dict(model.state_dict())
    named = list(model.named_parameters())
    opt = FusedAdamW(named[:2], lr=0.1, backend="torch")
    opt.add_param_group({"params": named[2:], "lr": 0.01, "amsgrad": True})
    ref = torch.optim.AdamW(list(twin.named_parameters())[:2], lr=0.1, foreach=False)
    ref.add_param_group({"params": list(twin.named_parameters())[2:], "lr": 0.01, "amsgrad": True})
    assert [g["param_names"] for g in opt.param_groups] == [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
    assert opt.param_names == ["0.weight", "0.bias", "1.weight", "1.bias"]  # what per_tensor_grad_norms() follows
    assert all(isinstance(p, torch.Tensor) for g in opt.param_groups for p in g["params"])
    x = seeded((5, 3), 0)
    for _ in range(3):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert_close(a, b, 1e-6, 1e-7, "named")
    saved = through_disk(opt.state_dict())
    assert saved["param_groups"][1]["param_names"] == ["1.weight", "1.bias"]
    ref.load_state_dict(saved)  # torch takes it, names and all
    with pytest.raises(ValueError, match="with/without names"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert len(opt.param_groups) == 2


def test_meta_params_step_like_torch():
    ours = torch.nn.Parameter(torch.empty(5, 3, device="meta"))
    theirs = torch.nn.Parameter(torch.empty(5, 3, device="meta"))
    opt = FusedAdamW([ours], lr=0.1, amsgrad=True)
    ref = torch.optim.AdamW([theirs], lr=0.1, amsgrad=True)
    for _ in range(2):
        ours.grad, theirs.grad = torch.empty(5, 3, device="meta"), torch.empty(5, 3, device="meta")
        opt.step(), ref.step()
    assert set(opt.state[ours]) == set(ref.state[theirs])
    assert all(opt.state[ours][k].shape == ref.state[theirs][k].shape for k in ref.state[theirs])
    assert ours.device.type == "meta"


def test_interpret_backend_after_triton_was_imported_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FUSED_STABLE_BACKEND"] = "interpret"
    code = (
        "import triton, torch\nfrom fused_stable import FusedAdamW\nFusedAdamW([torch.nn.Parameter(torch.ones(3))])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: backend 'interpret' needs Triton's interpreter") and "before" in last, last
    assert "InterpreterError" not in proc.stderr
    # switched on too late by hand (os.environ after `import triton`): the same clear error, not one in step()
    late = "import os, triton, torch\nos.environ['TRITON_INTERPRET'] = '1'\n" + code.split("\n", 1)[1]
    proc = subprocess.run([sys.executable, "-c", late], env=env, capture_output=True, text=True, timeout=300)
    assert "RuntimeError: backend 'interpret' needs Triton's interpreter" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_torch_state_with_tensor_lr_and_betas_loads_and_continues_as_torch(backend):
    p, q = torch.nn.Parameter(seeded(6, 0)), torch.nn.Parameter(seeded(6, 0))
    ref = torch.optim.AdamW([q], lr=torch.tensor(0.01), betas=(torch.tensor(0.8), torch.tensor(0.99)), foreach=False)
    q.grad = seeded(6, 1)
    ref.step()
    opt = FusedAdamW([p], backend=backend)
    opt.load_state_dict(through_disk(ref.state_dict()))
    p.data.copy_(q.detach())
    assert all(isinstance(b, float) for b in opt.param_groups[0]["betas"])
    for step in range(2):
        p.grad, q.grad = seeded(6, step + 2), seeded(6, step + 2)
        opt.step(), ref.step()
    assert_close(p, q, 1e-6, 1e-7, "continued")


def test_a_grad_laid_out_otherwise_at_the_same_address_is_seen():
    """torch backend: a new grad in the old grad's memory but transposed (as_strided over the same storage)."""
    p, q = torch.nn.Parameter(seeded((4, 6), 0)), torch.nn.Parameter(seeded((4, 6), 0))
    opt = FusedAdamW([p], lr=0.1, backend="torch")
    ref = torch.optim.AdamW([q], lr=0.1, foreach=False)
    storage = torch.empty(24)
    p.grad, q.grad = storage.view(4, 6).copy_(seeded((4, 6), 1)), seeded((4, 6), 1)
    opt.step(), ref.step()
    transposed = storage.as_strided((4, 6), (1, 4))  # same address and size, other strides
    transposed.copy_(seeded((4, 6), 2))
    p.grad, q.grad = transposed, seeded((4, 6), 2)
    assert p.grad.data_ptr() == storage.data_ptr()
    opt.step(), ref.step()
    assert_close(p, q, 1e-6, 1e-7, "after a transposed grad at the same address")


def reference_amsgrad_maximize_fp64(init, grads_per_step, *, lr, betas, eps, weight_decay, max_norm):
    """AdamW with amsgrad and maximize, global-norm clipping, in float64 (the same grads). Returns (p, m, v, v_max)."""
    p = [x.double().clone() for x in init]
    m, v, v_max = ([torch.zeros_like(x) for x in p] for _ in range(3))
    beta1, beta2 = betas
    for step, grads in enumerate(grads_per_step, start=1):
        g = [x.double() for x in grads]
        total = float(torch.sqrt(sum((x * x).sum() for x in g)))
        coef = min(1.0, max_norm / (total + 1e-6))
        for i in range(len(p)):
            gi = -g[i] * coef  # maximize
            p[i] = p[i] * (1 - lr * weight_decay)
            m[i] = beta1 * m[i] + (1 - beta1) * gi
            v[i] = beta2 * v[i] + (1 - beta2) * gi * gi
            v_max[i] = torch.maximum(v_max[i], v[i])
            p[i] = p[i] - lr / (1 - beta1**step) * m[i] / ((v_max[i] / (1 - beta2**step)).sqrt() + eps)
    return p, m, v, v_max


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_bf16_params_with_masters_follow_the_fp64_amsgrad_maximize_reference(backend):
    gen = torch.Generator().manual_seed(5)
    shapes = [(7,), (1025,), (3, 11)]
    init = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes] for _ in range(6)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    opt = FusedAdamW(params, amsgrad=True, maximize=True, master_weights=True, max_grad_norm=1.0, backend=backend, **hp)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    ref_p, ref_m, ref_v, ref_max = reference_amsgrad_maximize_fp64(init, grads, max_norm=1.0, **hp)
    for i, p in enumerate(params):
        state = opt.state[p]
        assert state["max_exp_avg_sq"].dtype == torch.float32
        assert_close(state["master_param"], ref_p[i], 1e-5, 1e-6, f"master {i}")
        assert_close(state["exp_avg"], ref_m[i], 1e-4, 1e-6, f"exp_avg {i}")
        assert_close(state["max_exp_avg_sq"], ref_max[i], 1e-4, 1e-9, f"max_exp_avg_sq {i}")
        assert torch.equal(p.detach(), state["master_param"].to(torch.bfloat16)), "param is the rounded master"
