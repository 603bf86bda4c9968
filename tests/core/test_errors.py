"""Bad input gets a clear error, and nothing changes."""

from __future__ import annotations

import pytest
import torch

from fused_stable import FusedAdamW, schedules


def param(n=4, dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(n).to(dtype))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1e-3}, "learning rate"),
        ({"lr": torch.tensor(-1.0)}, "learning rate"),
        ({"eps": -1e-8}, "epsilon"),
        ({"betas": (1.0, 0.999)}, "beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "beta parameter at index 1"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm"),
        ({"clip": "adaptive"}, "clip must be one of"),
        ({"zscore_alpha": 1.0}, "zscore_alpha"),
        ({"zscore_threshold": 0.0}, "zscore_threshold"),
        ({"zscore_warmup": 0}, "zscore_warmup"),
        ({"spike_skip_threshold": 1.0}, "spike_skip_threshold"),
        ({"spike_skip_ratio": -1.0}, "spike_skip_ratio"),
        ({"spike_skip_ratio": float("nan")}, "spike_skip_ratio"),
        ({"backend": "cuda-graphs"}, "unknown fused_stable backend"),
        ({"backend": "triton"}, "needs CUDA tensors"),
    ],
)
def test_bad_hyperparameters_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdamW([param()], **kwargs)


def test_step_rules_check_themselves_and_keep_the_kernels_types():
    """The rule checks live in StepPolicy (FusedAdamW's constructor only builds one): the same errors without an
    optimizer, the clip mode taken by name, numbers kept as the types the kernels' arguments take."""
    from fused_stable import layout

    with pytest.raises(ValueError, match="zscore_alpha must be in"):
        layout.StepPolicy(zscore_alpha=1.5)
    with pytest.raises(ValueError, match="clip must be one of"):
        layout.StepPolicy(clip="adaptive")
    with pytest.raises(TypeError, match="fused_stable.schedules"):
        layout.StepPolicy(schedule="cosine")
    with pytest.raises(ValueError, match="clip_mode must be one of"):
        layout.StepPolicy(clip_mode=2)
    policy = layout.StepPolicy(max_grad_norm=1, clip="zscore", zscore_warmup=3.0, spike_skip_threshold=4)
    assert policy.clip_mode == layout.CLIP_ZSCORE and policy == FusedAdamW([param()], **ZSCORE_OPTIONS).policy
    assert type(policy.max_grad_norm) is float and type(policy.zscore_warmup) is int
    assert type(policy.spike_skip_threshold) is float and layout.StepPolicy().clip_mode == layout.CLIP_FIXED


ZSCORE_OPTIONS = dict(max_grad_norm=1.0, clip="zscore", zscore_warmup=3, spike_skip_threshold=4.0)


def test_bad_group_hyperparameters_raise():
    with pytest.raises(ValueError, match="learning rate"):
        FusedAdamW([{"params": [param()], "lr": -1.0}])


def test_lr_schedule_must_come_from_schedules():
    opt = torch.optim.SGD([param()], lr=0.1)
    with pytest.raises(TypeError, match="fused_stable.schedules"):
        FusedAdamW([param()], lr_schedule=torch.optim.lr_scheduler.StepLR(opt, 1))
    FusedAdamW([param()], lr_schedule=schedules.warmup_cosine(10, 2))


def test_sparse_gradient_is_refused_and_nothing_changes():
    dense, emb = param(), torch.nn.Parameter(torch.randn(10, 3))
    opt = FusedAdamW([dense, emb], lr=0.1)
    dense.grad = torch.ones(4)
    emb.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 3), (10, 3))
    before = dense.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(dense, before) and not opt.state


def test_complex_and_integer_params_are_refused():
    with pytest.raises(TypeError, match="complex"):
        FusedAdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="float32, bfloat16 and float16"):
        FusedAdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])


def test_duplicate_parameters_are_refused():
    p = param()
    with pytest.raises(ValueError, match="appears twice"):
        FusedAdamW([p, p])
    with pytest.raises(ValueError, match="more than one parameter group"):
        FusedAdamW([{"params": [p]}, {"params": [p]}])


def test_params_on_two_devices_are_refused():
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        FusedAdamW([param(), meta])


def test_interpret_backend_needs_the_interpreter(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "interpret", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        FusedAdamW([param()], backend="interpret")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter error path on a CPU tensor")
def test_non_dense_param_is_refused_by_the_kernels():
    base = torch.randn(6, 4)
    p = torch.nn.Parameter(base.t())  # a transposed view: dense, so the kernels may walk it linearly
    q = torch.nn.Parameter(torch.randn(8, 8)[:, :3])  # not dense
    from helpers import interpret_available

    if not interpret_available():
        pytest.skip("needs TRITON_INTERPRET=1")
    opt = FusedAdamW([p, q], lr=0.1, backend="interpret")
    p.grad = torch.ones_like(p)
    q.grad = torch.ones(8, 3)
    with pytest.raises(ValueError, match="dense parameters"):
        opt.step()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check")
def test_transposed_dense_param_matches_torch():
    from helpers import assert_close, interpret_available

    if not interpret_available():
        pytest.skip("needs TRITON_INTERPRET=1")
    base = torch.randn(6, 4)
    ours, theirs = torch.nn.Parameter(base.t()), torch.nn.Parameter(base.t().clone())
    opt, ref = FusedAdamW([ours], lr=0.1, backend="interpret"), torch.optim.AdamW([theirs], lr=0.1)
    for _ in range(3):
        g = torch.randn(6, 4).t()
        ours.grad, theirs.grad = g.clone(), g.clone()
        assert ours.grad.stride() == ours.stride()
        opt.step(), ref.step()
    assert_close(ours, theirs, 1e-5, 1e-6, "transposed param")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check")
def test_a_grad_that_does_not_match_its_param_is_refused():
    from helpers import interpret_available

    if not interpret_available():
        pytest.skip("needs TRITON_INTERPRET=1")
    p = param(6)
    opt = FusedAdamW([p], lr=0.1, backend="interpret")
    before = p.detach().clone()
    p.grad = torch.ones(6)
    opt.step()
    p.grad_dtype = None  # torch refuses a grad of another dtype unless told to allow it, as here
    p.grad = torch.ones(6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must match its parameter"):
        opt.step()
    assert not torch.equal(p, before) and float(opt.state[p]["step"]) == 1.0


def test_a_bad_param_group_added_later_is_refused_and_nothing_changes():
    p = param()
    opt = FusedAdamW([p], lr=0.1, backend="torch")
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    complex_param = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="one device"):
        opt.add_param_group({"params": [meta]})
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [complex_param]})
    assert len(opt.param_groups) == 1
    q = param(5)
    opt.add_param_group({"params": [q], "lr": 0.01})
    p.grad, q.grad = torch.ones(4), torch.ones(5)
    opt.step()
    assert len(opt.param_groups) == 2 and opt.applied_steps.item() == 1
