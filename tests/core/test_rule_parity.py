"""One parity harness for every update rule: rows of (reference factory, fused factory, options), each run on the
CPU backends (the torch backend with and without its compiled ops, its 0-dim tensor decisions, and the Triton
kernels through the interpreter) with the features every rule shares: the global-norm clip before the update,
a skipped step's bit-identity, the device lr schedule, the state precisions, resuming from a state dict, and
torch's state dict both ways. A new rule is a new row.

Tolerances come from a floor measured in the same run: the reference in fp32 against the same reference in fp64
(`_floor`). The fused step may differ from the fp64 run by at most twice what the fp32 reference itself does,
plus one ulp of the value; for AdamW and Lion the measured difference to the fp32 reference is 0 for the params
on most rows (the same operations in the same order) and an ulp or two of the moments where torch's CPU kernels
fuse a multiply-add (`add(x, alpha=...)` is an FMA in its vectorised loop).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from lion_pytorch import Lion

from fused_stable import FusedAdamW, FusedLion, FusedSGD, schedules
from tests.helpers import WITH_TENSOR_DECISIONS


@dataclass(frozen=True)
class Row:
    """One rule: its reference (a torch optimizer class taking the same hyper-parameters), its fused optimizer,
    the hyper-parameters the rows run with, and the state keys both keep."""

    name: str
    reference: Callable[..., torch.optim.Optimizer]
    fused: Callable[..., Any]
    hparams: dict
    state_keys: tuple[str, ...]


ROWS = [
    Row(
        "adamw",
        lambda params, **hp: torch.optim.AdamW(params, foreach=False, **hp),
        FusedAdamW,
        dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
        ("exp_avg", "exp_avg_sq"),
    ),
    Row(
        "lion",
        lambda params, **hp: Lion(params, **hp),
        FusedLion,
        dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
        ("exp_avg",),
    ),
    Row(
        "sgd",
        lambda params, **hp: torch.optim.SGD(params, foreach=False, **hp),
        FusedSGD,
        dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1),
        ("momentum_buffer",),
    ),
]
ROW_PARAMS = [pytest.param(row, id=row.name) for row in ROWS]

# odd sizes, a 0-element tensor, a 1-element one, matrices, and more tensors than one launch group's worth
SHAPES = [(37, 53), (1000,), (3,), (0,), (1,), (64, 65), (5003,), *[(7, 11)] * 24]


def _params(seed: int = 0, dtype=torch.float64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in SHAPES]


def _grads(step: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) * scale for shape in SHAPES]


def _reference_run(row: Row, steps: int, dtype, max_norm: float | None, lrs: list[float] | None = None):
    """The reference optimizer after `steps` steps of `_grads` (clipped with clip_grad_norm_ first), in `dtype`."""
    params = [torch.nn.Parameter(p.to(dtype)) for p in _params()]
    opt = row.reference(params, **row.hparams)
    for step in range(steps):
        for p, g in zip(params, _grads(step, 30.0)):
            p.grad = g.to(dtype)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        opt.step()
    return params, opt


def _fused_run(row: Row, backend: str, steps: int, **options):
    params = [torch.nn.Parameter(p.float()) for p in _params()]
    opt = row.fused(params, backend=backend, **row.hparams, **options)
    for step in range(steps):
        for p, g in zip(params, _grads(step, 30.0)):
            p.grad = g.float()
        opt.step()
    return params, opt


def _saved(state_dict: dict) -> dict:
    """A state dict as a checkpoint gives it back: state_dict() holds live tensors, which loading straight into
    another optimizer would share."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _assert_within_floor(ours, ref32, ref64, what: str) -> None:
    """|ours - fp64| <= 2 * |fp32 reference - fp64| (the floor, per tensor) + one fp32 ulp of the fp64 value."""
    for index, (a, b, c) in enumerate(zip(ours, ref32, ref64)):
        a, b, c = a.detach().double(), b.detach().double(), c.detach().double()
        floor = (b - c).abs().max() if c.numel() else torch.tensor(0.0, dtype=torch.float64)
        ulp = torch.finfo(torch.float32).eps * c.abs()
        excess = (a - c).abs() - 2 * floor - ulp
        assert not (excess > 0).any(), (
            f"{what} tensor {index} {tuple(c.shape)}: {int((excess > 0).sum())} elements beyond the floor "
            f"{float(floor):.3e}; worst |diff| {float((a - c).abs().max()):.3e}"
        )


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
@pytest.mark.parametrize("row", ROW_PARAMS)
def test_matches_the_reference_after_clip_grad_norm(row: Row, backend: str):
    """Params and every state tensor against `clip_grad_norm_` + the reference, 4 steps on 31 tensors of odd
    sizes (a 0-element one too), grads 30x larger than the clip threshold: the clip comes before the momentum."""
    ours, opt = _fused_run(row, backend, 4, max_grad_norm=1.0)
    ref32, opt32 = _reference_run(row, 4, torch.float32, 1.0)
    ref64, opt64 = _reference_run(row, 4, torch.float64, 1.0)
    _assert_within_floor(ours, ref32, ref64, "params")
    for key in row.state_keys:
        states = [opt.state[p][key] for p in ours]
        _assert_within_floor(states, [opt32.state[p][key] for p in ref32], [opt64.state[p][key] for p in ref64], key)
    # and the read-out is the norm clip_grad_norm_ saw on the last step
    last = _grads(3, 30.0)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in last]))
    torch.testing.assert_close(opt.grad_norm, expected, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
@pytest.mark.parametrize("row", ROW_PARAMS)
def test_a_non_finite_step_changes_nothing(row: Row, backend: str):
    """An inf in one grad skips the whole step: every param, state tensor and `step` bit-identical, counted."""
    params, opt = _fused_run(row, backend, 2, max_grad_norm=1.0)
    before = [p.detach().clone() for p in params]
    states = {k: [opt.state[p][k].clone() for p in params] for k in (*row.state_keys, "step")}
    grads = _grads(5)
    grads[3 if SHAPES[3] != (0,) else 1][0] = float("inf")
    for p, g in zip(params, grads):
        p.grad = g.float()
    opt.step()
    assert int(opt.skipped_steps) == 1 and bool(opt.last_step_skipped)
    for index, (p, b) in enumerate(zip(params, before)):
        assert torch.equal(p.detach(), b), f"param {index} moved on a skipped step"
    for key, saved in states.items():
        for index, (p, s) in enumerate(zip(params, saved)):
            assert torch.equal(opt.state[p][key], s), f"{key} of param {index} moved on a skipped step"


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
@pytest.mark.parametrize("row", ROW_PARAMS)
def test_the_device_schedule_is_the_reference_with_the_same_lrs(row: Row, backend: str):
    """lr_schedule (warm-up + cosine, on the device) equals the reference stepped with those lrs set by hand."""
    schedule = schedules.warmup_cosine(total_steps=6, warmup_steps=2, min_lr_ratio=0.1)
    ours, opt = _fused_run(row, backend, 5, lr_schedule=schedule)
    lrs = [row.hparams["lr"] * schedule.factor(step) for step in range(5)]
    ref32, _ = _reference_run(row, 5, torch.float32, None, lrs)
    ref64, _ = _reference_run(row, 5, torch.float64, None, lrs)
    _assert_within_floor(ours, ref32, ref64, "params")


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("row", ROW_PARAMS)
def test_low_precision_state_is_the_same_on_every_backend(row: Row, precision: str):
    """bf16 and 8-bit state: the Triton kernels (interpreted) and the torch backend's doors store the same codes,
    scales and params, bit for bit (the exact reference is the kernels' arithmetic in torch). Without a clip: the
    global norm's fp32 sum is accumulated in another order by each backend (and by each launch grouping), so a
    clip coefficient may differ in its last bit. The small tensors an 8-bit group keeps in fp32 may differ by an
    ulp (AdamW's compiled fp32 op computes its step scalars in fp64, as torch does)."""
    runs = {backend: _fused_run(row, backend, 3, state_precision=precision) for backend in ("torch", "interpret")}
    (ours, opt), (theirs, other) = runs["torch"], runs["interpret"]
    compact = 0
    for index, (p, q) in enumerate(zip(ours, theirs)):
        assert opt.state[p].keys() == other.state[q].keys()
        if opt.state[p][row.state_keys[0]].dtype == torch.float32:  # a small tensor of an 8-bit group
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            continue
        compact += 1
        assert torch.equal(p, q), f"param {index} differs between the backends"
        for key, value in opt.state[p].items():
            assert torch.equal(value, other.state[q][key]), f"{key} of param {index} differs between the backends"
    big = ours[6]  # (5003,): quantised in 8-bit (>= 4096 elements), bf16 in bf16
    expected = {"bf16": torch.bfloat16, "8bit": torch.int8}[precision]
    assert opt.state[big][row.state_keys[0]].dtype == expected
    assert compact == (2 if precision == "8bit" else len(SHAPES))


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
@pytest.mark.parametrize("row", ROW_PARAMS)
def test_resuming_from_a_saved_state_dict_is_the_uninterrupted_run(row: Row, backend: str):
    """state_dict after 2 steps, through torch.save / torch.load(weights_only=True), into a new optimizer over
    copies of the params: 2 more steps equal the uninterrupted run's 4, bit for bit."""
    whole, _ = _fused_run(row, backend, 4, max_grad_norm=1.0, state_precision="bf16")
    first, opt = _fused_run(row, backend, 2, max_grad_norm=1.0, state_precision="bf16")
    params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = row.fused(params, backend=backend, max_grad_norm=1.0, state_precision="bf16", **row.hparams)
    resumed.load_state_dict(_saved(opt.state_dict()))
    for step in (2, 3):
        for p, g in zip(params, _grads(step, 30.0)):
            p.grad = g.float()
        resumed.step()
    for index, (a, b) in enumerate(zip(params, whole)):
        assert torch.equal(a, b), f"param {index}: the resumed run left the uninterrupted one"


@pytest.mark.parametrize("row", ROW_PARAMS)
def test_torch_state_dict_loads_into_the_reference_and_back(row: Row):
    """torch_state_dict() (fp32 states under the reference's keys) loads into the reference optimizer, which
    then steps as ours does; and the reference's state dict loads into the fused optimizer."""
    ours, opt = _fused_run(row, "torch", 2)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    reference = row.reference(ref_params, **row.hparams)
    reference.load_state_dict(_saved(opt.torch_state_dict()))
    back = row.fused([torch.nn.Parameter(p.detach().clone()) for p in ours], backend="torch", **row.hparams)
    back.load_state_dict(_saved(reference.state_dict()))
    back_params = [p for group in back.param_groups for p in group["params"]]
    for p, q, r in zip(ours, ref_params, back_params):
        for key in row.state_keys:
            assert torch.equal(reference.state[q][key], opt.state[p][key])
            assert torch.equal(back.state[r][key], opt.state[p][key])
    for optimizer, params in ((opt, ours), (reference, ref_params), (back, back_params)):
        for p, g in zip(params, _grads(7)):
            p.grad = g.float()
        optimizer.step()
    for a, b in zip(back_params, ref_params):  # a few fp32 ulps: the reference's own rounding against ours
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(ours, back_params):
        assert torch.equal(a, b), "the state loaded back steps as the original"


def test_lion_bf16_momentum_follows_the_grads():
    """Lion's momentum in bf16 is an EMA with beta2 = 0.99: each step moves it 1% of (g - m), under half a bf16 ulp
    once g is within ~20% of m, so rounding to nearest would stop it near 0.8 of a constant grad. Stochastic
    rounding keeps its mean on the exact EMA (1 - 0.99 ** 400 = 0.982 after 400 steps of grad 1.0)."""
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = FusedLion([p], lr=0.0, state_precision="bf16", backend="torch")
    for _ in range(400):
        p.grad = torch.ones(4096)
        opt.step()
    momentum = opt.state[p]["exp_avg"]
    assert momentum.dtype == torch.bfloat16
    exact = 1 - 0.99**400
    assert abs(float(momentum.float().mean()) - exact) < 0.01, float(momentum.float().mean())


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
@pytest.mark.parametrize("row", ROW_PARAMS)
def test_bf16_params_with_master_weights_follow_the_fp32_run(row: Row, backend: str):
    """master_weights=True on bf16 params: the fp32 masters are the fp32-param run's params bit for bit (grads and
    initial values representable in bf16 on both sides, so the arithmetic is the same), the params their rounding."""

    def run(dtype, **options):
        params = [torch.nn.Parameter(p.to(torch.bfloat16).to(dtype)) for p in _params()]
        opt = row.fused(params, backend=backend, max_grad_norm=1.0, **row.hparams, **options)
        for step in range(3):
            for p, g in zip(params, _grads(step, 30.0)):
                p.grad = g.to(torch.bfloat16).to(dtype)
            opt.step()
        return params, opt

    wide, _ = run(torch.float32)
    narrow, opt = run(torch.bfloat16, master_weights=True)
    for index, (a, b) in enumerate(zip(narrow, wide)):
        if not a.numel():
            continue
        master = opt.state[a]["master_param"]
        assert torch.equal(master, b), f"master of param {index}: {(master - b).abs().max():.3g} off"
        assert torch.equal(a, b.to(torch.bfloat16)), f"param {index} is not its master rounded"


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
@pytest.mark.parametrize("row", ROW_PARAMS)
def test_a_spike_is_skipped_like_a_non_finite_step(row: Row, backend: str):
    """spike_skip_threshold (after zscore_warmup steps of similar norms): a grad 100x larger is skipped whole."""
    params = [torch.nn.Parameter(p.float()) for p in _params()]
    options = dict(zscore_warmup=4, zscore_threshold=3.0, spike_skip_threshold=6.0)
    opt = row.fused(params, backend=backend, **row.hparams, **options)
    for step in range(6):
        for p, g in zip(params, _grads(step)):
            p.grad = g.float()
        opt.step()
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for p, g in zip(params, _grads(6, 100.0)):
        p.grad = g.float()
    opt.step()
    assert int(opt.spike_skips) == 1 and int(opt.skipped_steps) == 0
    for p, b, s in zip(params, before, states):
        assert torch.equal(p.detach(), b)
        assert all(torch.equal(opt.state[p][k], v) for k, v in s.items())
