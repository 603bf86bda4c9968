"""3-D Muon params (transformers 5's MoE experts: experts x out x in) stepped as their experts' 2-D matrices.

`muon_update` is MuonSide over 2-D params, and `ExpertStacks` where some are 3-D: a MuonSide over every matrix as
a 2-D view of its param and momentum buffer (`unbind(0)`: in-place updates land in the stack), given the grads'
views each step. Each expert is then exactly torch.optim.Muon's 2-D param: its own Newton-Schulz, its lr adjusted
by its out x in, batched with the other matrices of its shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .torch import MuonHparams, MuonSide


def muon_update(
    params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], hparams: Sequence[Mapping | MuonHparams]
) -> MuonSide | ExpertStacks:
    """The Muon update of `params` (2-D matrices or 3-D stacks of them) with their momentum `buffers`."""
    if all(p.ndim == 2 for p in params):
        return MuonSide(params, buffers, hparams)
    counts = [p.shape[0] if p.ndim == 3 else 1 for p in params]
    matrices = MuonSide(
        _matrices([p.detach() for p in params]),
        _matrices(buffers),
        [h for h, count in zip(hparams, counts) for _ in range(count)],
    )
    return ExpertStacks(matrices)


def _matrices(tensors) -> list[torch.Tensor]:
    """Each 2-D tensor, and each 3-D one as its matrices: views (`unbind(0)`), so in-place updates land in it."""
    return [m for t in tensors for m in (t.unbind(0) if t is not None and t.ndim == 3 else (t,))]


class ExpertStacks:
    """MuonSide's step over params some of which are 3-D stacks of matrices (see the module doc)."""

    def __init__(self, matrices: MuonSide) -> None:
        self.matrices = matrices

    def step(self, grads, grad_mul: torch.Tensor, skip: torch.Tensor, lr_factor: torch.Tensor) -> None:
        self.matrices.step(_matrices(grads), grad_mul, skip, lr_factor)
