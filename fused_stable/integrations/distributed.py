"""Scale-out for fused_stable: the global gradient norm over DTensor shards (FSDP2, tensor parallel),
the parameter checks FusedAdamW runs on distributed models, and the torchrun plumbing the trainer uses
(process group from the environment, rank-0 checks, DDP / FSDP2 wrapping, data sharding, checkpoints).

FusedAdamW updates each rank's local shard (``p.to_local()``) with the fused kernels; the only thing that
needs the other ranks is the clip/skip decision, which depends on the norm of the *whole* gradient.
``global_sumsq`` turns per-parameter local sums of squares into that global sum with one all-reduce per
mesh dimension on which some gradient is sharded, issued on device tensors (no host sync), so a
non-finite shard on any rank makes the global value non-finite on every rank and every rank skips together.

DDP needs nothing here: its gradients are already all-reduced, so every rank's local norm is the global one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistInfo",
    "destroy_distributed",
    "full_model_state_dict",
    "global_sumsq",
    "init_distributed_from_env",
    "is_main_process",
    "reduce_mean",
    "shard_data",
    "unwrap_model",
    "validate_params",
    "wrap_model",
]

T = TypeVar("T")

_SUPPORTED = (
    "FusedAdamW supports plain tensors, DDP models, and DTensor parameters (FSDP2 `fully_shard`, tensor "
    "parallel) with Shard/_StridedShard/Replicate placements, all DTensors of one param group on one DeviceMesh"
)


# --------------------------------------------------------------------------------------------------
# What FusedAdamW calls
# --------------------------------------------------------------------------------------------------


def _dtensor_cls():
    # DTensor lives in torch.distributed.tensor; builds without distributed support have no DTensors at all.
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_fsdp1_param(p: torch.Tensor) -> bool:
    # FSDP1 marks its FlatParameter with `_is_flat_param` and every tensor it flattened (including the
    # use_orig_params=True views, whose local piece is an arbitrary slice of the flat shard) with
    # `_fsdp_flattened`; neither carries the sharding in its type, so a global norm cannot be derived.
    return bool(getattr(p, "_is_flat_param", False) or getattr(p, "_fsdp_flattened", False))


def _sharded_mesh_dims(t: torch.Tensor, what: str) -> tuple[int, ...]:
    """Mesh dims on which DTensor ``t`` is sharded (Shard or _StridedShard); errors on Partial."""
    from torch.distributed.tensor.placement_types import _StridedShard

    dims = []
    for mesh_dim, placement in enumerate(t.placements):
        if placement.is_partial():
            # The sum of squares of a pending sum is not the sum of the local sums of squares, and the
            # update would apply an unreduced gradient to the local shard: reduce it first.
            raise ValueError(
                f"{what} is a DTensor with a Partial placement on mesh dim {mesh_dim} ({t.placements}); "
                "FusedAdamW needs reduced gradients (Shard/_StridedShard/Replicate): call "
                "`grad.redistribute(placements=...)` before step()"
            )
        if placement.is_shard() or isinstance(placement, _StridedShard):
            dims.append(mesh_dim)
    return tuple(dims)


def validate_params(params: list[torch.Tensor]) -> None:
    """Check one param group of FusedAdamW for distributed layouts it cannot handle.

    Raises TypeError for FSDP1 flat parameters and ValueError for DTensors of one group on different
    device meshes or with Partial placements; the message says what is supported.
    """
    DTensor = _dtensor_cls()
    meshes = []
    for i, p in enumerate(params):
        if _is_fsdp1_param(p):
            raise TypeError(
                f"param {i} of the group is an FSDP1 (FullyShardedDataParallel) flat parameter, which "
                f"FusedAdamW does not support: shard the model with FSDP2 "
                f"`torch.distributed.fsdp.fully_shard` or wrap it in DDP. {_SUPPORTED}."
            )
        if DTensor is not None and isinstance(p, DTensor):
            _sharded_mesh_dims(p, f"param {i} of the group")
            if not any(p.device_mesh == m for m in meshes):
                meshes.append(p.device_mesh)
    if len(meshes) > 1:
        described = "; ".join(f"{m.device_type} mesh {m.mesh.tolist()} dims {m.mesh_dim_names}" for m in meshes)
        raise ValueError(
            f"one param group holds DTensor params on {len(meshes)} different device meshes ({described}). "
            f"{_SUPPORTED}: put the params of each mesh in their own param group."
        )


def global_sumsq(local_sumsq: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """Global fp32 sum of squares of the gradients of ``params`` over all shards, as a 0-dim tensor.

    ``local_sumsq[i]`` is the sum of squares of the local shard of ``params[i].grad``. Params are grouped
    by (mesh, mesh dims on which the grad is sharded); for each mesh dim, the groups sharded on it are
    stacked and all-reduced (SUM) in one call over that dim's process group. Replicated dims need no
    reduction (every rank holds the same values); plain tensors count as they are. No host sync: a
    non-finite local value makes the result non-finite on every rank.
    """
    if local_sumsq.dim() != 1 or local_sumsq.numel() != len(params):
        raise ValueError(
            f"local_sumsq must be 1-D with one entry per param ({len(params)}), got shape {tuple(local_sumsq.shape)}"
        )
    local_sumsq = local_sumsq.float()
    DTensor = _dtensor_cls()

    # Runs of consecutive params with the same key are summed with one slice each: FSDP2 models are a
    # single run, so this is one reduction kernel, not one per param.
    plain_sum = local_sumsq.new_zeros(())
    by_key: dict[tuple, torch.Tensor] = {}
    run_key, run_start = None, 0

    def close_run(end: int) -> None:
        nonlocal plain_sum
        if end == run_start:
            return
        part = local_sumsq[run_start:end].sum()
        if run_key is None:
            plain_sum = plain_sum + part
        else:
            by_key[run_key] = by_key[run_key] + part if run_key in by_key else part

    for i, p in enumerate(params):
        g = p.grad if p.grad is not None else p
        if DTensor is not None and isinstance(g, DTensor):
            dims = _sharded_mesh_dims(g, f"the gradient of param {i}")
            key = (g.device_mesh, dims) if dims else None  # replicated everywhere: local value is global
        else:
            key = None
        if key != run_key:
            close_run(i)
            run_key, run_start = key, i
    close_run(len(params))

    total = plain_sum
    # Group keys by mesh (DeviceMesh is hashable), then one all-reduce per mesh dim.
    meshes: dict = {}
    for (mesh, dims), value in by_key.items():
        meshes.setdefault(mesh, []).append([dims, value])
    for mesh, entries in meshes.items():
        for mesh_dim in range(mesh.ndim):
            sharded_here = [e for e in entries if mesh_dim in e[0]]
            if not sharded_here or mesh.size(mesh_dim) == 1:
                continue
            buf = torch.stack([e[1] for e in sharded_here])
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=mesh.get_group(mesh_dim))
            for k, e in enumerate(sharded_here):
                e[1] = buf[k]
        for _, value in entries:
            total = total + value
    return total


# --------------------------------------------------------------------------------------------------
# torchrun plumbing for the trainer
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: ``world_size == 1`` means a plain single-process run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """The device this rank should train on: its local GPU under NCCL, else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def _info_from_process_group() -> DistInfo:
    return DistInfo(
        rank=dist.get_rank(),
        local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
        world_size=dist.get_world_size(),
        backend=str(dist.get_backend()),
    )


def init_distributed_from_env(backend: str | None = None) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Without WORLD_SIZE > 1 this is a single-process run and nothing is initialised. The backend defaults
    to NCCL when CUDA is available (and selects this rank's GPU), else gloo. Idempotent.
    """
    if dist.is_available() and dist.is_initialized():
        return _info_from_process_group()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world_size} but this torch build has no torch.distributed support")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: launch with `torchrun --nproc-per-node N ...`"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, init_method="env://")
    return _info_from_process_group()


def destroy_distributed() -> None:
    """Leave the process group if one is up (call at the end of training, also on error paths)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_main_process() -> bool:
    """True on rank 0, and in any run without an initialised process group: log and save only there."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def shard_data(items: Sequence[T], rank: int | None = None, world_size: int | None = None) -> list[T]:
    """This rank's share of ``items``: every ``world_size``-th item from ``rank``, trimmed so all ranks
    get the same count (a rank with one extra batch would wait forever in a collective)."""
    if rank is None or world_size is None:
        on = dist.is_available() and dist.is_initialized()
        rank = (dist.get_rank() if on else 0) if rank is None else rank
        world_size = (dist.get_world_size() if on else 1) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    per_rank = len(items) // world_size
    if per_rank == 0:
        raise ValueError(f"{len(items)} items cannot give every one of {world_size} ranks at least one")
    return list(items[rank : rank + per_rank * world_size : world_size])


def reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over all ranks (for logging the loss from rank 0); identity when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    out = value.detach().float().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()


def _transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules named in HF's ``_no_split_modules`` (decoder
    layers), so each block's params are gathered only while it runs."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def wrap_model(model: nn.Module, tuner: str, *, device_mesh=None) -> nn.Module:
    """Wrap ``model`` for data-parallel training on the current process group.

    ``tuner == "full"``: FSDP2 (``fully_shard`` on every transformer block, then on the root), so params,
    grads and optimizer state are DTensor shards. Any adapter tuner (lora, qlora, dora, ...): DDP, since
    the trainable params are small and replicating them is cheapest. Returns ``model`` unchanged without
    a process group of more than one rank. Put the model on its device before calling this.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return model
    if not isinstance(tuner, str) or not tuner:
        raise ValueError(f"tuner must be a non-empty string such as 'full' or 'lora', got {tuner!r}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if tuner == "full":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = device_mesh or init_device_mesh(device.type, (dist.get_world_size(),))
        for block in _transformer_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 shards in place, so it needs no unwrapping)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return model.module if isinstance(model, DDP) else model


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain CPU tensors with the user's key names, gathered from the
    shards under FSDP2. A collective under FSDP2: call it on every rank, save it on rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = unwrap_model(model)
    if not (dist.is_available() and dist.is_initialized()):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
