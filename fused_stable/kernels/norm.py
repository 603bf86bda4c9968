"""Multi-tensor sum of squares (the norm pass) and multi-tensor in-place scaling.

One launch per gradient dtype covers any number of tensors: each program reads one chunk of one tensor
(its address comes from an int64 table) and writes one fp32 partial sum of squares. Non-finite values
need no flag of their own: inf or nan in any element makes its partial, and so the global sum, non-finite,
which the finalize kernel tests. Accumulation is fp32 for every storage dtype, so fp16 values whose
squares overflow fp16 (1e4 and up) still give the right, finite norm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tables import CHUNK_SIZE, ChunkMap

BLOCK_SIZE = 1024

TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def to_storage(x, DTYPE: tl.constexpr):
    """fp32 -> storage dtype with round-to-nearest-even.

    For bf16 the rounding is spelled out on the bits: compiled Triton already rounds to nearest even, but
    Triton's interpreter truncates fp32 -> bf16, which would make the CPU tests disagree with the GPU.
    The result is bit-identical to a hardware RTNE conversion; NaN stays NaN.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        rounded = bits.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded).to(tl.bfloat16)
    else:
        return x.to(DTYPE)


@triton.jit
def load_pointer(address_ptr, DTYPE: tl.constexpr):
    """A tensor's address from an int64 table, as a typed pointer."""
    return tl.load(address_ptr).to(tl.pointer_type(DTYPE))


@triton.jit
def block_pointer(base, block_start, ALIGNED: tl.constexpr):
    """base + block_start, marked 16-byte aligned when ALIGNED.

    ALIGNED is checked on the host (every address of the launch is a multiple of 16 bytes, and blocks start
    at multiples of BLOCK elements). Addresses loaded from a table carry no alignment the compiler can see;
    the hint on each block's base pointer (a hint on the table value or the loop index does not propagate)
    is what turns full-block accesses into 128-bit vector loads and stores.
    """
    pointer = base + block_start
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def program_chunk(chunk_tensor, chunk_start, numels, CHUNK: tl.constexpr):
    """This program's chunk: (program id, tensor index, first element, end element) from the chunk tables."""
    pid = tl.program_id(0).to(tl.int64)
    tensor = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    return pid, tensor, start, tl.minimum(start + CHUNK, tl.load(numels + tensor))


@triton.jit
def _sumsq_kernel(
    grad_addrs,  # int64 [num_tensors]
    numels,  # int64 [num_tensors]
    chunk_tensor,  # int64 [num_chunks]
    chunk_start,  # int64 [num_chunks]
    partials,  # fp32 out: [partial_offset + num_chunks]
    partial_offset,
    scale_ptr,  # fp32 [] loss scale to divide by (read only when HAS_SCALE)
    GRAD_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid, tensor, start, end = program_chunk(chunk_tensor, chunk_start, numels, CHUNK)
    grad = load_pointer(grad_addrs + tensor, GRAD_DTYPE)
    inv_scale = 1.0
    if HAS_SCALE:
        inv_scale = 1.0 / tl.load(scale_ptr)
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # full blocks without a mask (vectorisable), then one masked tail
    full_end = start + (end - start) // BLOCK * BLOCK
    for block_start in range(start, full_end, BLOCK):
        # unscale in registers before squaring: scaled fp32 grads could overflow when squared
        g = tl.load(block_pointer(grad, block_start, ALIGNED) + offsets).to(tl.float32) * inv_scale
        acc += g * g
    if full_end < end:
        idx = full_end + offsets
        g = tl.load(grad + idx, mask=idx < end, other=0.0).to(tl.float32) * inv_scale
        acc += g * g
    tl.store(partials + partial_offset + pid, tl.sum(acc, axis=0))


def is_aligned(tensors) -> bool:
    """Whether every tensor starts on a 16-byte boundary (fresh allocations do; views may not)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def launch_sumsq(
    grad_addrs: torch.Tensor,
    numels: torch.Tensor,
    chunks: ChunkMap,
    partials: torch.Tensor,
    partial_offset: int,
    grad_dtype: torch.dtype,
    grad_scale: torch.Tensor | None = None,
    aligned: bool = False,
) -> None:
    """Writes one fp32 sum of squares per chunk into partials[partial_offset:partial_offset + num_chunks].

    `aligned`: every grad address is a multiple of 16 bytes (see `is_aligned`); enables vector loads.
    """
    if grad_dtype not in TRITON_DTYPES:
        raise TypeError(f"fused_stable kernels support float32, bfloat16 and float16 grads, got {grad_dtype}")
    if partials.dtype != torch.float32 or partials.numel() < partial_offset + chunks.num_chunks:
        raise ValueError("partials must be a float32 buffer with room for every chunk")
    if chunks.num_chunks == 0:
        return
    _sumsq_kernel[(chunks.num_chunks,)](
        grad_addrs,
        numels,
        chunks.chunk_tensor,
        chunks.chunk_start,
        partials,
        partial_offset,
        grad_scale if grad_scale is not None else partials,
        GRAD_DTYPE=TRITON_DTYPES[grad_dtype],
        HAS_SCALE=grad_scale is not None,
        ALIGNED=aligned,
        CHUNK=CHUNK_SIZE,
        BLOCK=BLOCK_SIZE,
    )


@triton.jit
def _scale_kernel(
    addrs,  # int64 [num_tensors]
    numels,
    chunk_tensor,
    chunk_start,
    factor_ptr,  # fp32 [] multiplier, read on the device
    DTYPE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    _, tensor, start, end = program_chunk(chunk_tensor, chunk_start, numels, CHUNK)
    data = load_pointer(addrs + tensor, DTYPE)
    factor = tl.load(factor_ptr)
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    for block_start in range(start, end, BLOCK):
        idx = block_start + offsets
        mask = idx < end
        x = tl.load(data + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(data + idx, to_storage(x * factor, DTYPE), mask=mask)


def launch_scale_(
    addrs: torch.Tensor, numels: torch.Tensor, chunks: ChunkMap, dtype: torch.dtype, factor: torch.Tensor
) -> None:
    """Multiplies every tensor in place by the 0-dim fp32 device tensor `factor`."""
    if chunks.num_chunks == 0:
        return
    _scale_kernel[(chunks.num_chunks,)](
        addrs,
        numels,
        chunks.chunk_tensor,
        chunks.chunk_start,
        factor,
        DTYPE=TRITON_DTYPES[dtype],
        CHUNK=CHUNK_SIZE,
        BLOCK=BLOCK_SIZE,
    )
