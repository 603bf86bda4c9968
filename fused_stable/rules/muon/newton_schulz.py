"""Newton-Schulz orthogonalisation batched over matrices of one shape, equal bit for bit to torch.optim.Muon's
`_zeropower_via_newtonschulz` applied to each matrix (checked on CPU at 1 and 2 threads, tests/core/test_muon_parts.py)
wherever a matrix's bf16 product does not depend on the batch it is in. On an AMD EPYC with AVX512-BF16 and no AMX
it can (measured: torch's bf16 baddbmm gave the second of four 16 x 16 Gram updates other bits than addmm on it
alone): there the result is within torch's own floor, not its bits (tests/core/test_muon_routing.py). Going matrix
by matrix would give the bits back but cost the batching: the LoRA set's step 1.11x torch's there, 0.74-0.85x
batched (docs/benchmarks.md).

Per shape, the matrices are stacked once and cast to the Newton-Schulz dtype (`newton_schulz_dtype`: bf16, as
torch computes, wherever bf16 products are native); a tall stack is used as its `.mT`, so each matrix has the
strides of torch's `.T` and the smaller side is the Gram side. Then, as torch per matrix: divide by the Frobenius
norm clamped at eps, and `ns_steps` times A = X X^T, B = b A + c A A, X = a X + B X, as `bmm` / `baddbmm` (the
batched `@` / `addmm`). The result stays in that dtype, as torch returns it: the caller's add upcasts it exactly,
and a cast here would cost a pass and round nothing away.

On a CPU without native bf16 products (no AVX512-BF16, no AMX) torch's bf16 matmul is emulated and several times
slower than fp32 (pytorch #146508): there Newton-Schulz runs in fp32 (more exact than torch's bf16, so not torch's
bits), and FusedMuon.describe() says which was chosen and why. FUSED_STABLE_NEWTON_SCHULZ=bf16 or fp32 overrides
the choice (the test suite pins bf16, torch's, so its bit-for-bit comparisons hold on every machine).

`ShapeBatches` is the grouping by shape, computed once from the shapes, so a step only stacks.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
from torch import Tensor

ENV = "FUSED_STABLE_NEWTON_SCHULZ"  # bf16 | fp32: overrides the choice by device
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz_choice(device: torch.device | str) -> tuple[str, str]:
    """The dtype Newton-Schulz runs in on `device` ("bf16" or "fp32") and why, in words."""
    given = os.environ.get(ENV, "")
    if given:
        if given not in _DTYPES:
            raise ValueError(f"{ENV}={given!r}: Newton-Schulz runs in bf16 or fp32; set it to one of them, or unset it")
        return given, f"{ENV}={given}"
    if torch.device(device).type != "cpu":
        return "bf16", "torch.optim.Muon's dtype"
    if _cpu_multiplies_bf16():
        return "bf16", "torch.optim.Muon's dtype; this CPU multiplies bf16 natively (AVX512-BF16 / AMX)"
    return "fp32", "this CPU has no native bf16 products (no AVX512-BF16 or AMX): fp32 is faster here than torch's bf16"


def newton_schulz_dtype(device: torch.device | str) -> torch.dtype:
    return _DTYPES[newton_schulz_choice(device)[0]]


@functools.cache
def _cpu_multiplies_bf16() -> bool:
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


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
    stack: Tensor,
    coefficients: Sequence[float],
    ns_steps: int,
    eps: float,
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The Newton-Schulz iteration on a stack (n, A, B) of same-shape matrices, any float dtype; returns (n, A, B)
    in `dtype` (None: `newton_schulz_dtype` of the stack's device; a step passes the one it resolved when it was
    built) (for a tall stack, A > B, the `.mT` view of a contiguous (n, B, A) result, as torch's `.T`).
    `overwrite=True` lets a stack in that dtype that is the caller's temporary be divided in place."""
    if stack.ndim != 3:
        raise ValueError(f"orthogonalize_stack takes a stack (n, A, B), got shape {tuple(stack.shape)}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be from 0 to 99 (torch's bound), got {ns_steps}")
    a, b, c = coefficients
    tall = stack.size(1) > stack.size(2)
    x = stack.to(dtype or newton_schulz_dtype(stack.device))
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
    """Each 2-D update orthogonalised, in the Newton-Schulz dtype, in the input's order: one stack and one batched
    iteration per shape. Pass `batches` (ShapeBatches of the updates' shapes, built once) to skip the grouping per
    call."""
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
