"""Whole matrices for a matrix rule whose params are sharded by rows (FSDP2's Shard(0)): each matrix has one owner
rank, which receives every rank's rows of it, runs the rule's whole-matrix function (Muon's Newton-Schulz) on the
matrices it owns, batched, and sends each rank its rows of the result.

Owners are assigned once, by size: the matrices sorted largest first, each to the rank with the least work so far
(numel as the proxy of Newton-Schulz's cost; ties to the lowest rank), so every rank computes the same table and
the work is balanced. A step costs two `all_to_all_single` calls per batch of same-shaped matrices over the shard
dim's process group: the rows to their owners, the results back (each rank sends and receives every matrix's
rows once each way). Gather / scatter per owner moves the same bytes in 2 x ranks calls per batch: slower on gloo
(benchmarks/muon_exchange.py; docs/integrations.md has the numbers). Rule-free: the rule passes the stack to
send (in the dtype it wants on the wire) and its function of the whole stack; DeepSpeed's flat partitions could
use the same tables.

Rows are torch.chunk's pieces (what Shard(0) holds: rank k has rows [k * ceil(R / n), (k + 1) * ceil(R / n)),
clamped, possibly none). Placements other than Shard(0) on one mesh dim and Replicate on the others are refused
(`check_row_shards`); a replicated param or a mesh dim of size 1 is whole on every rank and needs no exchange.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .sharded_state import _chunk
from .sharding import is_dtensor


def row_shard_dim(p: Tensor, what: str = "param") -> int | None:
    """The mesh dim on which DTensor `p` holds Shard(0) rows (None: replicated everywhere, or a plain tensor);
    ValueError, in one line, for any other placement."""
    if not is_dtensor(p):
        return None
    dims = []
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_replicate():
            continue
        # exactly Shard(0): a _StridedShard (FSDP2 over tensor parallel) interleaves rows of several owners
        if type(placement).__name__ == "Shard" and placement.dim == 0:
            dims.append(mesh_dim)
            continue
        dims.append(None)
    if None in dims or len(dims) > 1:
        raise ValueError(
            f"{what} of shape {tuple(p.shape)} is placed as {tuple(p.placements)}: a matrix rule under FSDP2 takes "
            "Shard(0) (fully_shard's rows) on one mesh dim and Replicate on the others; shard it with fully_shard "
            "alone, or put it in an AdamW group (use_muon=False)"
        )
    return dims[0] if dims else None


def check_row_shards(params: Sequence[Tensor], title: str) -> None:
    """Refuse a group's DTensor params that are not row shards, before the group is added."""
    for index, p in enumerate(params):
        row_shard_dim(p, f"{title} group: param {index}")


def balanced_owners(numels: Sequence[int], ranks: int) -> list[int]:
    """Each matrix's owner: largest first, to the rank with the least numel so far (ties: the lowest rank)."""
    loads = [0] * ranks
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        owner = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += numels[index]
    return owners


class _BatchRoute:
    """One batch's matrices (same shape) between their shards and their owners: split sizes and positions."""

    def __init__(self, owners: list[int], rank: int, starts: list[int], cols: int) -> None:
        ranks = len(starts) - 1
        rows = [starts[k + 1] - starts[k] for k in range(ranks)]
        self.starts, self.cols, self.rows = starts, cols, rows
        self.by_owner = [[j for j, o in enumerate(owners) if o == r] for r in range(ranks)]
        self.mine = len(self.by_owner[rank])
        # to the owners: my rows of each of their matrices; from every rank: its rows of each matrix I own
        self.to_owner_splits = [len(js) * rows[rank] * cols for js in self.by_owner]
        self.from_rank_splits = [self.mine * rows[k] * cols for k in range(ranks)]
        order = [j for js in self.by_owner for j in js]
        self.send_order = torch.tensor(order, dtype=torch.long)
        self.restore_order = torch.empty_like(self.send_order)
        self.restore_order[self.send_order] = torch.arange(len(order))


class MatrixExchange:
    """The matrices of one process group's row shards: their owners, and `apply` to run a function on the whole
    matrices at their owners. `shapes` maps the caller's index of each matrix to its global shape."""

    def __init__(self, shapes: Mapping[int, Sequence[int]], group, rank: int, ranks: int) -> None:
        self.group, self.rank, self.ranks = group, rank, ranks
        self.shapes = {index: (int(shape[0]), int(shape[1])) for index, shape in shapes.items()}
        members = list(self.shapes)
        owners = balanced_owners([rows * cols for rows, cols in self.shapes.values()], ranks)
        self.owners = dict(zip(members, owners))
        self._routes: dict[tuple[int, ...], _BatchRoute] = {}

    @classmethod
    def of_param(cls, p: Tensor, shapes: Mapping[int, Sequence[int]]) -> MatrixExchange | None:
        """The exchange over the process group on which DTensor `p` holds its rows; None when `p` is whole on every
        rank (a plain tensor, Replicate, or a shard dim of one rank)."""
        mesh_dim = row_shard_dim(p)
        if mesh_dim is None or p.device_mesh.size(mesh_dim) == 1:
            return None
        mesh = p.device_mesh
        return cls(shapes, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim))

    def route(self, indices: tuple[int, ...]) -> _BatchRoute:
        """The split sizes of a batch of same-shaped matrices (computed once per batch)."""
        route = self._routes.get(indices)
        if route is None:
            rows, cols = self.shapes[indices[0]]
            starts = [_chunk(rows, self.ranks, k)[0] for k in range(self.ranks)] + [rows]
            route = self._routes[indices] = _BatchRoute([self.owners[i] for i in indices], self.rank, starts, cols)
        return route

    def apply(self, indices: tuple[int, ...], shards: Tensor, whole_fn: Callable[[Tensor], Tensor]) -> Tensor:
        """`whole_fn` of the whole matrices `indices` (same shape), run at their owners; returns this rank's rows
        of each result, stacked like `shards` (n, local rows, cols), in `whole_fn`'s dtype."""
        route = self.route(indices)
        rows, cols = self.shapes[indices[0]]
        if shards.shape != (len(indices), route.rows[self.rank], cols):
            raise ValueError(
                f"MatrixExchange: rank {self.rank} holds rows {tuple(shards.shape[1:])} of {len(indices)} matrices "
                f"{(rows, cols)}, expected {route.rows[self.rank]} rows (torch.chunk's piece, as Shard(0))"
            )
        sent = shards.index_select(0, route.send_order).reshape(-1)
        received = shards.new_empty(sum(route.from_rank_splits))
        dist.all_to_all_single(received, sent, route.from_rank_splits, route.to_owner_splits, group=self.group)
        pieces = received.split(route.from_rank_splits)
        whole = torch.cat([piece.view(route.mine, n, cols) for piece, n in zip(pieces, route.rows)], dim=1)
        result = whole_fn(whole)  # also on an empty stack: its dtype is what every rank sends back
        back = torch.cat([result[:, s:e].reshape(-1) for s, e in zip(route.starts, route.starts[1:])])
        mine = back.new_empty(len(indices) * route.rows[self.rank] * cols)
        dist.all_to_all_single(mine, back, route.to_owner_splits, route.from_rank_splits, group=self.group)
        return mine.view(len(indices), route.rows[self.rank], cols).index_select(0, route.restore_order)
