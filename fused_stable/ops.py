"""The backends: which one runs the fused step (and clip_grad_norm_), the one registry of them, the call into it.

Data flow of a step: optimizer (optim.py) -> plan (plan.py) -> backend (backends/) -> kernels (kernels/).
Backends, one semantics:
  - "triton": the Triton kernels, for CUDA tensors (the default there);
  - "interpret": the same kernels run on CPU tensors by Triton's interpreter, which is how they are tested
    without a GPU; it needs TRITON_INTERPRET=1 before triton is first imported (FUSED_STABLE_BACKEND=interpret
    in the environment arranges that when fused_stable is imported first);
  - "torch": for CPU tensors (the default there): two compiled CPU ops (backends/torch/cpu_ops.py: one norm call, an
    AdamW that reads the clipped grads without writing them) around decisions on host scalars, or torch's own
    multi-tensor ops where the ops cannot be built (`_foreach_norm`, `_fused_adamw_`; with device `grad_scale`
    and `found_inf` on meta or CUDA tensors).
No backend reads a device value on the host (the torch backend reads CPU tensors, whose values are on the
host already: host_decide.HOST_READERS). `BACKENDS` is the one registry of them: every entry point (this
module's functions, compiled.py's custom op) picks a backend module from it and nowhere else.
"""

from __future__ import annotations

import os

import torch

from .backends import Backend, GlobalSumsq, triton_backend  # no triton until a kernel is launched
from .backends.torch import torch_backend
from .layout import StepBuffers, StepPolicy
from .plan import StepPlan

# backend name -> the module that runs it ("interpret" is the Triton backend on kernels Triton interprets)
BACKENDS: dict[str, Backend] = {"triton": triton_backend, "interpret": triton_backend, "torch": torch_backend}
ENV_BACKEND = "FUSED_STABLE_BACKEND"


def resolve_backend(requested: str | None, device: torch.device) -> str:
    """The backend for tensors on `device`: an explicit request, else $FUSED_STABLE_BACKEND, else by device."""
    choice = requested or os.environ.get(ENV_BACKEND) or "auto"
    choice = choice.lower()
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"unknown fused_stable backend {choice!r}: use one of auto, {', '.join(BACKENDS)}")
    if choice == "triton" and device.type != "cuda":
        raise ValueError(
            f"backend 'triton' needs CUDA tensors, got {device.type}: use backend 'torch', or 'interpret' to run "
            "the Triton kernels on CPU through Triton's interpreter"
        )
    if choice == "interpret":
        if device.type != "cpu":
            raise ValueError(f"backend 'interpret' runs on CPU tensors only, got {device.type}")
        _require_interpreter()
    return choice


def _require_interpreter() -> None:
    from triton import knobs

    if not knobs.runtime.interpret or not _triton_imported_interpreted():
        raise RuntimeError(
            "backend 'interpret' needs Triton's interpreter, which must be switched on before triton is first "
            f"imported (here it was not): start Python with TRITON_INTERPRET=1 in the environment, or with "
            f"{ENV_BACKEND}=interpret and `import fused_stable` before anything imports triton"
        )


def _triton_imported_interpreted() -> bool:
    """Whether triton's own jit functions were made for the interpreter: TRITON_INTERPRET set after triton was
    imported turns the switch on for new kernels only, and they fail inside step() on triton's old ones."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    made_by_jit = getattr(standard, "_elementwise_max", None)  # any of triton's own @triton.jit helpers
    return made_by_jit is None or isinstance(made_by_jit, InterpretedFunction)


def compiled_cpu_ops(backend: str) -> bool:
    """Whether the backend's steps run the compiled CPU ops: a matrix rule's own op is used then (matrix_step.py)."""
    return BACKENDS[backend].compiled_cpu_ops()


def needs_dense_layouts(backend: str) -> bool:
    """Whether the backend walks memory linearly (the kernels), so grads must be dense with the params' strides."""
    return BACKENDS[backend].DENSE_LAYOUTS


def fused_step(
    backend: str,
    plan: StepPlan,
    grads: list[torch.Tensor],
    buffers: StepBuffers,
    policy: StepPolicy,
    hparams: list[tuple],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    global_sumsq: GlobalSumsq | None = None,
) -> None:
    """One fused step on the named backend: `Backend.fused_step` (fused_stable/backends) says what it takes."""
    BACKENDS[backend].fused_step(plan, grads, buffers, policy, hparams, grad_scale, found_inf, global_sumsq)


def total_norm_and_scale_(
    grads: list[torch.Tensor], max_norm: float, backend: str, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s L2 case on the kernels (`backend` "triton" or "interpret"): returns the
    total norm, in the dtype torch's would have."""
    if backend == "torch":
        raise ValueError("total_norm_and_scale_ runs the Triton kernels; the torch backend clips with torch's own")
    return triton_backend.clip_grad_norm(grads, max_norm, error_if_nonfinite)
