"""The one backend switch: which backend runs the fused step (and clip_grad_norm_), and the call into it.

Data flow of a step: optimizer (optim.py) -> plan (plan.py) -> backend (backends/) -> kernels (kernels/).
Backends, one semantics:
  - "triton": the Triton kernels, for CUDA tensors (the default there);
  - "interpret": the same kernels run on CPU tensors by Triton's interpreter, which is how they are tested
    without a GPU; it needs TRITON_INTERPRET=1 before triton is first imported (FUSED_STABLE_BACKEND=interpret
    in the environment arranges that when fused_stable is imported first);
  - "torch": torch's own multi-tensor ops (`_foreach_norm`, `_fused_adamw_` with device `grad_scale` and
    `found_inf`), for CPU tensors (the default there).
No backend reads a device value on the host. This module is the only place that picks one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .backends import torch_backend, triton_backend  # neither imports triton until a kernel is launched
from .layout import StepBuffers, StepRules
from .plan import StepPlan

BACKENDS = ("triton", "interpret", "torch")
ENV_BACKEND = "FUSED_STABLE_BACKEND"

GlobalSumsq = Callable[[torch.Tensor, list], torch.Tensor]


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


def needs_dense_layouts(backend: str) -> bool:
    """Whether the backend walks memory linearly (the kernels), so grads must be dense with the params' strides."""
    return backend != "torch"


def fused_step(
    backend: str,
    plan: StepPlan,
    grads: list[torch.Tensor],
    buffers: StepBuffers,
    rules: StepRules,
    hparams: list[tuple],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    global_sumsq: GlobalSumsq | None = None,
) -> None:
    """Global norm, clip coefficient, skip decision, schedule and AdamW for every tensor of `plan`.

    `grads` are this step's grads in plan order (`StepPlan.current_grads`); `hparams` one row per param group,
    (lr: float | Tensor, beta1, beta2, eps, weight_decay). `grad_scale` (a loss scale to divide the grads by) and
    `found_inf` (a flag from a GradScaler) are device tensors; `global_sumsq` maps the local per-tensor sums of
    squares to the global one (sharded params).
    """
    chosen = torch_backend if backend == "torch" else triton_backend
    chosen.fused_step(plan, grads, buffers, rules, hparams, grad_scale, found_inf, global_sumsq)


def total_norm_and_scale_(
    grads: list[torch.Tensor], max_norm: float, backend: str, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s L2 case on the kernels (`backend` "triton" or "interpret"): returns the
    total norm, in the dtype torch's would have."""
    if backend == "torch":
        raise ValueError("total_norm_and_scale_ runs the Triton kernels; the torch backend clips with torch's own")
    return triton_backend.clip_grad_norm(grads, max_norm, error_if_nonfinite)
