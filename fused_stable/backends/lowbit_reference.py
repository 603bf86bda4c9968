"""The torch backend's AdamW for bf16 and 8-bit state: the update kernel's arithmetic in torch, the reference the
kernels are tested against.

One `LowbitUpdate` per (param group, param dtype, state format) of a plan, built once. A step gathers its
tensors into one padded flat layout, [blocks, QUANT_BLOCK] (each tensor in its state's memory order, which is
its param's when the param is dense, padded with zeros to whole blocks), so the whole group is a fixed number
of torch ops whatever its tensor count: dequantise, AdamW, requantise, scatter back. Every operation is the
update kernel's (kernels/adamw.py), in its order, in fp32 with IEEE division and square root, with the step's
scalars computed as `_step_hyperparameters` computes them; so the same inputs give the same fp32 moments,
codes and scales, except where `exp` (in the bias correction from step 5 on for beta1 = 0.9) rounds otherwise
than the device's, which moves a param by an ulp (docs/optimizer.md, "Low-precision state", says how close the
backends agree). A skipped step writes back what it read: every state tensor and param stays bit-identical.
"""

from __future__ import annotations

import torch

from .. import layout, state_format
from ..layout import HParams
from ..plan import StepPlan
from ..state_format import BF16, Q8, QUANT_BLOCK, sqrt_rn

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


class LowbitUpdate:
    """AdamW for the tensors of one (group, dtype, format) with bf16 or 8-bit moments (see the module doc)."""

    def __init__(self, plan: StepPlan, group: int, indices: list[int] | None, all_indices: list[int], fmt: int):
        self.group, self.indices, self.format = group, indices, fmt
        self.amsgrad = plan.group_amsgrad[group]
        self.params = [plan.local_params[i] for i in all_indices]
        self.masters = [plan.masters[i] for i in all_indices]
        self.has_master = self.masters[0] is not None  # the same for all: the torch backend groups by it
        self.keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.amsgrad else [])
        lists = {"exp_avg": plan.exp_avgs, "exp_avg_sq": plan.exp_avg_sqs, "max_exp_avg_sq": plan.max_exp_avg_sqs}
        self.moments = {key: [lists[key][i] for i in all_indices] for key in self.keys}
        scale_lists = {"exp_avg": plan.exp_avg_scales, "exp_avg_sq": plan.exp_avg_sq_scales}
        scale_lists["max_exp_avg_sq"] = plan.max_exp_avg_sq_scales
        self.scales = {key: [scale_lists[key][i] for i in all_indices] for key in self.keys} if fmt == Q8 else {}
        self.steps = [plan.steps[i] for i in all_indices]
        device = self.params[0].device
        self.flat = _Flat(self.moments["exp_avg"], device)
        # each block's tensor: the per-tensor scalars (bias corrections of each param's own `step`) per block
        counts = torch.tensor(self.flat.blocks, device=device)
        self.block_tensor = torch.repeat_interleave(torch.arange(len(self.params), device=device), counts)
        # bf16 stochastic rounding's keys: each param's position in the optimizer, and each element's index
        self.positions = torch.tensor([plan.positions[i] for i in all_indices], device=device)
        self.block_in_tensor = torch.cat([torch.arange(b, device=device) for b in self.flat.blocks])
        self.lanes = torch.arange(QB, device=device)
        self.row_cache: tuple | None = None

    def __call__(self, grads: list[torch.Tensor], hp: HParams, grad_mul, skip, lr_factor) -> None:
        flat = self.flat
        sources = self.masters if self.has_master else self.params
        p = flat.gather(sources, torch.float32)
        g = flat.gather(grads, torch.float32)
        moments = {key: self._read(key) for key in self.keys}
        scalars = self._step_hyperparameters(hp, grad_mul, lr_factor)
        new_p, new_moments = adamw_block(p, g, moments, scalars, self.amsgrad)
        keep = skip != 0  # a skipped step stores what it read: bit-identical
        if self.has_master:  # the masters get the fp32 result, the params its rounding (the kernel's to_storage)
            flat.scatter(torch.where(keep, p, new_p), self.masters)
            dtype = self.params[0].dtype
            flat.scatter(torch.where(keep, flat.gather(self.params, dtype), new_p.to(dtype)), self.params)
        else:  # rounded to nearest even into a 16-bit param on the way (copy_)
            flat.scatter(torch.where(keep, p, new_p), self.params)
        for key in self.keys:
            self._write(key, new_moments[key], keep)

    def _read(self, key: str) -> torch.Tensor:
        if self.format == BF16:
            return self.flat.gather(self.moments[key], torch.float32)
        codes = self.flat.gather(self.moments[key], torch.int16)  # int8 and uint8 codes fit, padding codes 0
        scale = torch.cat(self.scales[key])
        return state_format.DECODERS[key](codes, scale)

    def _write(self, key: str, value: torch.Tensor, keep: torch.Tensor) -> None:
        if self.format == BF16:
            old = self.flat.gather(self.moments[key], torch.bfloat16)
            rounded = self._round_stochastic(value) if key == "exp_avg_sq" else value.to(torch.bfloat16)
            self.flat.scatter(torch.where(keep, old, rounded), self.moments[key])
            return
        codes, scale = state_format.ENCODERS[key](value)
        old_codes = self.flat.gather(self.moments[key], codes.dtype)
        old_scale = torch.cat(self.scales[key])
        self.flat.scatter(torch.where(keep, old_codes, codes), self.moments[key])
        torch._foreach_copy_(self.scales[key], torch.where(keep, old_scale, scale).split(self.flat.blocks))

    def _round_stochastic(self, value: torch.Tensor) -> torch.Tensor:
        """bf16 exp_avg_sq: stochastic rounding with the kernel's random bits (state_format.random_bits)."""
        keys = state_format.random_key(self.positions, torch.stack(self.steps))[self.block_tensor][:, None]
        elements = self.block_in_tensor[:, None] * QB + self.lanes
        return state_format.round_stochastic_bf16(value, state_format.random_bits(keys, elements))

    def _step_hyperparameters(self, hp: HParams, grad_mul, lr_factor):
        """kernels/adamw.py's `_step_hyperparameters`, per tensor, as [blocks, 1] columns."""
        row = self._row(hp)
        steps = torch.stack(self.steps)[self.block_tensor][:, None]
        lr = row[layout.H_LR] * lr_factor
        decay = 1.0 - lr * row[layout.H_WEIGHT_DECAY]
        signed_grad_mul = grad_mul * row[layout.H_GRAD_SIGN]
        bias_correction1 = -expm1(steps * row[layout.H_LOG_BETA1])
        bias_correction2_sqrt = sqrt_rn(-expm1(steps * row[layout.H_LOG_BETA2]))
        step_size = lr / bias_correction1
        return (
            signed_grad_mul,
            decay,
            row[layout.H_BETA2],
            row[layout.H_ONE_MINUS_BETA1],
            row[layout.H_ONE_MINUS_BETA2],
            row[layout.H_EPS],
            step_size,
            bias_correction2_sqrt,
        )

    def _row(self, hp: HParams) -> torch.Tensor:
        """The group's hyper-parameter row in fp32, as the kernels' table holds it (cached while it stays)."""
        key = (id(hp.lr) if isinstance(hp.lr, torch.Tensor) else hp.lr, *hp[1:])
        if self.row_cache is None or self.row_cache[0] != key:
            row = torch.tensor(layout.hparam_row(*hp), dtype=torch.float32, device=self.params[0].device)
            self.row_cache = (key, row)
        row = self.row_cache[1]
        if isinstance(hp.lr, torch.Tensor):
            row = row.clone()
            row[layout.H_LR] = hp.lr.reshape(()).to(torch.float32)
        return row


def expm1(x: torch.Tensor) -> torch.Tensor:
    """kernels/adamw.py's `_expm1`: a Taylor series below |x| = 0.5, exp(x) - 1 above."""
    tail = 1.0 / 720 + x / 5040.0
    series = x * (1.0 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * tail)))))
    # exp in fp64, rounded: torch's fp32 exp and numpy's (Triton's interpreter) differ in the last bit for ~40% of
    # inputs, the GPU's approximate one otherwise again; this only moves a param by an ulp, never a moment
    return torch.where(x.abs() < 0.5, series, torch.exp(x.double()).to(x.dtype) - 1.0)


def adamw_block(p, g, moments: dict, scalars, amsgrad: bool):
    """kernels/adamw.py's `_adamw_block` on fp32 values: returns the new param and moments (fp32)."""
    grad_mul, decay, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bias_correction2_sqrt = scalars
    g = g * grad_mul
    m, v = moments["exp_avg"], moments["exp_avg_sq"]
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    new = {"exp_avg": m, "exp_avg_sq": v}
    if amsgrad:
        v_max = torch.maximum(moments["max_exp_avg_sq"], v)
        new["max_exp_avg_sq"] = v_max
        denom = sqrt_rn(v_max) / bias_correction2_sqrt + eps
    else:
        denom = sqrt_rn(v) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)
    return p, new
