"""Shared test helpers: backends to run, tolerances, a reporting assert_close, reference optimizers."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HAS_CUDA = torch.cuda.is_available()

# every CPU test of the step runs on the torch path (with the compiled CPU ops of backends/torch/cpu_ops.py, the
# default, and with torch's ops alone, what a machine that cannot build them runs) and the Triton kernels
# (interpreted); "torch-ops" is the backend "torch" in a test marked `torch_ops` (see backend_param)
CPU_BACKENDS = ["torch", "torch-ops", "interpret"]

# dtype -> (rtol, atol) for a low-precision param compared with an fp64 reference that rounds the same way.
# bf16/fp16: one ulp (rtol = the dtype's eps bounds one ulp anywhere in a binade, atol 0 so tiny values get no
# more): the update is computed in fp32 and rounded once, so it equals the rounded fp64 value unless the exact
# value lies within fp32 error of a rounding tie. Measured over 6 steps x 1065 elements: 0 ulps for bf16; for
# fp16 0 ulps on seed 3 and 1 ulp on one element for seed 2. Count the elements off with `ulp_distance`.
TOLERANCES = {
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (torch.finfo(torch.bfloat16).eps, 0.0),
    torch.float16: (torch.finfo(torch.float16).eps, 0.0),
}


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element, how many representable `dtype` values apart the two are (both rounded to `dtype`)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    sign_bit = torch.iinfo(bits).min

    def ordered(t):  # sign-magnitude bit patterns -> integers in the order of the values (+0 == -0)
        i = t.detach().to(dtype).contiguous().view(bits).long()
        return torch.where(i < 0, -(i - sign_bit), i)

    return (ordered(actual) - ordered(expected)).abs()


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
            f"{index}: {a.flatten()[worst].item()!r} vs {e.flatten()[worst].item()!r} "
            f"(|diff| {diff.flatten()[worst].item():.3e})"
        )


def assert_update_close(before, after, ref_before, ref_after, rtol: float, what: str = "") -> None:
    """Compare one optimizer step's update (after - before) with a reference step's, relative to the update
    itself: a parameter-level tolerance hides an update error far smaller than the parameter (a 1e-5 error in
    an lr-sized step next to an O(1) weight). Each element may differ by the rounding of storing its parameter
    (an ulp at the larger of its values before and after, for each side), plus `rtol` of the reference update."""
    b, a = before.detach().double(), after.detach().double()
    rb, ra = ref_before.detach().double(), ref_after.detach().double()
    ulp = float(torch.finfo(after.dtype).eps)
    storing = ulp * (torch.maximum(b.abs(), a.abs()) + torch.maximum(rb.abs(), ra.abs()))
    update, ref_update = a - b, ra - rb
    excess = ((update - ref_update).abs() - storing).clamp(min=0.0)
    bad = excess > rtol * ref_update.abs()
    if bad.any():
        worst = int((excess / ref_update.abs().clamp(min=1e-30)).flatten().argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{update.numel()} updates differ beyond rtol={rtol} (after the storing "
            f"rounding); worst at flat index {worst}: {update.flatten()[worst].item()!r} vs "
            f"{ref_update.flatten()[worst].item()!r}"
        )


def interpret_available() -> bool:
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)


def backend_param(backend: str):
    marks = []
    if backend == "torch-ops":  # the torch backend without its compiled CPU ops (tests/conftest.py switches them off)
        return pytest.param("torch", marks=[pytest.mark.torch_ops], id=backend)
    if backend == "interpret":
        marks.append(
            pytest.mark.skipif(not interpret_available(), reason="TRITON_INTERPRET=1 was not set before triton import")
        )
    return pytest.param(backend, marks=marks, id=backend)


BACKEND_PARAMS = [backend_param(b) for b in CPU_BACKENDS]
# the torch backend with its 0-dim tensor decisions and torch's ops (the path of meta tensors and of CUDA tensors
# given this backend) on CPU tensors, which otherwise decide on host scalars and update with the compiled ops: for
# the tests that pin a decision's edge (a threshold met exactly, the clip's epsilon), which random agreement runs
# do not reach, and for the update's own skip (`found_inf`), which the host path never calls
# (tests/conftest.py switches both off for the marked test)
WITH_TENSOR_DECISIONS = [
    *BACKEND_PARAMS,
    pytest.param("torch", id="torch-tensor", marks=[pytest.mark.tensor_decisions, pytest.mark.torch_ops]),
]


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


# Python-level calls that hand a tensor's value to the host. On a GPU each one waits for the device (a host
# sync); on CPU they are as observable, so a CPU test can prove that a step or a loop makes none of them.
SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}
HOST_READ_FUNCTIONS = SYNC_METHODS | {
    "__complex__",
    "__array__",
    "__format__",
    "__repr__",
    "__str__",
    "__contains__",
    "equal",
    "allclose",
    "is_nonzero",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
}
# aten ops that read device values on the host (a scalar, or a data-dependent output size): what the Python
# calls above become, and what C++ code (or a composite op) calls without passing through Python
HOST_READ_OPS = {
    "_local_scalar_dense",
    "equal",
    "allclose",
    "is_nonzero",
    "nonzero",
    "argwhere",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "bincount",
}


def _host_read_op(func, args, kwargs) -> str | None:
    """The name of an aten op if it reads device values on the host, else None."""
    name = func.overloadpacket.__name__
    if name in HOST_READ_OPS:
        return name
    if name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
        return "repeat_interleave (no output_size)"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return f"{name} with a boolean mask (nonzero)"
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dst_device = args[0].device if name == "copy_" else kwargs.get("device")
        if (
            isinstance(src, torch.Tensor)
            and src.device.type != "cpu"
            and dst_device is not None
            and torch.device(dst_device).type == "cpu"
        ):
            return f"{name} to the host"
    return None


def _called_from_interpreter() -> bool:
    """Triton's interpreter moves kernel arguments to the host by design: its reads are not the step's."""
    import sys

    marker = os.path.join("triton", "runtime")
    frame = sys._getframe(1)
    while frame is not None:
        if marker in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _called_from_cpu_host_decisions() -> bool:
    """The torch backend's CPU step reads its decisions' inputs on the host by design (a CPU tensor's value is on
    the host: no device queue to wait for, so no sync on any device): only in its `HOST_READERS` functions."""
    import sys

    from fused_stable.backends.torch import host_decide, torch_backend

    files = {torch_backend.__file__, host_decide.__file__}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in host_decide.HOST_READERS and frame.f_code.co_filename in files:
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    """file:line of the innermost frame outside torch and this file: where the read was written."""
    import sys

    torch_dir = os.path.dirname(torch.__file__) + os.sep  # torch's own package, not fused_stable/backends/torch/
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != __file__ and not filename.startswith(torch_dir):
            return f"{os.path.relpath(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostReads:
    """Counts every tensor -> host read made while it is active, at two levels: a TorchFunctionMode sees the
    Python calls (`.item()`, `bool(t)`, `.tolist()`, `torch.equal`, ...) and a TorchDispatchMode sees the aten
    ops under them, including those that C++ code or composite ops make (`_local_scalar_dense`, `nonzero`,
    boolean-mask indexing, ...). A read seen at the Python level is counted once, not again at the aten level.
    Reads made by Triton's interpreter are not counted, nor (unless `cpu_host_decisions=True`) those of the torch
    backend's CPU host decisions (host_decide.HOST_READERS: CPU tensors, no device to wait for). `reads` lists
    (name, where) in order; `pause()` suspends counting for host-side work that is no device read on a GPU
    either (collating a batch from Python lists). With `forbid=True` the first read raises AssertionError."""

    def __init__(self, forbid: bool = False, what: str = "step()", cpu_host_decisions: bool = False):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        self.forbid, self.what = forbid, what
        self.cpu_host_decisions = cpu_host_decisions
        self.reads: list[tuple[str, str]] = []
        self._inside_counted = 0
        self._paused = 0
        self._calls: list[str] = []  # the Python-level torch calls in progress, innermost last
        counter = self

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                kwargs = kwargs or {}
                counted = name in HOST_READ_FUNCTIONS and counter._record(name)
                if counted:
                    counter._inside_counted += 1
                counter._calls.append(name)
                try:
                    return func(*args, **kwargs)
                finally:
                    counter._calls.pop()
                    if counted:
                        counter._inside_counted -= 1

        class _Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if not counter._inside_counted:
                    name = _host_read_op(func, args, kwargs)
                    if name is not None and not counter._cpu_foreach_scalar(name, args):
                        counter._record("aten." + name)
                return func(*args, **kwargs)

        self._modes = (_Functions(), _Ops())

    def _cpu_foreach_scalar(self, name: str, args) -> bool:
        """`torch._foreach_add_(tensors, t)` with a 0-dim CPU tensor t: torch's CPU kernel for the Tensor
        overload is `t.item()` then the Scalar overload. On CPU, t lives on the host (there is no device to
        wait for), and CUDA has its own kernel that reads t on the device: not a host sync anywhere."""
        return (
            name == "_local_scalar_dense"
            and bool(self._calls)
            and self._calls[-1].startswith("_foreach_")
            and args[0].device.type == "cpu"
        )

    def _record(self, name: str) -> bool:
        if self._paused or _called_from_interpreter():
            return False
        if not self.cpu_host_decisions and _called_from_cpu_host_decisions():
            return False
        where = _caller()
        if self.forbid:
            raise AssertionError(f"host read {name}() inside {self.what} at {where}")
        self.reads.append((name, where))
        return True

    @property
    def count(self) -> int:
        return len(self.reads)

    @contextlib.contextmanager
    def pause(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self):
        functions, ops = self._modes
        ops.__enter__()
        functions.__enter__()
        return self

    def __exit__(self, *exc):
        functions, ops = self._modes
        functions.__exit__(*exc)
        ops.__exit__(*exc)
        return False


class ForbidHostReads(HostReads):
    """Raises on the first tensor -> host read (see HostReads). Used around step() to prove it never syncs."""

    def __init__(self, what: str = "step()"):
        super().__init__(forbid=True, what=what)


@contextlib.contextmanager
def no_host_reads(what: str = "step()"):
    with ForbidHostReads(what):
        yield


@contextlib.contextmanager
def count_host_reads(cpu_host_decisions: bool = False):
    """`with count_host_reads() as reads:` ... then `reads.count` / `reads.reads` (HostReads says what counts)."""
    with HostReads(cpu_host_decisions=cpu_host_decisions) as counter:
        yield counter


class CountDeviceOps(TorchDispatchMode):
    """Records every aten op dispatched while active (each one a kernel launch on a GPU): `ops` holds their
    names, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def copy_kwargs(kwargs: dict) -> dict:
    """Tensor hyper-parameters cloned: each optimizer gets its own (torch may keep and read them later)."""
    copy = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {k: tuple(map(copy, v)) if isinstance(v, tuple) else copy(v) for k, v in kwargs.items()}


# gloo's worker threads and transport loop, and the TCP store's loop (rank 0): they stop when the group is freed
GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def group_threads(wait: float = 2.0) -> list[str]:
    """The names (Linux /proc) of this process's threads that belong to a process group: none once the group
    is freed. A group held past destroy_process_group keeps them into interpreter shutdown, where a worker
    releasing a finished collective's tensors aborts the process (issue 52's SIGABRT at exit). Polled for up to
    `wait` seconds: a joined thread's /proc entry can outlast pthread_join by a moment (the kernel wakes the
    joiner before it removes the task), while a held group's threads stay for good."""
    deadline = time.monotonic() + wait
    while True:
        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    names.append(f.read().strip())
            except FileNotFoundError:  # the thread ended while we listed
                continue
        left = sorted(name for name in names if name in GROUP_THREADS)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def count_symmetric_products(monkeypatch=None) -> list:
    """A list that grows by one on each later call, in this process, of newton_schulz.symmetric_product (Muon's Gram
    products by row blocks, which orthogonalize_stack looks up in its module at each call) on a stack of matrices:
    a rank that owns none of a batch runs Newton-Schulz on an empty stack (matrix_exchange.py), not counted. With
    pytest's `monkeypatch` the patch is undone after the test; without (spawned ranks) it stays."""
    from fused_stable.rules.muon import newton_schulz

    calls: list = []
    by_blocks = newton_schulz.symmetric_product

    def counted(x, *args, **kwargs):
        if x.size(0):
            calls.append(1)
        return by_blocks(x, *args, **kwargs)

    if monkeypatch is not None:
        monkeypatch.setattr(newton_schulz, "symmetric_product", counted)
    else:
        newton_schulz.symmetric_product = counted
    return calls
