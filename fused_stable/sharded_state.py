"""The optimizer state of sharded (DTensor) parameters, laid out so that it does not depend on the mesh.

A parameter's state format is decided from the whole parameter (its global numel: plan.py), so the same
parameter stores the same way on 1, 2 or 4 ranks. Its moments are DTensors placed like the parameter (what
FSDP2 and torch.distributed.checkpoint expect). Its 8-bit scales are one fp32 value per QUANT_BLOCK elements of
the *global* parameter in its memory order, stored as a 1-D DTensor over the blocks, sharded where the
parameter is sharded: each rank's scales are exactly the blocks of its local shard, so a checkpoint saved on one
mesh reshards onto another and the codes and scales are the ones one process would hold.

That needs every shard boundary on a block boundary. FSDP2 shards dim 0 in torch.chunk pieces; a parameter whose
pieces do not start on a multiple of QUANT_BLOCK elements (rows x row size) cannot keep global blocks: its 8-bit
state is refused in one line (before anything is created), rather than cut into mesh-dependent blocks.
The state_format functions work on local tensors; this module wraps their results.
"""

from __future__ import annotations

import torch

from . import state_format
from .sharding import NotRowShards, chunk_span, is_dtensor, local, row_shard_mesh_dim
from .state_format import Q8, QUANT_BLOCK, SCALE_SUFFIX


def _shard_dim(p: torch.Tensor) -> int | None:
    """The one mesh dim on which DTensor `p` is sharded along its dim 0 (None: replicated everywhere); refuses
    any other layout for 8-bit state."""
    try:
        return row_shard_mesh_dim(p)
    except NotRowShards:
        raise ValueError(
            f"8-bit optimizer state for a parameter of shape {tuple(p.shape)} placed as {p.placements} is not "
            "supported (only Shard(0) on one mesh dim, as FSDP2's fully_shard, or Replicate): give its param group "
            "state_precision='bf16' or 'fp32'"
        ) from None


def check_q8_layout(p: torch.Tensor) -> None:
    """Raises ValueError when DTensor `p`'s shards cannot hold whole global 8-bit blocks (see the module doc)."""
    mesh_dim = _shard_dim(p)
    if mesh_dim is None or p.dim() == 0:
        return
    pieces, rows, numel = p.device_mesh.size(mesh_dim), p.shape[0], p.numel()
    row_size = numel // rows if rows else 0
    blocks = state_format.num_blocks(numel)
    spans = [tuple(row * row_size for row in chunk_span(rows, pieces, index)) for index in range(pieces)]
    misplaced = [index for index, (start, _) in enumerate(spans) if start % QUANT_BLOCK and start != numel]
    split = [chunk_span(blocks, pieces, index) for index in range(pieces)]
    if misplaced:
        index = misplaced[0]
        why = f"shard {index} starts at element {spans[index][0]}, not on a {QUANT_BLOCK}-element block"
    elif split != [(-(-start // QUANT_BLOCK), -(-end // QUANT_BLOCK)) for start, end in spans]:
        why = f"its {blocks} blocks of {QUANT_BLOCK} do not split {pieces} ways as its {rows} rows do"
    else:
        return
    raise ValueError(
        f"8-bit optimizer state for a parameter of shape {tuple(p.shape)} sharded {pieces} ways: {why}, so its "
        "blocks would depend on the mesh; give its param group state_precision='bf16' (or 'fp32'), or shard "
        f"it so that every shard holds a multiple of {QUANT_BLOCK} elements"
    )


def wrap(p: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
    """A local state tensor of DTensor param `p` as the DTensor the state holds: a moment (or master copy) placed
    like `p`, an 8-bit scale vector over the global blocks. A plain `p`'s state is returned as it is."""
    if not is_dtensor(p):
        return value
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if key.endswith(SCALE_SUFFIX):
        mesh_dim = _shard_dim(p)
        placements = [Shard(0) if d == mesh_dim else Replicate() for d in range(p.device_mesh.ndim)]
        blocks = state_format.num_blocks(p.numel())
        return DTensor.from_local(value, p.device_mesh, placements, run_check=False, shape=(blocks,), stride=(1,))
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def zero_moment(p: torch.Tensor, key: str, fmt: int) -> dict[str, torch.Tensor]:
    """state_format.zero_moment for any param: the local zeros, wrapped."""
    if fmt == Q8 and is_dtensor(p):
        check_q8_layout(p)
    return {k: wrap(p, k, v) for k, v in state_format.zero_moment(local(p), key, fmt).items()}


def convert(state: dict, fmt: int, p: torch.Tensor, version: int = state_format.CODES_VERSION) -> None:
    """state_format.convert for any param (8-bit codes in code format `version`): converts the local shards, then
    stores them wrapped."""
    if not is_dtensor(p):
        state_format.convert(state, fmt, p, version)
        return
    if fmt == Q8:
        check_q8_layout(p)
    before = {key: local(value) if isinstance(value, torch.Tensor) else value for key, value in state.items()}
    converted = dict(before)
    state_format.convert(converted, fmt, local(p), version)
    for key in [k for k in state if k not in converted]:
        del state[key]  # a scale dropped (8-bit -> another format)
    for key, value in converted.items():
        if value is not before.get(key):
            state[key] = wrap(p, key, value)
