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

The two symmetric products of each iteration, the Gram X X^T and its square A A (= A A^T: the Gram is symmetric,
bit for bit), can run by blocks of the Gram side's rows (`symmetric_product`): only the blocks on and above the
diagonal are multiplied, those below are the transposes of those above, so a Gram of 4 blocks costs 10 products of
a sixteenth where torch's costs 16. Each element is the same dot product over the same inner dimension, so on the
CPUs measured it is the same bits as the whole product (an Intel Xeon capped at AVX512-BF16 by
ONEDNN_MAX_CPU_ISA, tests/core/test_newton_schulz_blocks.py), not on AMX, whose kernels sum a block's elements
in another order; AMX also multiplies whole Grams faster than blocks. A tall stack's first Gram, of its transposed
view, stays whole (its blocks were other bits on 1536 x 576). So the blocks run on a CPU unless its bf16
products run on AMX (`gram_blocks_choice`), and never on CUDA (not measured there); FUSED_STABLE_NEWTON_SCHULZ_BLOCKS
=1 or 0 overrides the choice. Measured on 2 cores (docs/benchmarks.md): Newton-Schulz 16-21% faster per shape with
AVX512-BF16 products (the dense CPU step from 1.00x to 0.88-0.91x of torch's), 4-11% in fp32.

`ShapeBatches` is the grouping by shape, computed once from the shapes, so a step only stacks.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
from torch import Tensor

ENV = "FUSED_STABLE_NEWTON_SCHULZ"  # bf16 | fp32: overrides the choice by device
BLOCKS_ENV = "FUSED_STABLE_NEWTON_SCHULZ_BLOCKS"  # 1 | 0: overrides the symmetric products' choice by device
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# the symmetric products' row blocks: about BLOCK_ROWS rows each, at most MAX_BLOCKS (measured with AVX512-BF16
# products, 2 threads: Gram sides of 384, 576, 768 and 1536 rows fastest at 2, 3, 4 and 3-4 blocks)
BLOCK_ROWS = 192
MAX_BLOCKS = 4


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


def gram_blocks_choice(device: torch.device | str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the symmetric products run by row blocks (`symmetric_product`) on `device` in `dtype`, and why."""
    given = os.environ.get(BLOCKS_ENV, "")
    if given:
        if given not in ("0", "1"):
            raise ValueError(f"{BLOCKS_ENV}={given!r}: set it to 1 (Gram products by blocks) or 0 (whole), or unset it")
        return given == "1", f"{BLOCKS_ENV}={given}"
    if torch.device(device).type != "cpu":
        return False, "whole products, as torch's (blocks are measured on CPUs only)"
    if dtype == torch.bfloat16 and _cpu_uses_amx():
        return False, "whole products, as torch's: AMX multiplies a whole Gram faster, in other bits than its blocks"
    return True, "the Gram products by blocks above the diagonal (fewer products, the same dot products)"


def gram_blocks(rows: int) -> int:
    """The symmetric products' row blocks for a Gram side of `rows`: one (a whole product) below 2 x BLOCK_ROWS."""
    return max(1, min(MAX_BLOCKS, rows // BLOCK_ROWS))


def row_blocked(shape: Sequence[int]) -> bool:
    """Whether a matrix (or a stack of experts' matrices) of `shape` has more than one row block, where the
    blocks are chosen: its Gram side is its smaller one."""
    return gram_blocks(min(int(shape[-2]), int(shape[-1]))) > 1


# what ONEDNN_MAX_CPU_ISA (a user's or a test's cap on oneDNN, which runs torch's bf16 CPU products) leaves on
_NO_ISA_CAP = ("", "ALL", "DEFAULT")


def _isa_cap() -> str:
    return os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()


@functools.cache
def _cpu_uses_amx() -> bool:
    cap = _isa_cap()
    return bool(torch.cpu._is_amx_tile_supported()) and (cap in _NO_ISA_CAP or "AMX" in cap)


@functools.cache
def _cpu_multiplies_bf16() -> bool:
    cap = _isa_cap()
    # oneDNN's ISAs from AVX512_CORE_BF16 up (AVX512_CORE_FP16 is AVX10_1_512; every AMX one is above it)
    at_least_bf16 = cap.startswith(("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10")) or "AMX" in cap
    capped_above_bf16 = cap in _NO_ISA_CAP or at_least_bf16
    return _cpu_uses_amx() or bool(torch.cpu._is_avx512_bf16_supported() and capped_above_bf16)


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
    blocks: bool | None = None,
) -> Tensor:
    """The Newton-Schulz iteration on a stack (n, A, B) of same-shape matrices, any float dtype; returns (n, A, B)
    in `dtype` (None: `newton_schulz_dtype` of the stack's device; a step passes the one it resolved when it was
    built) (for a tall stack, A > B, the `.mT` view of a contiguous (n, B, A) result, as torch's `.T`).
    `overwrite=True` lets a stack in that dtype that is the caller's temporary be divided in place. `blocks`: the
    symmetric products by row blocks (None: `gram_blocks_choice` of the device and dtype; a step passes the one it
    resolved when it was built, as the dtype)."""
    if stack.ndim != 3:
        raise ValueError(f"orthogonalize_stack takes a stack (n, A, B), got shape {tuple(stack.shape)}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"ns_steps must be from 0 to 99 (torch's bound), got {ns_steps}")
    a, b, c = coefficients
    tall = stack.size(1) > stack.size(2)
    dtype = dtype or newton_schulz_dtype(stack.device)
    x = stack.to(dtype)
    if x is stack and not overwrite:
        x = x.clone()  # the division below is in place (torch's `.bfloat16()` of a bf16 grad divides the grad)
    if tall:
        x = x.mT
    x.div_(torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps))
    if blocks is None:
        blocks = gram_blocks_choice(stack.device, dtype)[0]
    row_blocks = gram_blocks(x.size(1)) if blocks else 1
    for _ in range(ns_steps):
        # a tall stack's first x is a transposed view: its whole Gram, as torch's (its blocks sum in other bits)
        if row_blocks > 1 and x.is_contiguous():
            gram = symmetric_product(x, row_blocks)
        else:
            gram = torch.bmm(x, x.mT)
        if row_blocks > 1:
            gram_update = symmetric_product(gram, row_blocks, add=gram, beta=b, alpha=c)  # A A = A A^T
        else:
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def symmetric_product(
    x: Tensor, row_blocks: int, *, add: Tensor | None = None, beta: float = 0.0, alpha: float = 1.0
) -> Tensor:
    """`x x^T` of a stack (n, A, B), or `beta * add + alpha * x x^T` (`add` symmetric, (n, A, A)), by `row_blocks`
    blocks of x's rows: the products of the blocks on and above the diagonal, each block below the transpose of
    the one above it (x x^T is symmetric bit for bit: each element is one dot product, commutative)."""
    rows = x.size(1)
    edges = [rows * i // row_blocks for i in range(row_blocks + 1)]
    spans = [slice(start, end) for start, end in zip(edges, edges[1:])]
    parts = [x[:, span].contiguous() for span in spans]  # one copy of each block, read by every product of its row
    out = x.new_empty(x.size(0), rows, rows)
    for i, left in enumerate(spans):
        for j in range(i, row_blocks):
            right = spans[j]
            if add is None:
                block = torch.bmm(parts[i], parts[j].mT)
            else:
                block = torch.baddbmm(add[:, left, right], parts[i], parts[j].mT, beta=beta, alpha=alpha)
            out[:, left, right] = block
            if j != i:
                out[:, right, left] = block.mT
    return out


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
