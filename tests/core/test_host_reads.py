"""No host reads: the guard in helpers.py sees every primitive that hands a tensor's value to the host, and a
real optimizer step (both CPU backends, every option that adds device-side decisions) makes none of them.
The trainer's loop is checked in tests/train/test_loop_host_reads.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BACKEND_PARAMS, count_host_reads, no_host_reads

from fused_stable import FusedAdamW, GradScaler, schedules
from fused_stable.guard import Guard

X = torch.linspace(-1.0, 1.0, 5)

# every way of reading a tensor on the host that the guard must count (each exactly once)
HOST_READS = {
    "item": lambda: X[0].item(),
    "tolist": lambda: X.tolist(),
    "bool": lambda: bool(X[0] > 0),
    "if tensor": lambda: 1 if X.sum() else 0,
    "float": lambda: float(X[0]),
    "int": lambda: int(X[0]),
    "index": lambda: [1, 2, 3][torch.tensor(1)],
    "equal": lambda: torch.equal(X, X),
    "allclose": lambda: torch.allclose(X, X),
    "is_nonzero": lambda: torch.is_nonzero(X[:1]),
    "nonzero": lambda: X.nonzero(),
    "where(cond)": lambda: torch.where(X > 0),
    "boolean mask": lambda: X[X > 0],
    "boolean mask assignment": lambda: X.clone().__setitem__(X > 0, 0.0),
    "masked_select": lambda: X.masked_select(X > 0),
    "unique": lambda: X.unique(),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "cpu": lambda: X.cpu(),
    "numpy": lambda: X.numpy(),
    "np.asarray": lambda: np.asarray(X),
    "format": lambda: f"{X[0]:.2f}",
    "python max": lambda: max(X[0], X[1]),
}

# device-only look-alikes: must not count
DEVICE_ONLY = {
    "nonzero_static": lambda: torch.nonzero_static(X, size=5),
    "where(cond, a, b)": lambda: torch.where(X > 0, X, 0.0),
    "masked_fill": lambda: X.masked_fill(X > 0, 0.0),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(torch.tensor([1, 2]), output_size=3),
    "stack and shape": lambda: torch.stack([X, X]).shape[0] + X.numel(),
    "foreach with a tensor scalar": lambda: torch._foreach_add_([X.clone()], torch.tensor(1.0)),
}


@pytest.mark.parametrize("read", HOST_READS.values(), ids=HOST_READS.keys())
def test_the_guard_counts_each_host_read_once(read):
    with count_host_reads() as reads:
        read()
    assert reads.count == 1, reads.reads
    with pytest.raises(AssertionError, match="host read"):
        with no_host_reads():
            read()


@pytest.mark.parametrize("work", DEVICE_ONLY.values(), ids=DEVICE_ONLY.keys())
def test_the_guard_ignores_device_only_work(work):
    with count_host_reads() as reads:
        work()
    assert reads.count == 0, reads.reads


def test_pause_suspends_counting():
    with count_host_reads() as reads:
        with reads.pause():
            X.tolist()
        X.tolist()
    assert reads.count == 1


def _params():
    gen = torch.Generator().manual_seed(0)
    shapes_dtypes = [
        ((33,), torch.float32),
        ((4, 70), torch.float32),
        ((129,), torch.bfloat16),
        ((5, 3), torch.bfloat16),
    ]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in shapes_dtypes]


def _targets(params, seed, poison=False):
    """Per-param directions for a loss sum(<p, target>): its gradient is exactly the target (times the scale)."""
    gen = torch.Generator().manual_seed(seed)
    targets = [torch.randn(p.shape, generator=gen) for p in params]
    if poison:
        targets[1][2, 5] = float("nan")
    return targets


def _fill(params, seed):
    for p, t in zip(params, _targets(params, seed)):
        p.grad = t.to(p.dtype)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_every_step_option_together_makes_no_host_read(backend):
    """Mixed dtypes with master weights, two param groups, fixed + z-score clipping, spike skipping, a device
    schedule, fused_stable's GradScaler, a non-finite step, the guard's per-step bookkeeping: zero reads."""
    params = _params()
    opt = FusedAdamW(
        [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.1,
        max_grad_norm=1.0,
        clip="zscore",
        zscore_warmup=2,
        spike_skip_threshold=20.0,
        master_weights=True,
        lr_schedule=schedules.warmup_cosine(10, 2),
        backend=backend,
    )
    guard = Guard()
    guard.bind(opt)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    for step in range(1, 6):
        targets = _targets(params, step, poison=step == 4)
        with count_host_reads() as reads:
            loss = sum((p.float() * t).sum() for p, t in zip(params, targets))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            opt.per_tensor_grad_norms()
        assert reads.count == 0, f"step {step}: {reads.reads}"
    assert opt.skipped_steps.item() == 1 and opt.applied_steps.item() == 4
    assert scaler.get_scale() == 2.0**7  # the NaN step backed the scale off, on the device


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_plain_step_makes_no_host_read_and_the_count_is_not_vacuous(backend):
    params = _params()[:2]
    opt = FusedAdamW(params, lr=1e-2, max_grad_norm=1.0, backend=backend)
    _fill(params, 0)
    with count_host_reads() as reads:
        opt.step()
        assert reads.count == 0, reads.reads
        opt.grad_norm.item()  # what a logging step does: the guard sees it
    assert [name for name, _ in reads.reads] == ["item"]
