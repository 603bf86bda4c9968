"""Sharded parameters for the fused step: DTensor detection, local shards, the param checks, the global norm.

FusedAdamW updates each rank's local shard (``p.to_local()``) with the fused kernels; the only thing that
needs the other ranks is the clip/skip decision, which depends on the norm of the *whole* gradient.
``global_sumsq`` turns per-parameter local sums of squares into that global sum with one all-reduce per
mesh dimension on which some gradient is sharded, issued on device tensors (no host sync), so a
non-finite shard on any rank makes the global value non-finite on every rank and every rank skips together.
``validate_params`` refuses the layouts that sum cannot be derived for (FSDP1 flat parameters, Partial
placements, one param group over several meshes).

DDP needs nothing here: its gradients are already all-reduced, so every rank's local norm is the global one.
The torchrun helpers of the trainer live in fused_stable.integrations.distributed, which also re-exports
``global_sumsq`` and ``validate_params`` under their public names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

if dist.is_available():
    # torch.distributed.nn's collectives take `group=group.WORLD` as a default argument, evaluated at its import.
    # Imported while a process group is up (transformers imports it, through torch.distributed.fsdp), they hold
    # that group for the life of the process: destroy_process_group cannot free it, and its gloo worker threads
    # run on into interpreter shutdown, where a worker releasing the tensors of a collective that just finished
    # needs the GIL and aborts the process ("terminate called without an active exception": issue 52's rare
    # SIGABRT at exit). Imported here, before any group exists (2 ms), the defaults are None.
    import torch.distributed.nn  # noqa: F401

SUPPORTED = (
    "FusedAdamW supports plain tensors, DDP models, and DTensor parameters (FSDP2 `fully_shard`, tensor "
    "parallel) with Shard/_StridedShard/Replicate placements, all DTensors of one param group on one DeviceMesh"
)


def is_dtensor(t: torch.Tensor) -> bool:
    """By type name: no import of torch.distributed.tensor (absent from builds without distributed support)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (what the kernels update); any other tensor as is."""
    return t.to_local() if is_dtensor(t) else t


def chunk_span(total: int, pieces: int, index: int) -> tuple[int, int]:
    """torch.chunk's piece `index` of `total` items in `pieces` (what Shard(0) holds): [start, end)."""
    size = -(-total // pieces)
    return min(index * size, total), min((index + 1) * size, total)


def row_shard_mesh_dim(p: torch.Tensor) -> int | None:
    """The one mesh dim on which DTensor `p` holds torch.chunk's rows (Shard(0)); None when `p` is whole on
    every rank (a plain tensor, or Replicate on every mesh dim). Any other layout raises NotRowShards: its
    caller says, in one line, what that layout means for it."""
    if not is_dtensor(p):
        return None
    dims = []
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_replicate():
            continue
        # exactly Shard(0): a _StridedShard (a Shard subclass, FSDP2 over tensor parallel) interleaves rows
        dims.append(mesh_dim if type(placement).__name__ == "Shard" and placement.dim == 0 else None)
    if None in dims or len(dims) > 1:
        raise NotRowShards(f"placed as {tuple(p.placements)}")
    return dims[0] if dims else None


class NotRowShards(ValueError):
    """A DTensor placed other than Shard(0) on one mesh dim and Replicate on the others."""


def element_offset(p: torch.Tensor) -> int:
    """The index in the whole param (its memory order) of the first element of `p`'s local shard: the first of
    torch.chunk's rows times the row size under Shard(0), else 0 (a whole tensor). bf16 stochastic rounding draws
    each element's bits from this global index, so a sharded state rounds as one process would. A layout whose local
    elements are not one range of the whole's (_StridedShard, a Shard on another dim) keeps its local indices."""
    try:
        mesh_dim = row_shard_mesh_dim(p)
    except NotRowShards:
        return 0
    if mesh_dim is None or p.numel() == 0:
        return 0
    mesh, rows = p.device_mesh, p.shape[0]
    first_row, _ = chunk_span(rows, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
    return first_row * (p.numel() // rows)


def norm_reducer(param_groups: list[dict]):
    """`global_sumsq` when some param is a DTensor (FSDP2): the all-reduce that turns the local sums of squares
    into the global one; None otherwise (every local norm is the global one)."""
    if any(is_dtensor(p) for group in param_groups for p in group["params"]):
        return global_sumsq
    return None


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
                f"`torch.distributed.fsdp.fully_shard` or wrap it in DDP. {SUPPORTED}."
            )
        if DTensor is not None and isinstance(p, DTensor):
            _sharded_mesh_dims(p, f"param {i} of the group")
            if not any(p.device_mesh == m for m in meshes):
                meshes.append(p.device_mesh)
    if len(meshes) > 1:
        described = "; ".join(f"{m.device_type} mesh {m.mesh.tolist()} dims {m.mesh_dim_names}" for m in meshes)
        raise ValueError(
            f"one param group holds DTensor params on {len(meshes)} different device meshes ({described}). "
            f"{SUPPORTED}: put the params of each mesh in their own param group."
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
    plain_sum, by_key = _sums_by_sharding(local_sumsq, params)
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


def _sums_by_sharding(local_sumsq: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The local sums of squares added up per (mesh, sharded mesh dims) key, and of the plain (or everywhere
    replicated) params apart. Runs of consecutive params with the same key are summed with one slice each:
    FSDP2 models are a single run, so this is one reduction kernel, not one per param."""
    DTensor = _dtensor_cls()
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
    return plain_sum, by_key
