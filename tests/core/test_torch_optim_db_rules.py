"""PyTorch's own test inputs (`optim_db` in torch.testing._internal.common_optimizers) for the rules after AdamW,
each against torch's own optimizer (+ torch.nn.utils.clip_grad_norm_): FusedSGD against torch.optim.SGD,
FusedAdafactor (a matrix rule: the same update code after either backend's decisions) against torch.optim.Adafactor.

Every kwargs set torch lists for the rule is run for 10 seeded steps next to torch's for-loop optimizer: on the
`torch` backend with and without a clip; on the `interpret` backend (the Triton kernels) all sets at once, one
param group each, with and without a clip. fp32 params and every state tensor within 1e-6 relative (to the
tensor's largest value): the fused step's arithmetic is the same ops in the same order, and the clip coefficient
differs from clip_grad_norm_'s by an fp32 ulp or two (another summation order). torch's error inputs must fail the
same way (type and message), except where said below why not.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, copy_kwargs, interpret_available

from fused_stable import FusedAdafactor, FusedSGD

pytest.importorskip("expecttest")
from torch.testing._internal import common_optimizers  # noqa: E402

STEPS = 10
SHAPES = [(5,), (3, 7), (1,), (33,)]
OPTIMIZER_LEVEL = {"capturable", "foreach", "fused", "differentiable"}
RULES = {"sgd": (torch.optim.SGD, FusedSGD), "adafactor": (torch.optim.Adafactor, FusedAdafactor)}


def _inputs(reference) -> list:
    info = next(i for i in common_optimizers.optim_db if i.optim_cls is reference)
    inputs: dict[str, object] = {}
    for device in ("cpu", "cuda"):
        for optimizer_input in info.optim_inputs_func(device=device, dtype=torch.float32):
            inputs.setdefault(optimizer_input.desc, optimizer_input)
    return list(inputs.values())


CASES = [
    pytest.param(name, i, id=f"{name}-{i.desc.replace(' ', '-')}") for name in RULES for i in _inputs(RULES[name][0])
]


def _run(name: str, groups: list[tuple[list[torch.Tensor], dict]], common: dict, backend: str, max_norm):
    reference, fused = RULES[name]
    ours_groups = [{"params": [torch.nn.Parameter(t.clone()) for t in ts], **copy_kwargs(kw)} for ts, kw in groups]
    theirs_groups = [{"params": [torch.nn.Parameter(t.clone()) for t in ts], **copy_kwargs(kw)} for ts, kw in groups]
    ours = fused(ours_groups, backend=backend, max_grad_norm=max_norm, **copy_kwargs(common))
    theirs = reference(theirs_groups, **{**copy_kwargs(common), "foreach": False})
    params_ours = [p for g in ours.param_groups for p in g["params"]]
    params_theirs = [p for g in theirs.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for a, b in zip(params_ours, params_theirs):
            g = torch.randn(a.shape, generator=gen) * 3
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params_theirs, max_norm)
        theirs.step()
    if max_norm is not None:
        assert ours.grad_norm.item() > 2 * max_norm  # the clip was active
    for index, (a, b) in enumerate(zip(params_ours, params_theirs)):
        assert_close(a, b, 1e-6, 1e-6 * b.detach().abs().max().item(), f"param {index}")
        state_theirs = theirs.state[b]
        assert set(state_theirs) <= set(ours.state[a]), f"state keys {sorted(ours.state[a])} vs {sorted(state_theirs)}"
        for key, value in state_theirs.items():
            if isinstance(value, torch.Tensor) and key != "step":
                assert_close(ours.state[a][key], value, 1e-6, 1e-6 * value.abs().max().item(), f"{key} {index}")


def _tensors(seed: int, shapes=SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in shapes]


@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name, optimizer_input", CASES)
def test_torch_backend_matches_torchs_optimizer(name, optimizer_input, max_norm):
    _run(name, [(_tensors(0), {})], optimizer_input.kwargs, "torch", max_norm)


@pytest.mark.skipif(not interpret_available(), reason="needs TRITON_INTERPRET=1 before triton import")
@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name", list(RULES))
def test_interpreted_kernels_match_on_every_input_at_once(name, max_norm):
    """One param group per optim_db kwargs set (the interpreter is slow: one optimizer covers them all)."""
    groups = []
    for index, optimizer_input in enumerate(_inputs(RULES[name][0])):
        per_group = {k: v for k, v in optimizer_input.kwargs.items() if k not in OPTIMIZER_LEVEL}
        groups.append((_tensors(index, SHAPES[:2]), per_group))
    _run(name, groups, {}, "interpret", max_norm)


def _error_inputs(reference) -> list:
    info = next(i for i in common_optimizers.optim_db if i.optim_cls is reference)
    return info.optim_error_inputs_func(device="cpu", dtype=torch.float32)


ERROR_CASES = [
    pytest.param(name, e, id=f"{name}-{e.optimizer_error_input.desc[:50]}")
    for name in RULES
    for e in _error_inputs(RULES[name][0])
]


@pytest.mark.parametrize("name, error_input", ERROR_CASES)
def test_torch_error_inputs_fail_the_same_way(name, error_input):
    """torch's error inputs: the same exception type and message; where torch only warns (a parameter twice in one
    group, which it would then update twice) the fused optimizer refuses it."""
    optimizer_input = error_input.optimizer_error_input
    params = optimizer_input.params if optimizer_input.params is not None else [torch.nn.Parameter(torch.randn(3))]
    if "complex" in optimizer_input.desc:  # torch raises at the step; every fused class at construction, so
        with pytest.raises(TypeError, match="does not support complex parameters"):  # nothing is half-built
            RULES[name][1](params, **optimizer_input.kwargs)
        return
    if error_input.error_type is UserWarning:
        with pytest.raises(ValueError, match="appears twice"):
            RULES[name][1](params, **optimizer_input.kwargs)
        return
    with pytest.raises(error_input.error_type, match=error_input.error_regex):
        RULES[name][1](params, **optimizer_input.kwargs)


def test_sgd_nesterov_needs_momentum_and_no_dampening_as_torch():
    """torch.optim.SGD's one check between keys, with its words, for the constructor and an added group."""
    params = [torch.nn.Parameter(torch.randn(3))]
    for kwargs in (dict(nesterov=True), dict(nesterov=True, momentum=0.9, dampening=0.1)):
        with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
            torch.optim.SGD(params, **kwargs)
        with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
            FusedSGD(params, **kwargs)
    opt = FusedSGD(params, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "dampening": 0.5})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "interpret",
            marks=pytest.mark.skipif(not interpret_available(), reason="needs TRITON_INTERPRET=1 before triton import"),
        ),
    ],
)
def test_a_torch_sgd_state_dict_continues_its_momentum(backend):
    """torch.optim.SGD keeps no `step`: its saved buffers have been written, so FusedSGD loading them goes on with
    `momentum * B + (1 - dampening) * g`, not the first update's `B = g` (dampening makes the two differ)."""
    kwargs = dict(lr=0.1, momentum=0.9, dampening=0.5)
    theirs = [torch.nn.Parameter(t) for t in _tensors(3)]
    reference = torch.optim.SGD(theirs, foreach=False, **kwargs)
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(p.shape, generator=gen) for p in theirs] for _ in range(4)]
    for step in range(2):
        for p, g in zip(theirs, grads[step]):
            p.grad = g.clone()
        reference.step()
    saved = reference.state_dict()
    assert all("step" not in entry for entry in saved["state"].values())
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    fused = FusedSGD(ours, backend=backend, **kwargs)
    fused.load_state_dict(saved)
    for step in (2, 3):
        for params, opt in ((theirs, reference), (ours, fused)):
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()
            opt.step()
    for index, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a, b, 1e-6, 1e-6 * b.detach().abs().max().item(), f"param {index}")
        buffer = reference.state[b]["momentum_buffer"]
        assert_close(fused.state[a]["momentum_buffer"], buffer, 1e-6, 1e-6 * buffer.abs().max().item(), "buffer")
