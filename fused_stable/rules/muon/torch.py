"""The Muon groups' share of a fused step, on torch tensors: `MuonSide`, built once per plan, stepped with the step's
decisions as 0-dim device tensors (clip multiplier, skip flag, lr factor), none of them read on the host.

The update is torch.optim.Muon's, op for op, on each batch of same-shape matrices (newton_schulz.ShapeBatches):
the grads times the clip multiplier (before the momentum, as torch's clip_grad_norm_ then Muon.step), then
`buf.lerp(g, 1 - momentum)`, the Nesterov direction `g.lerp(buf, momentum)` (or `buf`), the batched
Newton-Schulz (bf16, or fp32 on a CPU without bf16 products: newton_schulz.py), `p * (1 - lr * lr_factor *
weight_decay)`, then `add(O * lr_factor, alpha=-adjusted_lr)`.
With fp32 params and buffers this is bit-identical to clip_grad_norm_ + torch.optim.Muon on CPU at
lr_factor = 1 (and at any power of two, which scales exactly): the scalars are torch's, `1 - lr * wd` in fp64.

DTensor params sharded by rows (FSDP2's Shard(0)): the side holds their local rows and buffers and runs every
elementwise op there; only Newton-Schulz needs whole matrices, so `_orthogonalize` sends each batch's directions
to their owner ranks and takes its rows of the result back (fused_stable/matrix_exchange.py). The owner stacks the
same bits one process stacks, so the update is the one-process update bit for bit.

Why stacks rather than foreach lists: Newton-Schulz needs the stack anyway, torch has no foreach `where` (the
skip select), and a stack makes each op one kernel per shape (a Llama has ~5 shapes); the write-backs are one
`_foreach_copy_` per batch. A skipped step (skip != 0) selects the old params and buffers with `torch.where`,
so they stay bit-identical whatever the grads hold (inf, NaN).

Dtypes: params and buffers fp32 or bf16 (or fp16), each independently; everything is computed in fp32 and
rounded once when stored. With bf16 buffers the Nesterov direction reads the stored (rounded) buffer, as torch
does, so bf16 buffers and the orthogonalised update equal torch's; a bf16 param is rounded once where torch
rounds twice (after the decay and after the add), so it differs from torch.optim.Muon by at most ~1 bf16 ulp
per step. No fp32 master copies here (the step's master-weight machinery is rule-free). Hyper-parameters are
read when the side is built: a changed group (lr, momentum, ...) means building a new side, which costs no
tensor work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...matrix_exchange import MatrixExchange, row_shard_dim
from ...sharding import is_dtensor
from ...sharding import local as local_shard
from . import DEFAULTS, adjusted_lr, check_muon_group
from .newton_schulz import (
    ShapeBatches,
    gram_blocks_choice,
    newton_schulz_dtype,
    newton_schulz_work,
    orthogonalize_stack,
)

# On CPU tensors the step branches on the skip decision (a read of host memory, as the torch backend's host
# decisions): nothing runs on a skipped step, an applied one updates in place. Elsewhere (CUDA, meta) every step
# computes and selects with torch.where, reading nothing. Tests switch this off to run the device path on CPU.
DECIDE_ON_HOST = True


@dataclass(frozen=True)
class MuonHparams:
    """One Muon group's hyper-parameters (torch.optim.Muon's keywords), checked, missing ones at torch's defaults."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    eps: float
    ns_steps: int
    adjust_lr_fn: str | None

    @classmethod
    def from_group(cls, group: Mapping) -> MuonHparams:
        values = {key: group.get(key, default) for key, default in DEFAULTS.items()}
        check_muon_group(values)
        values["ns_coefficients"] = tuple(float(c) for c in values["ns_coefficients"])
        return cls(**values)


@dataclass(frozen=True)
class _Batch:
    """Matrices of one shape and one group's hyper-parameters, params and buffers each of one dtype."""

    indices: tuple[int, ...]  # positions in the side's lists (and in the grads a step is given)
    params: list[Tensor]
    buffers: list[Tensor]
    hparams: MuonHparams
    neg_adjusted_lr: float  # -adjusted_lr(lr, adjust_lr_fn, shape): the add's alpha, as torch passes it
    in_place: bool  # fp32 params and buffers: an applied step on host decisions updates them in place
    newton_schulz_dtype: torch.dtype  # resolved once, when the side is built (newton_schulz.py: by device)
    gram_blocks: bool  # the Gram products by row blocks: resolved once, as the dtype (newton_schulz.py)
    exchange: MatrixExchange | None  # row shards (FSDP2): Newton-Schulz at each matrix's owner rank


def _exchanges(params) -> list[MatrixExchange | None]:
    """Each param's exchange: one per process group of row shards (FSDP2's Shard(0) DTensors), None for a param
    that is whole on this rank (plain, replicated, or a shard dim of one rank)."""
    keyed: dict[tuple, dict[int, tuple]] = {}
    for i, p in enumerate(params):
        mesh_dim = row_shard_dim(p, f"Muon param {i}")
        if mesh_dim is not None:
            keyed.setdefault((p.device_mesh, mesh_dim), {})[i] = tuple(p.shape)
    exchanges: list[MatrixExchange | None] = [None] * len(params)
    for shapes in keyed.values():
        exchange = MatrixExchange.of_param(params[next(iter(shapes))], shapes, newton_schulz_work)
        for i in shapes:
            exchanges[i] = exchange
    return exchanges


def _batches(params, buffers, hparams, max_matrices) -> list[_Batch]:
    """Batches of the (global) params' matrices; each batch holds the local params and buffers it updates."""
    exchanges = _exchanges(params)
    keyed: dict[tuple, list[int]] = {}
    for i, (p, buf, hp) in enumerate(zip(params, buffers, hparams)):
        keyed.setdefault((hp, p.dtype, buf.dtype, p.device, id(exchanges[i])), []).append(i)
    batches = []
    for (hp, _, buffer_dtype, _, _), members in keyed.items():
        shapes = ShapeBatches([params[i].shape for i in members], max_matrices)
        for shape, local in shapes.batches:
            indices = tuple(members[j] for j in local)
            batches.append(
                _Batch(
                    indices=indices,
                    params=[local_shard(params[i]) for i in indices],
                    buffers=[local_shard(buffers[i]) for i in indices],
                    hparams=hp,
                    neg_adjusted_lr=-adjusted_lr(hp.lr, hp.adjust_lr_fn, shape),
                    in_place=buffer_dtype == torch.float32 and params[indices[0]].dtype == torch.float32,
                    newton_schulz_dtype=newton_schulz_dtype(params[indices[0]].device),
                    gram_blocks=_gram_blocks(params[indices[0]].device),
                    exchange=exchanges[indices[0]],
                )
            )
    return batches


def _gram_blocks(device: torch.device) -> bool:
    return gram_blocks_choice(device, newton_schulz_dtype(device))[0]


def _check_lists(params, buffers, hparams) -> None:
    if not len(params) == len(buffers) == len(hparams):
        raise ValueError(f"MuonSide: {len(params)} params, {len(buffers)} buffers, {len(hparams)} hparams")
    check_muon_group({"params": params})
    for i, (p, buf) in enumerate(zip(params, buffers)):
        if buf.shape != p.shape or buf.device != p.device or not buf.is_floating_point():
            raise ValueError(
                f"MuonSide: buffer {i} ({buf.dtype} {tuple(buf.shape)} on {buf.device}) does not match its param "
                f"({p.dtype} {tuple(p.shape)} on {p.device})"
            )


class MuonSide:
    """The Muon groups' params and momentum buffers (updated in place by `step`), batched once by group, dtype and
    shape. `hparams[i]` is param i's group (a mapping with torch.optim.Muon's keywords) or a MuonHparams; batches
    of more than `max_matrices` matrices of one shape are cut, to bound the stacks' memory."""

    def __init__(
        self,
        params: Sequence[Tensor],
        buffers: Sequence[Tensor],
        hparams: Sequence[Mapping | MuonHparams],
        *,
        max_matrices: int | None = None,
    ):
        _check_lists(params, buffers, hparams)
        converted: dict[int, MuonHparams] = {}  # the groups are shared by many params: check each once
        rows = [
            h if isinstance(h, MuonHparams) else converted.setdefault(id(h), MuonHparams.from_group(h)) for h in hparams
        ]
        self.params = list(params)
        self.buffers = list(buffers)
        self.batches = _batches(self.params, self.buffers, rows, max_matrices)
        self._dtensor_grads = any(is_dtensor(p) for p in self.params)  # FSDP2: the step reads their local shards
        self._decay_products = {hp: hp.lr * hp.weight_decay for hp in rows}  # torch's `lr * weight_decay`, fp64

    def step(self, grads: Sequence[Tensor], grad_mul: Tensor, skip: Tensor, lr_factor: Tensor) -> None:
        """One step: `grads[i]` is param i's grad; `grad_mul` the clip multiplier over all groups' norm, `skip`
        nonzero to leave every param and buffer as it is, `lr_factor` the schedule's factor (0-dim device tensors,
        never read here)."""
        if len(grads) != len(self.params) or any(g is None for g in grads):
            raise ValueError(f"MuonSide.step takes one grad per param ({len(self.params)}), none of them None")
        if self._dtensor_grads:
            grads = [local_shard(g) for g in grads]
        on_host = DECIDE_ON_HOST and skip.device.type == "cpu"
        if on_host and bool(skip):  # a CPU tensor's value is host memory: reading it waits for nothing
            return
        skip = skip != 0
        lr_factor64 = lr_factor.double()
        decays = {hp: decay_factor(product, lr_factor64) for hp, product in self._decay_products.items()}
        for batch in self.batches:
            if on_host and batch.in_place:
                _step_batch_in_place(batch, grads, grad_mul, lr_factor, decays[batch.hparams])
            else:
                _step_batch(batch, grads, grad_mul, skip, lr_factor, decays[batch.hparams])


def decay_factor(lr_times_weight_decay: float, lr_factor64: Tensor) -> Tensor:
    """The params' decay `1 - lr * lr_factor * weight_decay`: torch computes `1 - lr * wd` in fp64 on the host and
    rounds it once; the same in fp64 on the device, with the schedule's factor (`lr_factor64`, fp64)."""
    return (1.0 - lr_times_weight_decay * lr_factor64).float()


def momentum_and_direction(g: Tensor, old_buffers: Tensor, hp: MuonHparams, stored: torch.dtype):
    """torch.optim.Muon's momentum and update direction in fp32, from the clipped fp32 grads and buffers:
    `B = B.lerp(g, 1 - momentum)` (rounded to the `stored` dtype and back when the buffers are kept below fp32:
    Nesterov reads the stored value, as torch does), `U = g.lerp(B, momentum)` with Nesterov, else `B`. Elementwise:
    the same bits on a stack of whole matrices and on any piece of them (FSDP2's rows, DeepSpeed's partitions)."""
    buffers = old_buffers.lerp(g, 1 - hp.momentum)
    if stored != torch.float32:
        buffers = buffers.to(stored).float()
    return buffers, (g.lerp(buffers, hp.momentum) if hp.nesterov else buffers)


def _newton_schulz_stack(tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The batch's directions as one stack in the Newton-Schulz dtype, each cast once: Newton-Schulz's first op is
    that cast, so this is the stack it would make from an fp32 one (the same bits), without writing and reading
    the fp32 stack."""
    stack = tensors[0].new_empty((len(tensors), *tensors[0].shape), dtype=dtype)
    torch._foreach_copy_(list(stack.unbind(0)), tensors)
    return stack


def _orthogonalize(batch: _Batch, directions: Tensor, *, temporary: bool = False) -> Tensor:
    """Newton-Schulz of the batch's directions (n, rows, cols): here, or, for row shards, at each matrix's owner
    rank on the whole matrix (matrix_exchange.py), each rank getting its rows of the result back. `temporary`:
    the stack is the step's own, divided in place."""
    hp, dtype, blocks = batch.hparams, batch.newton_schulz_dtype, batch.gram_blocks
    if batch.exchange is None:
        return orthogonalize_stack(
            directions, hp.ns_coefficients, hp.ns_steps, hp.eps, overwrite=temporary, dtype=dtype, blocks=blocks
        )
    # the Newton-Schulz dtype on the wire: its first op is that cast, so the owner orthogonalises the same bits
    return batch.exchange.apply(
        batch.indices,
        directions.to(dtype),
        lambda whole: orthogonalize_stack(
            whole, hp.ns_coefficients, hp.ns_steps, hp.eps, overwrite=True, dtype=dtype, blocks=blocks
        ),
    )


def _step_batch_in_place(batch: _Batch, grads, grad_mul: Tensor, lr_factor: Tensor, decay: Tensor) -> None:
    """An applied step on fp32 params, buffers and grads, updated in place (`_step_batch`'s arithmetic without its
    stacks of the old values and their selects: what torch.optim.Muon does, and what the host decisions allow,
    the skip being known): the same bits, some 60 bytes per param fewer."""
    hp = batch.hparams
    g = [grads[i] for i in batch.indices]
    if bool(grad_mul != 1.0):  # unclipped and unscaled: no copy of the grads (x 1.0 changes no bit)
        g = torch._foreach_mul(g, grad_mul)
    torch._foreach_lerp_(batch.buffers, g, 1 - hp.momentum)
    update = torch._foreach_lerp(g, batch.buffers, hp.momentum) if hp.nesterov else batch.buffers
    del g
    ortho = _orthogonalize(batch, _newton_schulz_stack(list(update), batch.newton_schulz_dtype), temporary=True)
    del update
    torch._foreach_mul_(batch.params, decay)
    if bool(lr_factor != 1.0):  # a schedule's factor, in fp32 as the device path applies it
        ortho = ortho.float().mul_(lr_factor)
    # else the result itself: the add widens a bf16 one exactly, as torch's `param.add_(update, alpha=-lr)` does
    torch._foreach_add_(batch.params, list(ortho.unbind(0)), alpha=batch.neg_adjusted_lr)


def _step_batch(batch: _Batch, grads, grad_mul: Tensor, skip: Tensor, lr_factor: Tensor, decay: Tensor) -> None:
    hp = batch.hparams
    g = torch.stack([grads[i] for i in batch.indices]).float() * grad_mul
    old_buffers = torch.stack(batch.buffers).float()
    buffers, update = momentum_and_direction(g, old_buffers, hp, batch.buffers[0].dtype)
    del g
    ortho = _orthogonalize(batch, update)
    del update
    old_params = torch.stack(batch.params).float()
    params = (old_params * decay).add_(ortho.float().mul_(lr_factor), alpha=batch.neg_adjusted_lr)
    torch._foreach_copy_(batch.buffers, list(torch.where(skip, old_buffers, buffers).unbind(0)))
    torch._foreach_copy_(batch.params, list(torch.where(skip, old_params, params).unbind(0)))
