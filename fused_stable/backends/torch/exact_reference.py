"""The torch backend's exact reference of the update kernel, for any rule and state format (the door of bf16 and
8-bit state, and of a rule without faster doors): the kernel's arithmetic in torch, op for op, the reference the
kernels are tested against.

One `ExactUpdate` per (param group, param dtype, state format) of a plan, built once. A step gathers its
tensors into one padded flat layout, [blocks, QUANT_BLOCK] (each tensor in its state's memory order, which is
its param's when the param is dense, padded with zeros to whole blocks), so the whole group is a fixed number
of torch ops whatever its tensor count: dequantise, the rule's element, requantise, scatter back. Every
operation is the update kernel's (kernels/update.py), in its order, in fp32 with IEEE division and square root,
with the rule's `step_scalars` and element in torch (rules/adamw/torch.py, beside the kernel's triton.py); so
the same inputs give the same fp32 moments, codes and scales, except where `exp` (in the bias correction from
step 5 on for beta1 = 0.9) rounds otherwise than the device's, which moves a param by an ulp (docs/optimizer.md,
"Low-precision state", says how close the backends agree). A skipped step writes back what it read: every state
tensor and param stays bit-identical.
"""

from __future__ import annotations

from importlib import import_module

import torch

from ... import layout, state_format
from ...plan import StepPlan
from ...state_format import BF16, FP32, Q8, QUANT_BLOCK

QB = QUANT_BLOCK


class _Flat:
    """Tensors of one update in the padded flat layout: how to gather them and where to scatter them back."""

    def __init__(self, like: list[torch.Tensor], device: torch.device) -> None:
        self.orders = [state_format.memory_order(t) for t in like]  # the states' memory order, the blocks' order
        self.numels = [t.numel() for t in like]
        self.blocks = [state_format.num_blocks(n) for n in self.numels]
        self.padded = [b * QB for b in self.blocks]
        self.pads = [p - n for p, n in zip(self.padded, self.numels)]
        self.num_blocks = sum(self.blocks)
        self.shapes = [tuple(t.permute(order).shape) for t, order in zip(like, self.orders)]
        self.zero = {}  # dtype -> zeros for the padding
        self.device = device

    def gather(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """[num_blocks, QB] in `dtype`: each tensor in its state's memory order, zero-padded to whole blocks."""
        zero = self.zero.get(dtype)
        if zero is None:
            zero = self.zero[dtype] = torch.zeros(QB, dtype=dtype, device=self.device)
        pieces = []
        for t, order, pad in zip(tensors, self.orders, self.pads):
            pieces.append(state_format.flat(t, order).to(dtype))
            if pad:
                pieces.append(zero[:pad])
        return torch.cat(pieces).view(self.num_blocks, QB)

    def scatter(self, values: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """Writes [num_blocks, QB] back into `targets` (cast to their dtypes, padding dropped)."""
        pieces = values.view(-1).split(self.padded)
        views = [t.permute(order) for t, order in zip(targets, self.orders)]
        sources = [piece[:n].view(shape) for piece, n, shape in zip(pieces, self.numels, self.shapes)]
        torch._foreach_copy_(views, sources)


class ExactUpdate:
    """The update door of the tensors of one (group, dtype, format), for any rule and state format (see the module
    doc); it takes the decisions as 0-dim tensors, on either kind of step (torch_backend.py, `Update`)."""

    advances_steps = False  # the backend advances the `step` counters first
    reads_grad_divisor = False

    def __init__(self, plan: StepPlan, group: int, indices: list[int] | None, all_indices: list[int], fmt: int):
        self.group, self.indices, self.format = group, indices, fmt
        self.rule, self.option = plan.rule, plan.group_options[group]
        self.language = import_module(plan.rule.package + ".torch")  # the rule's step_scalars and element
        self.params = [plan.local_params[i] for i in all_indices]
        self.masters = [plan.masters[i] for i in all_indices]
        self.has_master = self.masters[0] is not None  # the same for all: the torch backend groups by it
        self.keys = list(plan.rule.state_names(self.option))
        self.moments = {key: [plan.states[i][slot] for i in all_indices] for slot, key in enumerate(self.keys)}
        self.scales = (
            {key: [plan.scales[i][slot] for i in all_indices] for slot, key in enumerate(self.keys)}
            if fmt == Q8
            else {}
        )
        self.steps = [plan.steps[i] for i in all_indices]
        device = self.params[0].device
        # the blocks follow the first state's memory order (the params' for a rule keeping no state for this group)
        self.flat = _Flat(self.moments[self.keys[0]] if self.keys else self.params, device)
        # each block's tensor: the per-tensor scalars (bias corrections of each param's own `step`) per block
        counts = torch.tensor(self.flat.blocks, device=device)
        self.block_tensor = torch.repeat_interleave(torch.arange(len(self.params), device=device), counts)
        # bf16 stochastic rounding's keys: each param's position in the optimizer, and each element's index
        self.positions = torch.tensor([plan.positions[i] for i in all_indices], device=device)
        # and each block's first element's index in its whole param (a shard's offset added: sharding.element_offset)
        block_in_tensor = torch.cat([torch.arange(b, device=device) for b in self.flat.blocks])
        offsets = torch.tensor([plan.element_offsets[i] for i in all_indices], dtype=torch.int64, device=device)
        self.block_first = block_in_tensor * QB + offsets[self.block_tensor]
        self.lanes = torch.arange(QB, device=device)
        self.row_cache: tuple | None = None

    def __call__(self, grads: list[torch.Tensor], hp, grad_mul, skip, lr_factor) -> None:
        flat = self.flat
        sources = self.masters if self.has_master else self.params
        p = flat.gather(sources, torch.float32)
        g = flat.gather(grads, torch.float32)
        moments = [self._read(key) for key in self.keys]
        scalars = self._step_scalars(hp, grad_mul, lr_factor)
        slots = (moments or [p])[:1] * 3  # the kernel's three slots: unused ones stand in (left alone by the element)
        slots[: len(moments)] = moments
        new_p, *new_moments = self.language.element(p, g, *slots, scalars, self.option)
        keep = skip != 0  # a skipped step stores what it read: bit-identical
        if self.has_master:  # the masters get the fp32 result, the params its rounding (the kernel's to_storage)
            flat.scatter(torch.where(keep, p, new_p), self.masters)
            dtype = self.params[0].dtype
            flat.scatter(torch.where(keep, flat.gather(self.params, dtype), new_p.to(dtype)), self.params)
        else:  # rounded to nearest even into a 16-bit param on the way (copy_)
            flat.scatter(torch.where(keep, p, new_p), self.params)
        for key, value in zip(self.keys, new_moments):
            self._write(key, value, keep)

    def on_host(self, grads: list[torch.Tensor], hp, grad_mul, lr_factor, grad_divisor) -> None:
        """The host decisions of an applied step (`Update.on_host`), as the 0-dim tensors this takes."""
        scalars = [torch.tensor(float(x), dtype=torch.float32) for x in (grad_mul, 0.0, lr_factor)]
        self(grads, hp, *scalars)

    def on_tensors(self, grads: list[torch.Tensor], hp, grad_mul, skip, lr_factor, grad_divisor) -> None:
        self(grads, hp, grad_mul, skip, lr_factor)

    def _read(self, key: str) -> torch.Tensor:
        if self.format in (FP32, BF16):
            return self.flat.gather(self.moments[key], torch.float32)
        codes = self.flat.gather(self.moments[key], torch.int16)  # int8 and uint8 codes fit, padding codes 0
        scale = torch.cat(self.scales[key])
        return state_format.DECODERS[self.rule.codecs[key]](codes, scale)

    def _write(self, key: str, value: torch.Tensor, keep: torch.Tensor) -> None:
        if self.format == FP32:
            old = self.flat.gather(self.moments[key], torch.float32)
            self.flat.scatter(torch.where(keep, old, value), self.moments[key])
            return
        if self.format == BF16:
            old = self.flat.gather(self.moments[key], torch.bfloat16)
            stochastic = key in self.rule.stochastic_bf16
            rounded = self._round_stochastic(value) if stochastic else value.to(torch.bfloat16)
            self.flat.scatter(torch.where(keep, old, rounded), self.moments[key])
            return
        codes, scale = state_format.ENCODERS[self.rule.codecs[key]](value)
        old_codes = self.flat.gather(self.moments[key], codes.dtype)
        old_scale = torch.cat(self.scales[key])
        self.flat.scatter(torch.where(keep, old_codes, codes), self.moments[key])
        torch._foreach_copy_(self.scales[key], torch.where(keep, old_scale, scale).split(self.flat.blocks))

    def _round_stochastic(self, value: torch.Tensor) -> torch.Tensor:
        """bf16 states the rule rounds stochastically (AdamW's exp_avg_sq), with the kernel's random bits
        (state_format.random_bits)."""
        keys = state_format.random_key(self.positions, torch.stack(self.steps))[self.block_tensor][:, None]
        elements = self.block_first[:, None] + self.lanes
        return state_format.round_stochastic_bf16(value, state_format.random_bits(keys, elements))

    def _step_scalars(self, hp, grad_mul, lr_factor):
        """The rule's `step_scalars`, per tensor, as [blocks, 1] columns (each block's own `step`)."""
        steps = torch.stack(self.steps)[self.block_tensor][:, None]
        return self.language.step_scalars(self.hparam_row(hp), steps, grad_mul, lr_factor)

    def hparam_row(self, hp) -> torch.Tensor:
        """The group's hyper-parameter row in fp32, as the kernels' table holds it (cached while it stays)."""
        key = (id(hp.lr) if isinstance(hp.lr, torch.Tensor) else hp.lr, *hp[1:])
        if self.row_cache is None or self.row_cache[0] != key:
            row = torch.tensor(self.rule.hparam_row(*hp), dtype=torch.float32, device=self.params[0].device)
            self.row_cache = (key, row)
        row = self.row_cache[1]
        if isinstance(hp.lr, torch.Tensor):
            row = row.clone()
            row[layout.H_LR] = hp.lr.reshape(()).to(torch.float32)
        return row
