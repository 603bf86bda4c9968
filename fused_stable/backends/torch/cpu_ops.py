"""The CPU step's compiled ops (cpu_step.cpp, with the rules' elements: rules/adamw/cpu.h, rules/lion/cpu.h): the
norm pass in one call over every grad, and an AdamW that reads the grads times the step's multiplier without
writing them back (32 bytes per fp32 parameter, clipped or not; torch's CPU `_fused_adamw_` writes the scaled
grads back: 36) and advances the `step` counters itself; AdamW with bf16 or 8-bit moments; Lion with fp32,
bf16 or 8-bit exp_avg (24 bytes per fp32 parameter with fp32 exp_avg).

Built on first use with torch's C++ extension builder (`torch.utils.cpp_extension.load`: a C++17 compiler and
ninja, the `ninja` package's binary when PATH has none; ~10-15 s on 2 cores, cached in torch's extensions folder,
`TORCH_EXTENSIONS_DIR`, under a name that changes with the source and the rules' headers, the flags, torch,
Python and the CPU), for this machine's CPU (`-march=native`: the update is memory-bound only when vectorised).
Where the build fails (no compiler) the torch backend runs torch's ops instead, with one warning that says so;
`FUSED_STABLE_CPU_OPS=0` skips the build (torch's ops always).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import warnings
from pathlib import Path

import torch

ENV = "FUSED_STABLE_CPU_OPS"
SOURCE = Path(__file__).with_name("cpu_step.cpp")
# the rules' folder, on the include path: the source includes "adamw/cpu.h" (a rule's element); every rule's
# header is in the build's name, so a change to one rebuilds
INCLUDE_DIR = Path(__file__).resolve().parents[2] / "rules"
HEADERS = sorted(INCLUDE_DIR.glob("*/*.h")) + [SOURCE.with_name("state_codes.h")]  # and the 8-bit codes' header
# IEEE fp32 without contraction (the kernels' arithmetic, docs/design.md), sqrt without errno (vectorisable),
# OpenMP for at::parallel_for (torch's own libgomp: the same soname, so one thread pool and torch's thread count)
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

log = logging.getLogger("fused_stable")


def build_fingerprint() -> str:
    """Everything the built library depends on, for its name (its folder in torch's extensions folder): the
    source, the rules' headers it includes (a header change must rebuild) and the flags, this CPU's instruction
    set (`-march=native`) and the Python / torch ABI. torch's builder keys its cache by name alone, so two
    checkouts with different sources (or two processes building them at once) would otherwise share one folder
    and load each other's library."""
    cpu_flags = ""
    try:
        with open("/proc/cpuinfo") as info:
            cpu_flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    key = "|".join(
        [
            SOURCE.read_text(),
            *(header.read_text() for header in HEADERS),
            *CFLAGS,
            *LDFLAGS,
            platform.machine(),
            cpu_flags,
            torch.__version__,
            platform.python_version(),
        ]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package's binary is not on it when the environment's
    scripts folder is not (a venv's python run without activating it): add it, in this process only."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:  # the build fails and says so (the warning below)
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def available() -> bool:
    """Whether the compiled ops are loaded (building them first if needed): False when `FUSED_STABLE_CPU_OPS=0`
    or when the build failed (warned once)."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    from torch.utils import cpp_extension

    put_ninja_on_path()
    name = f"fused_stable_cpu_{build_fingerprint()}"
    log.info("fused_stable: loading the compiled CPU step (%s; the first time it is built, ~10-15 s)", name)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_include_paths=[str(INCLUDE_DIR)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: torch's ops still do the step
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(
            f"fused_stable: the compiled CPU step could not be built ({type(exc).__name__}: {reason[:200]}); the "
            f"CPU step runs torch's ops instead (36 bytes per param when clipped, not 32). Install a C++ compiler "
            f"and ninja to build it, or set {ENV}=0 to skip the build.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def sum_squares(grads: list[torch.Tensor], out: torch.Tensor) -> float:
    """Per-tensor sums of squares of `grads` into `out` (fp32, one per grad; accumulated in fp64 in a fixed
    order, whatever the thread count), and their global sum (fp64) as the return value."""
    return torch.ops.fused_stable.sum_squares(grads, out)


def adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    masters: list[torch.Tensor] | None = None,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    grad_mul: float,
) -> None:
    """AdamW on contiguous fp32, bf16 or fp16 params (grads of their dtype) with fp32 moments, amsgrad when
    `max_exp_avg_sqs` is not empty, and fp32 master copies when `masters` are given (the master is updated, the
    param stores its rounding to nearest even): each grad read times `grad_mul` (never written), each `step`
    advanced by one before its bias corrections."""
    torch.ops.fused_stable.adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        masters or [],
        steps,
        lr,
        beta1,
        beta2,
        weight_decay,
        eps,
        maximize,
        grad_mul,
    )


def adamw_lowbit(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moments: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    scales: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    *,
    masters: list[torch.Tensor] | None,
    scalars: torch.Tensor,
    keys: torch.Tensor,
    state_format: int,
) -> None:
    """AdamW with bf16 (`state_format` = state_format.BF16) or 8-bit (Q8) moments on contiguous CPU tensors, as
    the exact reference computes it (exact_reference.py): `moments` are (exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
    the last empty without amsgrad), `scales` their 8-bit per-block scales (empty lists in bf16), `scalars` the
    rule's step scalars per tensor ([n, 8] fp32, rules/adamw/torch.py's `step_scalars` in its order) and `keys`
    each tensor's stochastic-rounding key for this step ([n] int64, state_format.random_key). The `step`
    counters are the caller's (already advanced); the grads are read, never written."""
    torch.ops.fused_stable.adamw_lowbit(params, grads, *moments, *scales, masters or [], scalars, keys, state_format)


def lion(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    *,
    masters: list[torch.Tensor] | None,
    scalars: torch.Tensor,
    state_format: int = 0,
    exp_avg_scales: list[torch.Tensor] | None = None,
    keys: torch.Tensor | None = None,
) -> None:
    """Lion (rules/lion/cpu.h) on contiguous fp32, bf16 or fp16 params (grads of their dtype) with `exp_avgs` in
    `state_format` (state_format.FP32, BF16 or Q8 with its per-block `exp_avg_scales`) and, when `masters` are
    given, fp32 master copies (the master is updated, the param stores its rounding to nearest even): `scalars`
    are rules/lion/torch.py's `step_scalars` (7 fp32 values in its order, the grad multiplier first) and `keys`
    each tensor's stochastic-rounding key for bf16 exp_avg ([n] int64, state_format.random_key), so the result is
    the exact reference's bit for bit; the grads are read, never written."""
    if keys is None:
        keys = torch.zeros(len(params), dtype=torch.int64)
    torch.ops.fused_stable.lion(
        params, grads, exp_avgs, exp_avg_scales or [], masters or [], scalars, keys, state_format
    )
