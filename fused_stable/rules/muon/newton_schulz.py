"""Newton-Schulz orthogonalisation batched over matrices of one shape, equal bit for bit to torch.optim.Muon's
`_zeropower_via_newtonschulz` applied to each matrix (checked on CPU at 1 and 2 threads, tests/core/test_muon_parts.py).

Per shape, the matrices are stacked once and cast to bf16 (torch computes in bf16 too); a tall stack is used as
its `.mT`, so each matrix has the strides of torch's `.T` and the smaller side is the Gram side. Then, as torch
per matrix: divide by the Frobenius norm clamped at eps, and `ns_steps` times A = X X^T, B = b A + c A A,
X = a X + B X, as `bmm` / `baddbmm` (the batched `@` / `addmm`). The result stays bf16, as torch returns it:
the caller's add upcasts it exactly, and a cast here would cost a pass and round nothing away.

`ShapeBatches` is the grouping by shape, computed once from the shapes, so a step only stacks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class ShapeBatches:
    """Indices of a list of 2-D shapes, grouped by shape in order of first appearance; a group longer than
    `max_matrices` (when given) is cut into batches of at most that many, to bound the stacks' memory."""

    def __init__(self, shapes: Sequence[Sequence[int]], max_matrices: int | None = None):
        if max_matrices is not None and max_matrices < 1:
            raise ValueError(f"max_matrices must be at least 1, got {max_matrices}")
        by_shape: dict[tuple[int, int], list[int]] = {}
        for index, shape in enumerate(shapes):
            if len(shape) != 2:
                raise ValueError(f"Newton-Schulz orthogonalises 2-D matrices; item {index} has shape {tuple(shape)}")
            by_shape.setdefault((int(shape[0]), int(shape[1])), []).append(index)
        size = max_matrices or max((len(indices) for indices in by_shape.values()), default=1)
        self.count = len(shapes)
        self.batches: tuple[tuple[tuple[int, int], tuple[int, ...]], ...] = tuple(
            (shape, tuple(indices[start : start + size]))
            for shape, indices in by_shape.items()
            for start in range(0, len(indices), size)
        )

    def __repr__(self) -> str:
        return f"ShapeBatches({[(shape, len(indices)) for shape, indices in self.batches]})"


def newton_schulz_work(shape: Sequence[int]) -> int:
    """The relative cost of orthogonalising one (A, B) matrix: its products cost elements x the smaller side (the
    Gram side), what owner ranks are balanced by under FSDP2 and DeepSpeed."""
    return int(shape[0]) * int(shape[1]) * min(int(shape[0]), int(shape[1]))


def orthogonalize_stack(
    stack: Tensor, coefficients: Sequence[float], ns_steps: int, eps: float, *, overwrite: bool = False
) -> Tensor:
    """The Newton-Schulz iteration on a stack (n, A, B) of same-shape matrices, any float dtype; returns bf16
    (n, A, B) (for a tall stack, A > B, the `.mT` view of a contiguous (n, B, A) result, as torch's `.T`).
    `overwrite=True` lets a bf16 stack that is the caller's temporary be divided in place."""
    if stack.ndim != 3:
        raise ValueError(f"orthogonalize_stack takes a stack (n, A, B), got shape {tuple(stack.shape)}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be from 0 to 99 (torch's bound), got {ns_steps}")
    a, b, c = coefficients
    tall = stack.size(1) > stack.size(2)
    x = stack.bfloat16()
    if x is stack and not overwrite:
        x = x.clone()  # the division below is in place (torch's `.bfloat16()` of a bf16 grad divides the grad)
    if tall:
        x = x.mT
    x.div_(torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps))
    for _ in range(ns_steps):
        gram = torch.bmm(x, x.mT)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def orthogonalize(
    updates: Sequence[Tensor],
    coefficients: Sequence[float],
    ns_steps: int,
    eps: float,
    batches: ShapeBatches | None = None,
) -> list[Tensor]:
    """Each 2-D update orthogonalised, in bf16, in the input's order: one stack and one batched iteration per
    shape. Pass `batches` (ShapeBatches of the updates' shapes, built once) to skip the grouping per call."""
    if batches is None:
        batches = ShapeBatches([u.shape for u in updates])
    elif batches.count != len(updates):
        raise ValueError(f"batches were built for {batches.count} matrices, got {len(updates)} updates")
    results: list[Tensor | None] = [None] * len(updates)
    for shape, indices in batches.batches:
        stack = torch.stack([updates[i] for i in indices])
        if stack.shape[1:] != shape:
            raise ValueError(f"batches expect shape {shape} at {indices}, got {tuple(stack.shape[1:])}")
        ortho = orthogonalize_stack(stack, coefficients, ns_steps, eps, overwrite=True)
        for i, result in zip(indices, ortho.unbind(0)):
            results[i] = result
    return results
