"""`clip_grad_norm_`: a drop-in for torch.nn.utils.clip_grad_norm_ that uses the fused kernels on CUDA.

Same arguments, same return value (the total norm, before clipping, as a tensor in torch's dtype), same
clipped grads. The L2 case on CUDA (or under the interpreter backend) runs one multi-tensor norm launch and one
multi-tensor scale launch per dtype, with torch's arithmetic for the norms and the coefficient on a few device
scalars (backends/triton_backend.py, clip_grad_norm); everything else defers to torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import ops
from .plan import is_dense


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads or float(norm_type) != 2.0 or not _fusable(grads):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    backend = ops.resolve_backend(None, grads[0].device)
    if backend == "torch":
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    return ops.total_norm_and_scale_(grads, float(max_norm), backend, error_if_nonfinite)


def _fusable(grads: list[torch.Tensor]) -> bool:
    first = grads[0].device
    return all(
        type(g) is torch.Tensor
        and not g.is_sparse
        and g.device == first
        and g.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and is_dense(g)  # the kernels walk memory linearly; torch's clip takes any layout
        for g in grads
    )
