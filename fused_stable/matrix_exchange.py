"""Whole matrices for a matrix rule whose params are sharded by rows (FSDP2's Shard(0)): each matrix has one owner
rank, which receives every rank's rows of it, runs the rule's whole-matrix function (Muon's Newton-Schulz) on the
matrices it owns, batched, and sends each rank its rows of the result.

Owners are assigned once, by cost: the matrices sorted costliest first, each to the rank with the least cost so far
(the rule's cost of a shape: Muon's is Newton-Schulz's work, elements x the smaller side; ties to the lowest rank),
so every rank computes the same table and the work is balanced. A step costs two `all_to_all_single` calls per batch
of same-shaped matrices over the shard dim's process group: the rows to their owners, the results back (each rank
sends and receives every matrix's rows once each way). Gather / scatter per owner moves the same bytes in 2 x ranks
calls per batch: slower on gloo (benchmarks/muon_exchange.py; docs/integrations.md has the numbers). Rule-free: the
rule passes the stack to send (in the dtype it wants on the wire) and its function of the whole stack; DeepSpeed's
flat partitions (integrations/deepspeed_muon.py) take their owners from the same `balanced_owners`.

Rows are torch.chunk's pieces (what Shard(0) holds: rank k has rows [k * ceil(R / n), (k + 1) * ceil(R / n)),
clamped, possibly none). Placements other than Shard(0) on one mesh dim and Replicate on the others are refused
(`check_row_shards`); a replicated param or a mesh dim of size 1 is whole on every rank and needs no exchange.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .sharding import NotRowShards, chunk_span, row_shard_mesh_dim


def row_shard_dim(p: Tensor, what: str = "param") -> int | None:
    """The mesh dim on which DTensor `p` holds Shard(0) rows (None: replicated everywhere, or a plain tensor);
    ValueError, in one line, for any other placement."""
    try:
        return row_shard_mesh_dim(p)
    except NotRowShards:
        raise ValueError(
            f"{what} of shape {tuple(p.shape)} is placed as {tuple(p.placements)}: a matrix rule under FSDP2 takes "
            "Shard(0) (fully_shard's rows) on one mesh dim and Replicate on the others; shard it with fully_shard "
            "alone, or put it in an AdamW group (use_muon=False)"
        ) from None


def check_row_shards(params: Sequence[Tensor], title: str) -> None:
    """Refuse a group's DTensor params that are not row shards, before the group is added."""
    for index, p in enumerate(params):
        row_shard_dim(p, f"{title} group: param {index}")


def balanced_owners(costs: Sequence[int], ranks: int) -> list[int]:
    """Each matrix's owner: costliest first, to the rank with the least cost so far (ties: the lower index, the
    lowest rank); the same table on every rank."""
    loads = [0] * ranks
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(ranks), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += costs[index]
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

    def __init__(
        self, shapes: Mapping[int, Sequence[int]], group, rank: int, ranks: int, cost: Callable = math.prod
    ) -> None:
        self.group, self.rank, self.ranks = group, rank, ranks
        self.shapes = {index: (int(shape[0]), int(shape[1])) for index, shape in shapes.items()}
        members = list(self.shapes)
        owners = balanced_owners([cost(shape) for shape in self.shapes.values()], ranks)
        self.owners = dict(zip(members, owners))
        self._routes: dict[tuple[int, ...], _BatchRoute] = {}

    @classmethod
    def of_param(cls, p: Tensor, shapes: Mapping[int, Sequence[int]], cost: Callable) -> MatrixExchange | None:
        """The exchange over the process group on which DTensor `p` holds its rows, owners balanced by `cost(shape)`
        (the whole-matrix function's); None when `p` is whole on every rank (a plain tensor, Replicate, or a shard
        dim of one rank)."""
        mesh_dim = row_shard_dim(p)
        if mesh_dim is None or p.device_mesh.size(mesh_dim) == 1:
            return None
        mesh = p.device_mesh
        return cls(shapes, mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim), cost)

    def route(self, indices: tuple[int, ...]) -> _BatchRoute:
        """The split sizes of a batch of same-shaped matrices (computed once per batch)."""
        route = self._routes.get(indices)
        if route is None:
            rows, cols = self.shapes[indices[0]]
            starts = [chunk_span(rows, self.ranks, k)[0] for k in range(self.ranks)] + [rows]
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
