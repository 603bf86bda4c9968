"""Multi-tensor metadata: the device tables the kernels read (addresses, sizes, chunk -> tensor map), and the one
way host values reach them.

A table is built once for a given set of tensors and cached by the caller (fused_stable.backends); it is
rebuilt only when something it encodes changes. Gradient addresses change whenever the user frees grads
between steps (`zero_grad(set_to_none=True)`, the default), so they live in their own small array that is
rewritten in place only when the addresses differ from the previous step's.

Every host -> device upload goes through `upload`, which refuses to run while the current CUDA stream is
being captured into a graph: a graph would record a copy from a pinned host block that the caching host
allocator hands out again once the capture ends, so a replay would read whatever lies there by then.
Plain torch: importing this module does not import triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Elements one program of a multi-tensor kernel handles. Large enough that per-program overhead is small
# on big tensors, small enough that a dense model still yields thousands of programs to fill the GPU.
CHUNK_SIZE = 65536

CAPTURE_ERROR = (
    "fused_stable would upload {what} to the GPU while a CUDA graph is being captured, and a graph cannot replay "
    "that copy safely: run one eager step (outside the capture) with the same static grads, hyper-parameters and "
    "parameters first, so the tables are built before capturing (see docs/optimizer.md, 'CUDA graphs')"
)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_not_capturing(device: torch.device, what: str) -> None:
    """Raises a clear error instead of letting a host -> device copy be recorded into a CUDA graph."""
    if _capturing(device):
        raise RuntimeError(CAPTURE_ERROR.format(what=what))


def upload(values: list, dtype: torch.dtype, device: torch.device, what: str, out: torch.Tensor | None = None):
    """A host list as a device tensor (or copied into `out`), without a host synchronisation.

    On CUDA the list goes through pinned memory with a non-blocking copy: a copy from pageable memory would
    synchronise the stream. The caching host allocator keeps the pinned block alive until the copy ran.
    """
    check_not_capturing(device, what)
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    if out is None:
        return host.to(device, non_blocking=True)
    return out.copy_(host.view(out.shape), non_blocking=True)


def upload_int64(values: list[int], device: torch.device, what: str = "a metadata table") -> torch.Tensor:
    return upload(values, torch.int64, device, what)


@dataclass
class ChunkMap:
    """Splits tensors of the given sizes into `chunk_size` pieces: one program per piece."""

    chunk_tensor: torch.Tensor  # int64 [num_chunks]: index of the tensor a chunk belongs to
    chunk_start: torch.Tensor  # int64 [num_chunks]: first element of the chunk within its tensor
    tensor_num_chunks: list[int]  # per tensor: how many chunks it has (0 for an empty tensor)
    chunk_size: int = CHUNK_SIZE

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
        chunk_tensor=upload_int64(chunk_tensor, device, "a chunk map"),
        chunk_start=upload_int64(chunk_start, device, "a chunk map"),
        tensor_num_chunks=counts,
        chunk_size=chunk_size,
    )
