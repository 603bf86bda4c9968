"""Shared test helpers: backends to run, tolerances, a reporting assert_close, reference optimizers."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

HAS_CUDA = torch.cuda.is_available()

# every CPU test of the step runs on both the torch path and the Triton kernels (interpreted)
CPU_BACKENDS = ["torch", "interpret"]

# dtype -> (rtol, atol) for a low-precision param compared with an fp64 reference that rounds the same way
TOLERANCES = {
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (2e-3, 1e-6),
}


def describe_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, what: str = "") -> None:
    """allclose that says how many elements differ, the worst one and where, and NaN/inf mismatches apart."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    nan_mismatch = (a.isnan() != e.isnan()).sum().item()
    inf_mismatch = ((a.isinf() != e.isinf()) | (a.isinf() & e.isinf() & (a.sign() != e.sign()))).sum().item()
    assert nan_mismatch == 0 and inf_mismatch == 0, f"{what}: {nan_mismatch} NaN and {inf_mismatch} inf mismatches"
    finite = a.isfinite() & e.isfinite()
    diff = (a - e).abs().where(finite, torch.zeros_like(a))
    bad = diff > atol + rtol * e.abs()
    if bad.any():
        flat = (diff - rtol * e.abs()).flatten()
        worst = int(flat.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.numel()} elements differ beyond rtol={rtol}, atol={atol}; worst at "
            f"{index}: {a.flatten()[worst].item()!r} vs {e.flatten()[worst].item()!r} (|diff| {diff.flatten()[worst].item():.3e})"
        )


def interpret_available() -> bool:
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)


def backend_param(backend: str):
    marks = []
    if backend == "interpret":
        marks.append(pytest.mark.skipif(not interpret_available(), reason="TRITON_INTERPRET=1 was not set before triton import"))
    return pytest.param(backend, marks=marks, id=backend)


BACKEND_PARAMS = [backend_param(b) for b in CPU_BACKENDS]


def reference_adamw_fp64(params, grads_per_step, *, lr, betas, eps, weight_decay, max_norm, round_to=None):
    """AdamW + global-norm clipping in float64 from the same grads; params rounded to `round_to` after each
    step when given (what storing a low-precision param does). Returns (params, exp_avgs, exp_avg_sqs)."""
    p = [x.detach().double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    beta1, beta2 = betas
    for step, grads in enumerate(grads_per_step, start=1):
        g = [x.double() for x in grads]
        total = torch.sqrt(sum((x * x).sum() for x in g))
        coef = min(1.0, max_norm / (total.item() + 1e-6)) if max_norm else 1.0
        for i in range(len(p)):
            gi = g[i] * coef
            p[i] = p[i] * (1 - lr * weight_decay)
            m[i] = beta1 * m[i] + (1 - beta1) * gi
            v[i] = beta2 * v[i] + (1 - beta2) * gi * gi
            denom = (v[i] / (1 - beta2**step)).sqrt() + eps
            p[i] = p[i] - lr / (1 - beta1**step) * m[i] / denom
            if round_to is not None:
                p[i] = p[i].to(round_to).double()
    return p, m, v


SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}


class ForbidHostReads(TorchFunctionMode):
    """Raises on any tensor -> host read (`.item()`, `bool(t)`, `.cpu()`, ...) made outside Triton's interpreter
    (which moves data to the host by design). Used around step() to prove it never syncs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS and not _called_from_interpreter():
            raise AssertionError(f"host read {name}() inside step()")
        return func(*args, **(kwargs or {}))


def _called_from_interpreter() -> bool:
    import inspect

    marker = os.path.join("triton", "runtime")
    return any(marker in frame.filename for frame in inspect.stack(context=0))


@contextlib.contextmanager
def no_host_reads():
    with ForbidHostReads():
        yield


class CountDeviceOps(TorchDispatchMode):
    """Records every aten op dispatched while active (each one a kernel launch on a GPU): `ops` holds their
    names, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
