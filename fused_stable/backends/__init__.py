"""The backends of the fused step, one module each, registered in fused_stable.ops.BACKENDS:
  - triton_backend: the Triton kernels (fused_stable.kernels), compiled on CUDA or interpreted on CPU;
  - torch/ (torch_backend): torch's multi-tensor ops and the compiled CPU ops, for CPU tensors.
Each is a module that implements `Backend`: it takes a StepPlan (fused_stable.plan) and this step's grads, keeps
its device side of the plan in `plan.backend_cache`, and never reads a device value on the host (the torch
backend's CPU step reads CPU tensors, which are host memory: host_decide.HOST_READERS).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..layout import StepBuffers, StepPolicy
    from ..plan import StepPlan

# maps the local per-tensor sums of squares (and the params they belong to) to the global one: sharded params
GlobalSumsq = Callable[["torch.Tensor", list], "torch.Tensor"]


@runtime_checkable
class Backend(Protocol):
    """What fused_stable.ops and fused_stable.compiled call on a backend module."""

    # whether the backend walks memory linearly (the kernels), so grads must be dense with their params' strides
    DENSE_LAYOUTS: bool

    def compiled_cpu_ops(self) -> bool:
        """Whether this backend's steps run the compiled CPU ops (the torch backend, built): a matrix rule with its
        own op (rules/<rule>/cpu_matrix.cpp: its build's `compiled_ops`) takes it then."""
        ...

    def fused_step(
        self,
        plan: StepPlan,
        grads: list[torch.Tensor],
        buffers: StepBuffers,
        policy: StepPolicy,
        hparams: list[tuple],
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        global_sumsq: GlobalSumsq | None,
    ) -> None:
        """Global norm, clip coefficient, skip decision, schedule and AdamW for every tensor of `plan`.

        `grads` are this step's grads in plan order (`StepPlan.current_grads`), `hparams` one row per param group.
        `grad_scale` (a loss scale to divide the grads by) and `found_inf` (a flag from a GradScaler) are device
        tensors; `global_sumsq` maps the local per-tensor sums of squares to the global one (sharded params).
        """
        ...
