"""The Adafactor groups' share of a fused step, on torch tensors: `AdafactorSide`, built once per plan and group
values, stepped with the step's decisions as 0-dim tensors (clip multiplier, skip flag, lr factor).

Two paths, as rules/muon/torch.py's MuonSide:
- decisions on the CPU (`DECIDE_ON_HOST`): their values are host memory, so a skipped step runs nothing and an
  applied one is torch.optim.Adafactor's for-loop step (its default, foreach=None) op for op, its scalars on the
  host in float64 as torch computes them: bit-identical to clip_grad_norm_ + torch.optim.Adafactor on CPU. Where
  the backend runs the compiled CPU ops (`compiled_ops`: the torch backend, built), the contiguous fp32 matrices
  take the compiled op instead (cpu_matrix.cpp beside this file: three passes over each matrix where torch's ops
  make about fifteen; torch's element arithmetic, its reductions summed in fp64 and rounded once, so within the
  last bits of torch's own fp32 sums); vectors, bf16 / fp16 params and other layouts keep torch's for-loop.
- elsewhere (CUDA; tests switch the flag off to run it on CPU): no host read. torch's `.item()` scalars (the step
  count, the param's and the update's norms) stay 0-dim tensors, computed in float64 as torch's host floats;
  every new value is computed out of place and selected with `torch.where(skip, old, new)`, so a skipped step
  leaves every param and state bit-identical whatever the grads hold. The final add is torch's foreach one
  (`update * (-alpha / denom)`, then `p + update`): bit-identical to torch.optim.Adafactor(foreach=True) on CPU
  for fp32 params; bf16 params within an ulp of its for-loop after a step (see `_added`).

One param at a time (torch's for-loop). A param with no element is left alone: torch's step divides by its numel.
eps1 None is each param's dtype's machine epsilon; torch's for-loop takes the first param's of the group for all
(its loop variable), which differs only in a group mixing dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# CPU decisions: branch on the host (see the module doc). Tests switch this off to run the device path on CPU.
DECIDE_ON_HOST = True


@dataclass(frozen=True)
class _Param:
    """One param with its states and its group's values."""

    param: Tensor
    step: Tensor  # the machinery's counter, already advanced for this step when the update runs
    row_var: Tensor | None  # >= 2-D params
    col_var: Tensor | None
    variance: Tensor | None  # 0-D and 1-D params
    lr: float | Tensor  # the group's base lr (the schedule's factor comes with the decisions)
    beta2_decay: float
    eps1: float
    eps2: float
    d: float
    weight_decay: float
    maximize: bool
    sqrt_numel: float  # torch's `numel ** 0.5`

    @property
    def factored(self) -> bool:
        return self.variance is None


def _item(p: Tensor, state: dict, group: dict) -> _Param:
    eps1, eps2 = group["eps"]
    return _Param(
        param=p,
        step=state["step"],
        row_var=state.get("row_var"),
        col_var=state.get("col_var"),
        variance=state.get("variance"),
        lr=group["lr"],
        beta2_decay=group["beta2_decay"],
        eps1=torch.finfo(p.dtype).eps if eps1 is None else eps1,
        eps2=eps2,
        d=group["d"],
        weight_decay=group["weight_decay"],
        maximize=bool(group["maximize"]),
        sqrt_numel=p.numel() ** 0.5,
    )


class AdafactorSide:
    """The Adafactor groups' params and states (updated in place by `step`)."""

    def __init__(
        self, params: Sequence[Tensor], states: Sequence[dict], groups: Sequence[dict], compiled_ops: bool = False
    ) -> None:
        if not len(params) == len(states) == len(groups):
            raise ValueError(f"AdafactorSide: {len(params)} params, {len(states)} states, {len(groups)} groups")
        self.count = len(params)
        # (position in the grads a step is given, the param): params with no element are left alone
        self.items = [(i, _item(p, s, g)) for i, (p, s, g) in enumerate(zip(params, states, groups)) if p.numel()]
        self.compiled_ops = compiled_ops  # the host path's matrices on the compiled op (see the module doc)

    def step(self, grads: Sequence[Tensor], grad_mul: Tensor, skip: Tensor, lr_factor: Tensor) -> None:
        """One step: `grads[i]` is param i's grad, `grad_mul` the clip multiplier over all groups' norm, `skip`
        nonzero to leave every param and state as it is, `lr_factor` the schedule's factor (0-dim tensors)."""
        if len(grads) != self.count or any(g is None for g in grads):
            raise ValueError(f"AdafactorSide.step takes one grad per param ({self.count}), none of them None")
        if DECIDE_ON_HOST and skip.device.type == "cpu":  # a CPU tensor's value is host memory: no wait
            if bool(skip):
                return
            multiplier = None if bool(grad_mul == 1.0) else grad_mul  # x 1.0 changes no bit: no copy of the grads
            factor = float(lr_factor)
            rest = self.items
            if self.compiled_ops:
                rest = compiled_step(self.items, grads, float(grad_mul), factor)
            for index, item in rest:
                _host_step(item, grads[index], multiplier, factor)
            return
        skip = skip != 0
        factor64 = lr_factor.double()
        for index, item in self.items:
            _device_step(item, grads[index], grad_mul, skip, factor64)


def _host_step(it: _Param, grad: Tensor, grad_mul: Tensor | None, lr_factor: float) -> None:
    """torch.optim.Adafactor's for-loop step on one param (its `_single_tensor_adafactor`), host floats included."""
    p = it.param
    g = grad if grad_mul is None else grad * grad_mul  # clip_grad_norm_'s multiply, not written into the grad
    if it.maximize:
        g = -g
    t = float(it.step)
    lr = float(it.lr) * lr_factor
    one_minus_beta2_t = t**it.beta2_decay
    rho_t = min(lr, 1 / (t**0.5))
    alpha = max(it.eps2, p.norm(2).item() / it.sqrt_numel) * rho_t
    if it.weight_decay != 0:
        p.mul_(1 - lr * it.weight_decay)
    if it.factored:
        row_mean = torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1))
        it.row_var.lerp_(row_mean, one_minus_beta2_t)
        col_mean = torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2))
        it.col_var.lerp_(col_mean, one_minus_beta2_t)
        var_estimate = it.row_var @ it.col_var
        var_estimate.div_(it.row_var.mean(dim=-2, keepdim=True).clamp_(min=it.eps1))
    else:
        it.variance.lerp_(g * g, one_minus_beta2_t)
        var_estimate = it.variance.clone()
    update = var_estimate.clamp_(min=it.eps1 * it.eps1).rsqrt_()
    update.mul_(g)
    denom = max(1.0, update.norm(2).item() / (it.sqrt_numel * it.d))
    p.add_(update, alpha=-alpha / denom)


def _fits_the_op(it: _Param, grad: Tensor) -> bool:
    """A param the compiled op takes: a contiguous fp32 CPU matrix (>= 2-D) with contiguous fp32 grad and states."""
    return (
        it.factored
        and it.param.dtype == grad.dtype == torch.float32
        and it.param.device.type == "cpu"
        and it.param.is_contiguous()
        and grad.is_contiguous()
        and it.row_var.is_contiguous()
        and it.col_var.is_contiguous()
    )


def factored_op(params, grads, row_vars, col_vars, scalars: Tensor) -> None:
    """cpu_matrix.cpp's op: the params and their states updated in place (`scalars`: fp64, one row per param)."""
    torch.ops.fused_stable.adafactor_factored(params, grads, row_vars, col_vars, scalars)


def compiled_step(items: list, grads: Sequence[Tensor], grad_mul: float, lr_factor: float) -> list:
    """The host path's step of the params the compiled op takes (`_fits_the_op`), in one call
    (`fused_stable::adafactor_factored`, cpu_matrix.cpp), with `_host_step`'s host scalars; returns the items it left
    to `_host_step`."""
    taken, rest, rows = [], [], []
    for index, it in items:
        grad = grads[index]
        if not _fits_the_op(it, grad):
            rest.append((index, it))
            continue
        t = float(it.step)
        lr = float(it.lr) * lr_factor
        decay = 1 - lr * it.weight_decay if it.weight_decay != 0 else 1.0
        rows.append(
            # cpu_matrix.cpp's Column order
            (
                -grad_mul if it.maximize else grad_mul,
                t**it.beta2_decay,
                it.eps1,
                it.eps2,
                min(lr, 1 / (t**0.5)),
                decay,
                it.sqrt_numel,
                it.d,
            )
        )
        taken.append((it, grad))
    if taken:
        factored_op(
            [it.param for it, _ in taken],
            [grad for _, grad in taken],
            [it.row_var for it, _ in taken],
            [it.col_var for it, _ in taken],
            torch.tensor(rows, dtype=torch.float64),
        )
    return rest


def _lerp(old: Tensor, end: Tensor, weight: Tensor) -> Tensor:
    """`old.lerp_(end, w)` with a float w, out of place, for a 0-dim float64 tensor w: torch's kernel computes a
    bf16 / fp16 lerp in fp32 with the fp32 weight and rounds once, as here."""
    if old.dtype == torch.float32:
        return torch.lerp(old, end, weight.float())
    return torch.lerp(old.float(), end.float(), weight.float()).to(old.dtype)


def _scaled(t: Tensor, factor: Tensor) -> Tensor:
    """`t.mul(s)` with a float s, out of place, for a 0-dim fp32 tensor s: torch multiplies a bf16 / fp16 tensor by a
    float in fp32 and rounds once, as here (a 0-dim tensor factor would be rounded to the tensor's dtype first)."""
    if t.dtype == torch.float32:
        return t * factor
    return (t.float() * factor).to(t.dtype)


def _added(p: Tensor, update: Tensor, alpha: Tensor) -> Tensor:
    """`p + alpha * update` for a 0-dim fp32 alpha. fp32: torch's foreach arithmetic (the update scaled, then added);
    bf16 / fp16: its for-loop's `p.add_(update, alpha=...)` as torch's vectorised CPU loop computes it (alpha
    rounded to the param's dtype, then fp32, rounded once); its scalar loop over a tensor's last few elements
    rounds the product too, so those may differ by an ulp."""
    if p.dtype == torch.float32:
        return p + update * alpha
    return (p.float() + update.float() * alpha.to(p.dtype).float()).to(p.dtype)


def _device_step(it: _Param, grad: Tensor, grad_mul: Tensor, skip: Tensor, lr_factor64: Tensor) -> None:
    """`_host_step`'s arithmetic with no host read (see the module doc): torch's float64 host scalars as 0-dim
    float64 tensors, new values out of place, selected by the skip flag."""
    p = it.param
    g = grad * grad_mul
    if it.maximize:
        g = g.neg_()
    t = it.step.double()
    lr = (it.lr.double() if isinstance(it.lr, Tensor) else it.lr) * lr_factor64
    one_minus_beta2_t = t.pow(it.beta2_decay)
    rho_t = torch.minimum(lr, t.pow(0.5).reciprocal())
    alpha = (p.norm(2).double() / it.sqrt_numel).clamp_(min=it.eps2) * rho_t
    new_p = _scaled(p, (1 - lr * it.weight_decay).float()) if it.weight_decay != 0 else p
    if it.factored:
        row_mean = torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1))
        row_var = _lerp(it.row_var, row_mean, one_minus_beta2_t)
        col_mean = torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2))
        col_var = _lerp(it.col_var, col_mean, one_minus_beta2_t)
        var_estimate = row_var @ col_var
        var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=it.eps1))
        it.row_var.copy_(torch.where(skip, it.row_var, row_var))
        it.col_var.copy_(torch.where(skip, it.col_var, col_var))
    else:
        variance = _lerp(it.variance, g * g, one_minus_beta2_t)
        var_estimate = variance.clone()
        it.variance.copy_(torch.where(skip, it.variance, variance))
    update = var_estimate.clamp_(min=it.eps1 * it.eps1).rsqrt_()
    update.mul_(g)
    denom = (update.norm(2).double() / (it.sqrt_numel * it.d)).clamp_(min=1.0)
    new_p = _added(new_p, update, (-alpha / denom).float())
    p.copy_(torch.where(skip, p, new_p))
