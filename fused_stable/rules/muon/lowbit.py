"""8-bit Muon momentum (a Muon group with state_precision="8bit"): the momentum buffer of a matrix of at least
state_format.MIN_QUANTISED_NUMEL elements is stored in format Q8, AdamW's `exp_avg` codec (state_format.py: signed
blockwise v2 codes), under torch's key: `momentum_buffer` holds the int8 codes laid out like the param and
`momentum_buffer_scale` one fp32 scale per QUANT_BLOCK elements (a smaller matrix keeps an fp32 buffer, as AdamW's
small tensors do in an 8-bit group).

A step decodes every coded buffer to fp32 (state_format.decode), runs torch.optim.Muon's arithmetic on the fp32
buffers (`MuonSide`, the fp32/bf16 path unchanged), then encodes once (state_format.encode): the same codes the
AdamW backends write for the same fp32 values. A skipped step leaves codes and scales bit-identical: on host
decisions nothing runs; on device decisions the new codes and scales are selected with torch.where against the old
ones (re-encoding a decoded buffer need not give its codes back). The fp32 buffers live for the step only: between
steps a coded matrix holds 1 byte per element plus 4 per block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ... import state_format
from . import torch as muon_torch
from .experts import muon_update
from .torch import MuonHparams

KEY = "momentum_buffer"  # torch.optim.Muon's key: the codes in Q8, the buffer otherwise
SCALE_KEY = KEY + state_format.SCALE_SUFFIX


def is_coded(state: Mapping) -> bool:
    """Whether a param's Muon state holds 8-bit codes (and their scales)."""
    return state_format.moment_format(state[KEY]) == state_format.Q8


class CodedMomentum:
    """The Muon step (`MuonSide`, or `ExpertStacks` with 3-D params) over params of which some keep their momentum
    as Q8 codes (see the module doc); built once per plan like MuonSide, the fp32 buffers decoded anew each step."""

    def __init__(self, params: Sequence[Tensor], states: Sequence[Mapping], groups: Sequence[Mapping]) -> None:
        converted: dict[int, MuonHparams] = {}  # check each group's hyper-parameters once, not every step
        self.rows = [converted.setdefault(id(g), MuonHparams.from_group(g)) for g in groups]
        self.params = list(params)
        self.buffers = [state[KEY] for state in states]  # the coded ones replaced by their decoding each step
        self.coded = [i for i, state in enumerate(states) if is_coded(state)]
        self.codes = [states[i][KEY] for i in self.coded]
        self.scales = [states[i][SCALE_KEY] for i in self.coded]
        for i, scale in zip(self.coded, self.scales):
            if scale.numel() != state_format.num_blocks(self.params[i].numel()):
                raise ValueError(f"CodedMomentum: param {i}'s {SCALE_KEY} does not hold one scale per block")

    def step(self, grads: Sequence[Tensor], grad_mul: Tensor, skip: Tensor, lr_factor: Tensor) -> None:
        """MuonSide.step's contract: the decisions are 0-dim device tensors, never read but on the CPU."""
        on_host = muon_torch.DECIDE_ON_HOST and skip.device.type == "cpu"
        if on_host and bool(skip):  # host memory: a skipped step touches nothing
            return
        decoded = [state_format.decode(c, s, KEY) for c, s in zip(self.codes, self.scales)]
        buffers = list(self.buffers)
        for i, value in zip(self.coded, decoded):
            buffers[i] = value
        muon_update(self.params, buffers, self.rows).step(grads, grad_mul, skip, lr_factor)
        keep = skip != 0
        for codes, scale, value in zip(self.codes, self.scales, decoded):
            new_codes, new_scale = state_format.encode(value, KEY, like=codes)
            if on_host:
                codes.copy_(new_codes)
                scale.copy_(new_scale)
            else:
                codes.copy_(torch.where(keep, codes, new_codes))
                scale.copy_(torch.where(keep, scale, new_scale))
