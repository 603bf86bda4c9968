"""PyTorch's own AdamW test inputs (`optim_db` in torch.testing._internal.common_optimizers) against FusedAdamW.

Every kwargs set torch lists for AdamW, on every device type its input function knows (the CUDA- and MPS-only
sets are kwargs like the others: capturable, tensor lr and betas), is swapped in for torch.optim.AdamW and run
for 10 seeded steps next to torch's for-loop AdamW (+ torch.nn.utils.clip_grad_norm_): on the `torch` backend
with and without clipping, in one and in two param groups; on the `interpret` backend (the Triton kernels) all
sets at once, one param group each, with and without clipping, and one set alone. fp32: params and every state
tensor within 1e-6 relative (to the tensor's largest value). torch's error inputs must fail the same way.

What cannot apply, and why (nothing here is skipped silently):
  - torch's reference runs with capturable=False: torch's capturable path refuses CPU tensors; FusedAdamW keeps
    capturable=True (its step is always capturable) and the math is the same.
  - optim_db's float64 and complex runs: FusedAdamW updates float32, bfloat16 and float16 parameters (others are
    refused with a TypeError, tests/core/test_errors.py). Its float16 variant only raises eps to 0.1.
  - the error inputs in DIFFERENT_ERRORS below, where FusedAdamW deliberately differs.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import assert_close, copy_kwargs, interpret_available

from fused_stable import FusedAdamW

# torch's test inputs import expecttest (in the test extras); a machine without it (the GPU check's) skips the module
pytest.importorskip("expecttest")
from torch.testing._internal import common_optimizers  # noqa: E402

ADAMW = next(info for info in common_optimizers.optim_db if info.optim_cls is torch.optim.AdamW)
STEPS = 10
SHAPES = [(5,), (3, 7), (1,), (33,)]  # odd sizes, a 2-D one, a single element
# keys FusedAdamW takes only at construction; the rest may also vary per param group
OPTIMIZER_LEVEL = {"capturable", "foreach", "fused", "differentiable"}


def optim_db_inputs() -> list:
    inputs: dict[str, object] = {}
    for device in ("cpu", "cuda", "mps"):
        for optimizer_input in ADAMW.optim_inputs_func(device=device, dtype=torch.float32):
            inputs.setdefault(optimizer_input.desc, optimizer_input)
    return list(inputs.values())


INPUTS = optim_db_inputs()
IDS = [i.desc.replace(" ", "-").replace(",", "") for i in INPUTS]


def reference_kwargs(kwargs: dict) -> dict:
    """torch's own AdamW with the same kwargs, on its for-loop path; capturable off (it refuses CPU tensors)."""
    kwargs = {key: value for key, value in kwargs.items() if key != "capturable"}
    return {**kwargs, "foreach": False}


def make_params(seed: int, count: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(count) for shape in SHAPES]


def run_both(groups_ours, groups_theirs, opt_kwargs: dict, *, backend: str, max_norm, seed: int = 1):
    params_ours = [p for g in groups_ours for p in g["params"]]
    params_theirs = [p for g in groups_theirs for p in g["params"]]
    ours = FusedAdamW(groups_ours, backend=backend, max_grad_norm=max_norm, **copy_kwargs(opt_kwargs))
    theirs = torch.optim.AdamW(groups_theirs, **reference_kwargs(copy_kwargs(opt_kwargs)))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        for a, b in zip(params_ours, params_theirs):
            g = torch.randn(a.shape, generator=gen) * 3
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params_theirs, max_norm)
        theirs.step()
    if max_norm is not None:  # the clip was really active
        assert ours.grad_norm.item() > 2 * max_norm
    return ours, theirs, params_ours, params_theirs


def assert_same(ours, theirs, params_ours, params_theirs, what: str) -> None:
    for index, (a, b) in enumerate(zip(params_ours, params_theirs)):
        scale = b.detach().abs().max().item()
        assert_close(a, b, 1e-6, 1e-6 * scale, f"{what}: param {index}")
        state_ours, state_theirs = ours.state[a], theirs.state[b]
        assert set(state_ours) == set(state_theirs), (
            f"{what}: state keys {sorted(state_ours)} vs {sorted(state_theirs)}"
        )
        for key, value in state_theirs.items():
            if key == "step":
                assert float(state_ours[key]) == float(value) == STEPS, f"{what}: step {index}"
            else:
                scale = value.abs().max().item()
                assert_close(state_ours[key], value, 1e-6, 1e-6 * scale, f"{what}: {key} {index}")


def second_group_overrides(kwargs: dict) -> dict:
    """Another group with other values for every per-group key (amsgrad and maximize flipped too)."""
    return {
        "lr": 3e-3,
        "weight_decay": 0.05,
        "eps": 1e-6,
        "betas": (0.8, 0.99),
        "amsgrad": not kwargs.get("amsgrad", False),
        "maximize": not kwargs.get("maximize", False),
    }


@pytest.mark.parametrize("groups", ["one-group", "two-groups"])
@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("optimizer_input", INPUTS, ids=IDS)
def test_torch_backend_matches_torch_adamw(optimizer_input, max_norm, groups):
    kwargs = optimizer_input.kwargs
    init = make_params(seed=0)
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    if groups == "one-group":
        groups_ours, groups_theirs = [{"params": ours}], [{"params": theirs}]
    else:
        extra = second_group_overrides(kwargs)
        groups_ours = [{"params": ours[:2]}, {"params": ours[2:], **extra}]
        groups_theirs = [{"params": theirs[:2]}, {"params": theirs[2:], **extra}]
    result = run_both(groups_ours, groups_theirs, kwargs, backend="torch", max_norm=max_norm)
    assert_same(*result, optimizer_input.desc)


needs_interpreter = pytest.mark.skipif(
    not interpret_available(), reason="needs TRITON_INTERPRET=1 before triton import"
)


@needs_interpreter
@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["no-clip", "clip"])
def test_interpreted_kernels_match_torch_adamw_on_every_input_at_once(max_norm):
    """One param group per optim_db kwargs set (the interpreter is slow: one optimizer covers them all)."""
    groups_ours, groups_theirs = [], []
    for index, optimizer_input in enumerate(INPUTS):
        per_group = {k: v for k, v in optimizer_input.kwargs.items() if k not in OPTIMIZER_LEVEL}
        init = [torch.randn(shape, generator=torch.Generator().manual_seed(index)) for shape in SHAPES[:2]]
        groups_ours.append({"params": [torch.nn.Parameter(t.clone()) for t in init], **copy_kwargs(per_group)})
        groups_theirs.append({"params": [torch.nn.Parameter(t.clone()) for t in init], **copy_kwargs(per_group)})
    # optimizer-level keys: the union over the inputs (capturable is taken; foreach/fused have no effect)
    result = run_both(groups_ours, groups_theirs, {"capturable": True}, backend="interpret", max_norm=max_norm)
    assert_same(*result, "every optim_db input")


@needs_interpreter
def test_interpreted_kernels_match_torch_adamw_on_one_input_in_one_group():
    optimizer_input = next(
        i for i in INPUTS if i.kwargs.get("amsgrad") and isinstance(i.kwargs.get("lr"), torch.Tensor)
    )
    init = make_params(seed=0)
    result = run_both(
        [{"params": [torch.nn.Parameter(t.clone()) for t in init]}],
        [{"params": [torch.nn.Parameter(t.clone()) for t in init]}],
        {**optimizer_input.kwargs, "maximize": True},
        backend="interpret",
        max_norm=1.0,
    )
    assert_same(*result, optimizer_input.desc)


# ---------------------------------------------------------------------------------------------------------------
# torch's error inputs

DIFFERENT_ERRORS = {
    # desc -> why FusedAdamW differs (checked below to do what is said)
    "a param group cannot have duplicate parameters": "torch warns and keeps the duplicate; FusedAdamW refuses it (ValueError): it would update it twice",
    "lr as Tensor doesn't work with foreach & not capturable": "torch's foreach path cannot take a tensor lr; FusedAdamW's foreach= has no effect and a tensor lr works",
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True": "the same: tensor betas work whatever foreach= says",
}


def error_inputs():
    return ADAMW.optim_error_inputs_func(device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("error_input", error_inputs(), ids=lambda e: e.optimizer_error_input.desc[:60])
def test_torch_error_inputs_fail_the_same_way(error_input):
    optimizer_input = error_input.optimizer_error_input
    params = optimizer_input.params if optimizer_input.params is not None else [torch.nn.Parameter(torch.randn(3))]
    if optimizer_input.desc in DIFFERENT_ERRORS:
        if error_input.error_type is UserWarning:
            with pytest.raises(ValueError, match="appears twice"):
                FusedAdamW(params, **optimizer_input.kwargs)
        else:  # accepted, and the step is torch's for-loop one
            ours = FusedAdamW(
                [p := torch.nn.Parameter(torch.ones(3))], backend="torch", **copy_kwargs(optimizer_input.kwargs)
            )
            theirs = torch.optim.AdamW(
                [q := torch.nn.Parameter(torch.ones(3))], **reference_kwargs(optimizer_input.kwargs)
            )
            p.grad, q.grad = torch.arange(3.0), torch.arange(3.0)
            ours.step(), theirs.step()
            assert_close(p, q, 1e-6, 1e-7, optimizer_input.desc)
        return
    assert error_input.error_type in (TypeError, ValueError, RuntimeError), error_input.error_type
    with pytest.raises(error_input.error_type, match=error_input.error_regex):
        FusedAdamW(params, **optimizer_input.kwargs)


def test_every_listed_difference_is_an_error_input_torch_has():
    descs = {e.optimizer_error_input.desc for e in error_inputs()}
    assert set(DIFFERENT_ERRORS) <= descs, set(DIFFERENT_ERRORS) - descs


def test_the_inputs_cover_every_adamw_option():
    """optim_db's AdamW inputs are what this module promises to cover: if torch drops one, say so here."""
    keys = {key for i in INPUTS for key in i.kwargs}
    assert {"lr", "weight_decay", "amsgrad", "maximize", "capturable", "betas"} <= keys, keys
    assert len(INPUTS) >= 10 and any(isinstance(i.kwargs.get("lr"), torch.Tensor) for i in INPUTS)
    assert re.fullmatch(r"[\w\-]+", "-".join(IDS))
