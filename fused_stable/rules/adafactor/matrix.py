"""Adafactor as a matrix rule: what the fused step (fused_stable/matrix_step.py) calls for its groups (the interface
of rules/muon/matrix.py: check_group, init_state, state_bytes, build).

Its states are torch.optim.Adafactor's, in the param's dtype, shaped by the declaration (`row_var` [..., R, 1] and
`col_var` [..., 1, C] for a >= 2-D param, `variance` like the param below 2-D). state_precision "fp32" only: the
factored moments of a matrix hold R + C values, already a fraction of a percent of its R * C (a 4096 x 4096 matrix:
0.05%), so bf16 or 8-bit would save next to nothing and lose the moments' bits.
"""

from __future__ import annotations

import torch

from . import RULE
from .torch import AdafactorSide


def check_group(group: dict, precision: str) -> None:
    """The state precision and the params an Adafactor group can hold here (torch.optim.Adafactor's checks are the
    declaration's; a key the group lacks is the optimizer's default, filled by torch's add_param_group)."""
    if precision != "fp32":
        raise ValueError(
            f"Adafactor keeps its factored second moments as torch does, in the param's dtype (state_precision "
            f"'fp32'), not {precision!r}: they hold rows + cols values per matrix, so bf16 or 8-bit would save "
            "next to nothing"
        )


def state_shapes(p: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """The declaration's states that apply to a param of this shape, with their shapes."""
    shapes = {state.name: state.shape(tuple(p.shape)) for state in RULE.states}
    return {name: shape for name, shape in shapes.items() if shape is not None}


def init_state(p: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """torch's zero states for the param's rank, in its dtype, on its device."""
    return {name: p.new_zeros(shape) for name, shape in state_shapes(p).items()}


def state_bytes(p: torch.Tensor, group: dict) -> int:
    return sum(torch.Size(shape).numel() for shape in state_shapes(p).values()) * p.element_size()


def build(
    params: list[torch.Tensor], states: list[dict], groups: list[dict], compiled_ops: bool = False
) -> AdafactorSide:
    """The update of `params` (`groups[i]` param i's group, with its base lr: the schedule's factor comes from the
    decisions); `compiled_ops`: the backend runs the compiled CPU ops, so its host path's fp32 matrices take
    cpu_matrix.cpp's op (torch.py)."""
    return AdafactorSide(params, states, groups, compiled_ops)
