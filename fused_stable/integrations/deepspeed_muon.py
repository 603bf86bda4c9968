"""FusedMuon's Muon groups on DeepSpeed ZeRO-1/2's flat fp32 partitions: the momentum and the update stay on each
rank's partition, each matrix's Newton-Schulz runs whole on one owner rank (integrations/deepspeed.py builds this
for the Muon groups through engines.drive; the fused step's norm, clip, skip and schedule are the usual ones).

ZeRO 1-2 flatten each param group into one buffer (the params in DeepSpeed's order at its offsets, padded at the
end) and give each rank an equal slice, so a partition holds pieces of matrices cut anywhere, as DeepSpeed's own
Muon finds them in `get_flat_partition`. Per optimizer step (never per micro-batch: DeepSpeed steps the optimizer at
the accumulation boundary), from the step's decisions (clip multiplier, skip flag, lr factor) as MuonSide takes them:

    on the partition, elementwise:   g = grad * grad_mul;  B = B.lerp(g, 1 - momentum)
                                     U = g.lerp(B, momentum) with nesterov, else B
    exchange 1 (all_to_all_single):  each piece of U, rounded to Newton-Schulz's dtype (bf16), to its matrix's owner
    on the owner:                    the whole matrices, stacked by shape, newton_schulz.orthogonalize_stack
    exchange 2 (all_to_all_single):  each piece of the orthogonalised matrix back to the rank that holds it
    on the partition:                p = p * (1 - lr * lr_factor * wd);  p += -adjusted_lr(shape) * O * lr_factor

Owners: the matrices by decreasing Newton-Schulz work (elements x the smaller side), each to the rank with the
least work so far; the same on every rank, from the layout alone. Every element travels once each way, in that dtype.

The same bits as one process's FusedMuon given the same grads: U and its bf16 rounding are elementwise (the stack's
first op in orthogonalize_stack is that rounding), so the owner's matrix is the bf16 tensor MuonSide stacks; Newton-
Schulz of a matrix does not depend on the other matrices of its stack; the decay and the add are MuonSide's ops with
its scalars: the momentum and the decay are the same functions (rules/muon/torch.py `momentum_and_direction`,
`decay_factor`), the add is `_step_batch`'s per piece. A skipped step (the decision is global, read on the host for
CPU tensors) returns before any exchange on every rank; on other devices every step exchanges and selects with
torch.where.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..matrix_exchange import balanced_owners
from ..rules.muon import adjusted_lr
from ..rules.muon import torch as muon_torch
from ..rules.muon.newton_schulz import gram_blocks_choice, newton_schulz_dtype, newton_schulz_work, orthogonalize_stack
from ..rules.muon.torch import MuonHparams, decay_factor, momentum_and_direction


@dataclass(frozen=True)
class Matrix:
    """A Muon matrix at `offset` in DeepSpeed's flat buffer of its group, whose partitions (`part`: this side's
    index of that group) are `partition_size` long."""

    part: int
    shape: tuple[int, int]
    offset: int
    partition_size: int

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def work(self) -> int:
        return newton_schulz_work(self.shape)


@dataclass(frozen=True)
class Piece:
    """The elements [start, start + length) of matrix `matrix` (row-major), at `local` in rank `rank`'s partition."""

    matrix: int
    rank: int
    local: int
    start: int
    length: int


def pieces(matrices: list[Matrix]) -> list[Piece]:
    """Every matrix cut at its group's partition boundaries."""
    out = []
    for index, m in enumerate(matrices):
        end, size = m.offset + m.numel, m.partition_size
        for rank in range(m.offset // size, (end - 1) // size + 1):
            low, high = max(m.offset, rank * size), min(end, (rank + 1) * size)
            out.append(Piece(index, rank, low - rank * size, low - m.offset, high - low))
    return out


def owners(matrices: list[Matrix], world: int) -> list[int]:
    """Each matrix's owner rank: by decreasing Newton-Schulz work, to the least loaded rank (FSDP2's assignment,
    matrix_exchange.balanced_owners)."""
    return balanced_owners([m.work for m in matrices], world)


@dataclass(frozen=True)
class Exchange:
    """Rank `rank`'s side of both exchanges: `outgoing` (pieces of its partitions, ordered by owner) goes out in
    exchange 1 and comes back in exchange 2; `incoming` (pieces of the matrices it owns, ordered by the rank that
    holds them) comes in, then goes back. Counts per peer rank, as all_to_all_single takes them."""

    outgoing: list[Piece]
    outgoing_counts: list[int]
    incoming: list[Piece]
    incoming_counts: list[int]
    owned: list[int]  # the matrices this rank orthogonalises

    @classmethod
    def plan(cls, all_pieces: list[Piece], owner: list[int], rank: int, world: int) -> Exchange:
        outgoing = sorted((p for p in all_pieces if p.rank == rank), key=lambda p: (owner[p.matrix], p.matrix))
        incoming = sorted((p for p in all_pieces if owner[p.matrix] == rank), key=lambda p: (p.rank, p.matrix))
        out_counts, in_counts = [0] * world, [0] * world
        for p in outgoing:
            out_counts[owner[p.matrix]] += p.length
        for p in incoming:
            in_counts[p.rank] += p.length
        owned = [i for i, r in enumerate(owner) if r == rank]
        return cls(outgoing, out_counts, incoming, in_counts, owned)


class PartitionedMuon:
    """The update of FusedMuon's Muon groups from DeepSpeed's flat partitions (`params[k]`: group k's partition on
    this rank, `buffers[k]` its momentum, `layouts[k]` the group's matrices as (shape, offset in the flat group)),
    each group's partitions `partition_sizes[k]` long,
    with matrix_step's `step(grads, grad_mul, skip, lr_factor)`. `orthogonalized` counts the matrices this rank ran
    Newton-Schulz on (host count: one per owned matrix per applied step)."""

    def __init__(self, params, buffers, groups, layouts, partition_sizes: list[int], process_group) -> None:
        self.params, self.buffers = list(params), list(buffers)
        self.hparams = [MuonHparams.from_group(group) for group in groups]
        self.matrices = [
            Matrix(k, (int(shape[0]), int(shape[1])), offset, partition_sizes[k])
            for k, layout in enumerate(layouts)
            for shape, offset in layout
        ]
        self.process_group = process_group
        world, rank = dist.get_world_size(group=process_group), dist.get_rank(group=process_group)
        for k, (p, size) in enumerate(zip(self.params, partition_sizes)):
            if p.ndim != 1 or p.numel() != size or self.buffers[k].shape != p.shape:
                raise ValueError(f"Muon partition {k}: {tuple(p.shape)}, expected one flat partition of {size}")
        owner = owners(self.matrices, world)
        self.exchange = Exchange.plan(pieces(self.matrices), owner, rank, world)
        self.neg_lrs = [
            -adjusted_lr(self.hparams[m.part].lr, self.hparams[m.part].adjust_lr_fn, m.shape) for m in self.matrices
        ]
        self.stacks = self._stacks()
        self.newton_schulz_dtype = newton_schulz_dtype(self.params[0].device)  # resolved once (by device)
        self.gram_blocks = gram_blocks_choice(self.params[0].device, self.newton_schulz_dtype)[0]  # the same
        self.orthogonalized = 0

    def _stacks(self) -> list[tuple[MuonHparams, tuple[int, int], list[int]]]:
        """The owned matrices batched by group hyper-parameters and shape, as MuonSide batches them."""
        keyed: dict[tuple, list[int]] = {}
        for index in self.exchange.owned:
            m = self.matrices[index]
            keyed.setdefault((self.hparams[m.part], m.shape), []).append(index)
        return [(hp, shape, members) for (hp, shape), members in keyed.items()]

    def step(self, grads, grad_mul: Tensor, skip: Tensor, lr_factor: Tensor) -> None:
        """One step of every Muon partition (collective: every rank of the data-parallel group calls it)."""
        on_host = muon_torch.DECIDE_ON_HOST and skip.device.type == "cpu"
        if on_host and bool(skip):  # the same decision on every rank: none of them exchanges
            return
        new_buffers, directions = self._momentum(grads, grad_mul)
        ortho = self._orthogonalize(self._to_owners(directions))
        new_params = self._update(self._from_owners(ortho), lr_factor)
        for old, new in zip(self.buffers + self.params, new_buffers + new_params):
            old.copy_(new if on_host else torch.where(skip != 0, old, new))

    def _momentum(self, grads, grad_mul: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """MuonSide's momentum and Nesterov direction, on each partition (elementwise, fp32)."""
        new_buffers, directions = [], []
        for grad, buffer, hp in zip(grads, self.buffers, self.hparams):
            new, direction = momentum_and_direction(grad.float() * grad_mul, buffer.float(), hp, buffer.dtype)
            new_buffers.append(new)
            directions.append(direction)
        return new_buffers, directions

    def _to_owners(self, directions: list[Tensor]) -> Tensor:
        """Exchange 1: the pieces of the directions, in the Newton-Schulz dtype (its first op), to their owners."""
        ex = self.exchange
        dtype = self.newton_schulz_dtype
        send = [directions[self.matrices[p.matrix].part].narrow(0, p.local, p.length) for p in ex.outgoing]
        send = torch.cat(send).to(dtype) if send else directions[0].new_empty(0, dtype=dtype)
        received = send.new_empty(sum(ex.incoming_counts))
        dist.all_to_all_single(received, send, ex.incoming_counts, ex.outgoing_counts, group=self.process_group)
        return received

    def _orthogonalize(self, received: Tensor) -> dict[int, Tensor]:
        """The owned matrices whole (from the received pieces), Newton-Schulz per stack: {matrix: flat result}."""
        whole = {i: received.new_empty(self.matrices[i].numel) for i in self.exchange.owned}
        at = 0
        for p in self.exchange.incoming:
            whole[p.matrix].narrow(0, p.start, p.length).copy_(received.narrow(0, at, p.length))
            at += p.length
        out = {}
        for hp, shape, members in self.stacks:
            stack = torch.stack([whole[i] for i in members]).view(len(members), *shape)
            ortho = orthogonalize_stack(
                stack,
                hp.ns_coefficients,
                hp.ns_steps,
                hp.eps,
                overwrite=True,
                dtype=self.newton_schulz_dtype,
                blocks=self.gram_blocks,
            )
            for i, matrix in zip(members, ortho.reshape(len(members), -1).unbind(0)):
                out[i] = matrix
            self.orthogonalized += len(members)
        return out

    def _from_owners(self, ortho: dict[int, Tensor]) -> Tensor:
        """Exchange 2: each piece of the orthogonalised matrices back to the rank whose partition holds it."""
        ex = self.exchange
        send = [ortho[p.matrix].narrow(0, p.start, p.length) for p in ex.incoming]
        send = torch.cat(send) if send else self.params[0].new_empty(0, dtype=self.newton_schulz_dtype)
        received = send.new_empty(sum(ex.outgoing_counts))
        dist.all_to_all_single(received, send, ex.outgoing_counts, ex.incoming_counts, group=self.process_group)
        return received

    def _update(self, received: Tensor, lr_factor: Tensor) -> list[Tensor]:
        """MuonSide's decay and add on each partition: `p * (1 - lr * lr_factor * wd)` (fp64 scalar, rounded once,
        as torch's), then each piece's `add(O * lr_factor, alpha=-adjusted_lr)` with its matrix's shape."""
        lr_factor64 = lr_factor.double()
        new_params = [
            p.float() * decay_factor(hp.lr * hp.weight_decay, lr_factor64) for p, hp in zip(self.params, self.hparams)
        ]
        at = 0
        for p in self.exchange.outgoing:
            target = new_params[self.matrices[p.matrix].part].narrow(0, p.local, p.length)
            target.add_(received.narrow(0, at, p.length).float().mul_(lr_factor), alpha=self.neg_lrs[p.matrix])
            at += p.length
        return new_params
