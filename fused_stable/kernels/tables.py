"""Multi-tensor metadata: the device tables the kernels read (addresses, sizes, chunk -> tensor map).

A table is built once for a given set of tensors and cached by the caller; it is rebuilt only when a
parameter or state storage changes. Gradient addresses change whenever the user frees grads between steps
(`zero_grad(set_to_none=True)`, the default), so they live in their own small array that is refreshed only
when the addresses differ from the previous step's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Elements one program of a multi-tensor kernel handles. Large enough that per-program overhead is small
# on big tensors, small enough that a dense model still yields thousands of programs to fill the GPU.
CHUNK_SIZE = 65536


def upload_int64(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list of ints as an int64 device tensor, without a host synchronisation.

    On CUDA the list goes through pinned memory with a non-blocking copy: a copy from pageable memory
    would synchronise the stream. The caching host allocator keeps the pinned block alive until the copy ran.
    """
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class ChunkMap:
    """Splits tensors of the given sizes into CHUNK_SIZE pieces: one program per piece."""

    chunk_tensor: torch.Tensor  # int64 [num_chunks]: index of the tensor a chunk belongs to
    chunk_start: torch.Tensor  # int64 [num_chunks]: first element of the chunk within its tensor
    tensor_num_chunks: list[int]  # per tensor: how many chunks it has (0 for an empty tensor)

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_tensor.numel())


def build_chunk_map(numels: list[int], device: torch.device, chunk_size: int = CHUNK_SIZE) -> ChunkMap:
    chunk_tensor: list[int] = []
    chunk_start: list[int] = []
    counts: list[int] = []
    for index, numel in enumerate(numels):
        starts = range(0, numel, chunk_size)
        counts.append(len(starts))
        chunk_tensor.extend([index] * len(starts))
        chunk_start.extend(starts)
    return ChunkMap(
        chunk_tensor=upload_int64(chunk_tensor, device),
        chunk_start=upload_int64(chunk_start, device),
        tensor_num_chunks=counts,
    )
