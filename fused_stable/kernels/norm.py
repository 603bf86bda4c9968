"""Multi-tensor sum of squares (the norm pass) and multi-tensor in-place scaling.

One launch per gradient dtype covers any number of tensors: each program reads one chunk of one tensor
(its address comes from an int64 table) and writes one fp32 partial sum of squares. Non-finite values
need no flag of their own: inf or nan in any element makes its partial, and so the global sum, non-finite,
which the decision kernel tests. Accumulation is fp32 for every storage dtype, so fp16 values whose
squares overflow fp16 (1e4 and up) still give the right, finite norm.

Alignment is decided per tensor, in the kernel: a tensor whose address is a multiple of 16 bytes walks its
full blocks with 128-bit loads, any other tensor of the same launch with scalar ones, so one unaligned view
does not slow the whole dtype down.

fp contraction: the norm pass accumulates `acc + g * g`; with fusion on this is one fused multiply-add per
element (rounded once), as in torch's CUDA `_foreach_norm` / `linalg.vector_norm` kernels, which nvcc compiles
with contraction on. (Triton's interpreter rounds the product and the sum separately; the CPU tests compare
norms with a tolerance, never bit for bit.) The scale kernel is one multiply per element: nothing to fuse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import TRITON_DTYPES, aligned_block, as_pointer, is_aligned, load_address, to_storage
from .launch import ArgTemplate, LaunchConfig, PreparedLaunch
from .tables import ChunkMap

# 8 warps x 32 threads x 8 elements: each thread keeps two 128-bit fp32 loads (one for 16-bit grads) in flight
# per iteration. Candidates for a GPU to decide between: benchmarks/gpu_probe.py.
SUMSQ_CONFIG = LaunchConfig(block=2048, num_warps=8, fp_fusion=True)
SCALE_CONFIG = LaunchConfig(block=1024, num_warps=4, fp_fusion=False)


@triton.jit
def program_chunk(chunk_tensor, chunk_start, numels, CHUNK: tl.constexpr):
    """This program's chunk: (program id, tensor index, first element, end element) from the chunk tables."""
    pid = tl.program_id(0).to(tl.int64)
    tensor = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    return pid, tensor, start, tl.minimum(start + CHUNK, tl.load(numels + tensor))


@triton.jit(do_not_specialize=["partial_offset"], do_not_specialize_on_alignment=["scale_ptr"])
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
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid, tensor, start, end = program_chunk(chunk_tensor, chunk_start, numels, CHUNK)
    address = load_address(grad_addrs + tensor)
    grad = as_pointer(address, GRAD_DTYPE)
    inv_scale = 1.0
    if HAS_SCALE:
        inv_scale = tl.div_rn(1.0, tl.load(scale_ptr))
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # full blocks without a mask (vectorised when the tensor is aligned), then one masked tail;
    # unscale in registers before squaring: scaled fp32 grads could overflow when squared
    full_end = start + (end - start) // BLOCK * BLOCK
    if is_aligned(address):
        for block_start in range(start, full_end, BLOCK):
            g = tl.load(aligned_block(grad, block_start) + offsets).to(tl.float32) * inv_scale
            acc += g * g
    else:
        for block_start in range(start, full_end, BLOCK):
            g = tl.load(grad + block_start + offsets).to(tl.float32) * inv_scale
            acc += g * g
    if full_end < end:
        idx = full_end + offsets
        g = tl.load(grad + idx, mask=idx < end, other=0.0).to(tl.float32) * inv_scale
        acc += g * g
    tl.store(partials + partial_offset + pid, tl.sum(acc, axis=0))


def prepare_sumsq(
    grad_addrs: torch.Tensor,
    numels: torch.Tensor,
    chunks: ChunkMap,
    partials: torch.Tensor,
    partial_offset: int,
    grad_dtype: torch.dtype,
    config: LaunchConfig = SUMSQ_CONFIG,
) -> tuple[PreparedLaunch, ArgTemplate] | None:
    """The norm pass over one grad dtype: one fp32 sum of squares per chunk into
    partials[partial_offset:partial_offset + num_chunks]. Returns the launch and its arguments, whose
    `scale_ptr` / `HAS_SCALE` slots are filled per call (see `run_sumsq`); None when there is nothing to read.
    """
    if grad_dtype not in TRITON_DTYPES:
        raise TypeError(f"fused_stable kernels support float32, bfloat16 and float16 grads, got {grad_dtype}")
    if partials.dtype != torch.float32 or partials.numel() < partial_offset + chunks.num_chunks:
        raise ValueError("partials must be a float32 buffer with room for every chunk")
    if chunks.num_chunks == 0:
        return None
    args = ArgTemplate(
        _sumsq_kernel,
        grad_addrs=grad_addrs,
        numels=numels,
        chunk_tensor=chunks.chunk_tensor,
        chunk_start=chunks.chunk_start,
        partials=partials,
        partial_offset=partial_offset,
        scale_ptr=partials,
        GRAD_DTYPE=TRITON_DTYPES[grad_dtype],
        HAS_SCALE=False,
        CHUNK=chunks.chunk_size,
        BLOCK=config.block,
    )
    return PreparedLaunch(_sumsq_kernel, chunks.num_chunks, config), args


def run_sumsq(prepared: tuple[PreparedLaunch, ArgTemplate], grad_scale: torch.Tensor | None, stream) -> None:
    """One norm-pass launch; `grad_scale` (fp32, 0-dim) divides the grads before squaring when given."""
    launch, args = prepared
    if grad_scale is None:
        launch(args.base, stream, variant=False)
    else:
        launch(args.fill(scale_ptr=grad_scale, HAS_SCALE=True), stream, variant=True)


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
    data = as_pointer(load_address(addrs + tensor), DTYPE)
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
    """Multiplies every tensor in place by the 0-dim fp32 device tensor `factor` (one-off: clip_grad_norm_)."""
    if chunks.num_chunks == 0:
        return
    _scale_kernel[(chunks.num_chunks,)](
        addrs,
        numels,
        chunks.chunk_tensor,
        chunks.chunk_start,
        factor,
        DTYPE=TRITON_DTYPES[dtype],
        CHUNK=chunks.chunk_size,
        BLOCK=SCALE_CONFIG.block,
        **SCALE_CONFIG.options(),
    )
