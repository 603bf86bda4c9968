"""The fused step with torch's own multi-tensor ops (backend "torch", the default for CPU tensors).

`torch._foreach_norm` (fp32 accumulation) for the norm, the decision kernel's sections (`decide`: the functions
below it carry the names of kernels/decide.py's jit helpers, in the same order), `torch._foreach_add_` on the
step counters and `torch._fused_adamw_`, and no `_foreach_mul_` clip pass. On CPU tensors the decisions run on
host scalars with the kernel's rounding (a CPU tensor's value is host memory: the read waits for nothing), and
the update branches on them: no update on a skipped step, no `grad_scale` when the grads are not scaled (32
bytes per fp32 parameter instead of torch's 40; 36 when clipped, as torch's CPU kernel writes the scaled grads
back). Elsewhere (meta, CUDA) the same sections run as 0-dim tensor ops, with a device `grad_scale` (= loss
scale / clip coefficient) and `found_inf` (= skip) for `_fused_adamw_`: no host reads. docs/design.md, "The
torch backend", says where the CPU step's time goes.

`TorchLists` is this backend's side of a StepPlan, built once per plan: the per-dtype and per-(group, dtype)
lists `_fused_adamw_` takes, the index tensors that put per-tensor norms back in parameter order, and fp32
working copies for low-precision params (whose moments are fp32).

torch's CPU `_fused_adamw_` walks every tensor of a call as flat memory in the param's order, so it is wrong
for a param that is not dense, or whose grad or state tensors are laid out differently (a transposed grad):
those tensors go through contiguous fp32 working copies (copied in and back around the same call), which is
exact, and costs a copy only for them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import layout
from ..kernels.tables import upload_int64
from ..layout import HParams, StepBuffers, StepRules
from ..plan import StepPlan, is_dense
from ..state_format import FP32
from .lowbit_reference import LowbitUpdate

DENSE_LAYOUTS = False  # tensors of any layout go through working copies (fused_stable.backends.Backend)


def layout_fits_fused_adamw(tensors: list[torch.Tensor | None]) -> bool:
    """Whether `_fused_adamw_` may walk these tensors (param first, then its grad and states) as flat memory."""
    param = tensors[0]
    if param.numel() <= 1:
        return True
    strides = param.stride()
    return is_dense(param) and all(t is None or t.stride() == strides for t in tensors[1:])


class _Update:
    """One `_fused_adamw_` call: the tensors of one param group and dtype (and layout class), the working
    copies it updates instead of the params when they need one, and the copies in and back."""

    __slots__ = (
        "group",
        "amsgrad",
        "indices",
        "params",
        "exp_avgs",
        "exp_avg_sqs",
        "max_exp_avg_sqs",
        "steps",
        "grads32",
        "copy_in",
        "copy_out",
    )

    def __init__(self, plan: StepPlan, group: int, indices: list[int] | None, all_indices: list[int], relayout: bool):
        params = [plan.local_params[i] for i in all_indices]
        masters = [plan.masters[i] for i in all_indices]
        self.group, self.indices = group, indices
        self.amsgrad = plan.group_amsgrad[group]
        self.steps = [plan.steps[i] for i in all_indices]
        self.exp_avgs = [plan.exp_avgs[i] for i in all_indices]
        self.exp_avg_sqs = [plan.exp_avg_sqs[i] for i in all_indices]
        self.max_exp_avg_sqs = [plan.max_exp_avg_sqs[i] for i in all_indices] if self.amsgrad else []
        self.params, self.grads32, self.copy_in, self.copy_out = params, None, None, None
        dtype = params[0].dtype
        if relayout:  # every tensor of the update as a contiguous fp32 copy, copied in before and back after
            # the param's value comes from its fp32 master when it has one
            sources = [m if m is not None else p for m, p in zip(masters, params)]
            states = self.exp_avgs + self.exp_avg_sqs + self.max_exp_avg_sqs
            work = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in sources + states]
            n = len(params)
            self.params = work[:n]
            self.grads32 = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in params]
            self.exp_avgs, self.exp_avg_sqs = work[n : 2 * n], work[2 * n : 3 * n]
            self.max_exp_avg_sqs = work[3 * n :]
            self.copy_in = (work, sources + states)
            targets = params + [m for m in masters if m is not None] + states
            self.copy_out = (targets, work[:n] + [w for w, m in zip(work[:n], masters) if m is not None] + work[n:])
        elif dtype != torch.float32:  # _fused_adamw_ wants one dtype: fp32 copies (or the masters) for the update
            # persistent buffers, filled with _foreach_copy_ each step: fresh .float() copies cost an
            # allocation and page faults per step (several times the update itself on CPU)
            copies = [m if m is not None else torch.empty_like(p, dtype=torch.float32) for m, p in zip(masters, params)]
            refill = [(c, p) for c, p, m in zip(copies, params, masters) if m is None]
            self.grads32 = [torch.empty_like(p, dtype=torch.float32) for p in params]
            self.copy_in = ([c for c, _ in refill], [p for _, p in refill]) if refill else None
            self.copy_out = (params, copies)
            self.params = copies


class TorchLists:
    """Per-plan lists for the torch backend (see the module doc)."""

    def __init__(self, plan: StepPlan, grads: list[torch.Tensor], device: torch.device) -> None:
        by_dtype: dict[torch.dtype, list[int]] = {}
        by_update: dict[tuple, list[int]] = {}
        for index, (group, param, fmt) in enumerate(zip(plan.groups, plan.local_params, plan.formats)):
            by_dtype.setdefault(param.dtype, []).append(index)
            if fmt != FP32:  # bf16 or 8-bit moments: lowbit_reference, which takes any layout
                key = (group, param.dtype, plan.masters[index] is not None, fmt)
                by_update.setdefault(key, []).append(index)
                continue
            tensors = [
                param,
                grads[index],
                plan.exp_avgs[index],
                plan.exp_avg_sqs[index],
                plan.masters[index],
                plan.max_exp_avg_sqs[index],
            ]
            relayout = not layout_fits_fused_adamw(tensors)
            by_update.setdefault((group, param.dtype, relayout, FP32), []).append(index)
        everything = list(range(len(plan.local_params)))
        # None stands for "all of them, in order": the usual single dtype and group needs no per-step gathering
        self.norm_indices = [None if indices == everything else indices for indices in by_dtype.values()]
        order = [i for indices in by_dtype.values() for i in indices]
        self.order = upload_int64(order, device) if len(by_dtype) > 1 else None
        self.positions = upload_int64(plan.positions, device)
        self.all_positions = plan.members is None  # the plan holds every param, in order: positions is the identity
        self.per_tensor_sumsq: torch.Tensor | None = None
        self.lrs_key: tuple | None = None  # the groups' lrs that `base_lrs` holds (floats by value, tensors by id)
        self.base_lrs: torch.Tensor | None = None
        self.steps = plan.steps
        self.meta = device.type == "meta"  # no values: nothing to compute, and nothing may be read
        self.cpu = device.type == "cpu"  # the decisions may run on host scalars (`on_host`)
        self.grad_divisor = torch.ones((), dtype=torch.float32, device=device)  # the host path's grad_scale
        self.host_views: tuple | None = None  # (fstate, istate, numpy arrays on them): host_scalars
        self.updates = [
            _Update(plan, group, None if indices == everything else indices, indices, relayout)
            if fmt == FP32
            else LowbitUpdate(plan, group, None if indices == everything else indices, indices, fmt)
            for (group, _, relayout, fmt), indices in by_update.items()
        ]


def fused_step(
    plan: StepPlan,
    grads: list[torch.Tensor],
    buffers: StepBuffers,
    rules: StepRules,
    hparams: list[HParams],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    global_sumsq,
) -> None:
    """The norm, the decisions and AdamW for every tensor of `plan` (`fused_stable.backends.Backend.fused_step`),
    in the order of the Triton path: norm pass, decision kernel, update. On CPU tensors the decisions run on
    host scalars (`on_host`); elsewhere (meta, or CUDA tensors given this backend) on 0-dim device tensors."""
    lists: TorchLists | None = plan.backend_cache
    if lists is None:
        lists = plan.backend_cache = TorchLists(plan, grads, buffers.fstate.device)
    per_tensor_sumsq = per_tensor_sums(lists, grads, grad_scale)
    sumsq = global_sumsq(per_tensor_sumsq, plan.params) if global_sumsq else per_tensor_sumsq.sum()
    lists.per_tensor_sumsq = per_tensor_sumsq

    host = lists.cpu and on_host(hparams, grad_scale)
    if host:  # the same decisions on host scalars: a read of a CPU tensor waits for nothing
        fstate, istate, sumsq, grad_scale, found_inf = host_scalars(lists, buffers, sumsq, grad_scale, found_inf)
        with np.errstate(all="ignore"):  # inf and NaN are values here, as on the device: no numpy warnings
            grad_mul, skip, lr_factor, worse = decide(
                sumsq, fstate, istate, rules, hparams[0].lr, grad_scale, found_inf
            )
    else:
        grad_mul, skip, lr_factor, worse = decide(
            sumsq, buffers.fstate, buffers.istate, rules, hparams[0].lr, grad_scale, found_inf
        )
    keep_worst(buffers.worst_sumsq, per_tensor_sumsq, worse, None if lists.all_positions else lists.positions)

    if lists.meta:  # no values to update (the state exists now, as after torch's step); the ops below read scalars
        return
    if rules.schedule is not None:
        show_next_lrs(lists, buffers, hparams, rules.schedule)
    advance_steps(lists.steps, skip)
    if host:
        adamw_update_host(lists, grads, hparams, grad_mul, skip, lr_factor)
    else:
        adamw_update(lists, grads, hparams, grad_mul, skip, lr_factor)


def on_host(hparams: list[HParams], grad_scale: torch.Tensor | None) -> bool:
    """Whether a CPU step's decisions run on host scalars: all but a tensor lr (whose dtype the 0-dim ops would
    promote to) and a GradScaler scale that is not one fp32 value, which keep the 0-dim tensor ops."""
    if grad_scale is not None and (grad_scale.dtype != torch.float32 or grad_scale.numel() != 1):
        return False
    return not any(type(row.lr) is torch.Tensor for row in hparams)


# The functions that read CPU tensors on the host (the only ones in this backend): tests/helpers.py's host-read
# guard, which stands in for a GPU's syncs, does not count their reads (on a CPU there is no queue to wait for)
HOST_READERS = ("host_scalars", "host_schedule_factor")


def host_scalars(lists: TorchLists, buffers: StepBuffers, sumsq, grad_scale, found_inf) -> tuple:
    """The CPU step's host view of what the decisions read: numpy arrays on the memory of the buffers fstate and
    istate (made once per pair, ~4 us each), and the global sum of squares, loss scale and found_inf flag as
    numpy fp32 scalars (None where not given)."""
    cached = lists.host_views
    if cached is None or cached[0] is not buffers.fstate or cached[1] is not buffers.istate:
        cached = lists.host_views = (buffers.fstate, buffers.istate, buffers.fstate.numpy(), buffers.istate.numpy())
    return (
        cached[2],
        cached[3],
        np.float32(sumsq.item()),
        None if grad_scale is None else np.float32(grad_scale.item()),
        None if found_inf is None else np.float32(found_inf.item()),
    )


def host_schedule_factor(schedule, applied_before: np.int64) -> np.float32:
    """The schedule's factor for a host count: its own fp32 tensor ops (its cosine is torch's), read back."""
    return np.float32(schedule.factor_tensor(torch.tensor(int(applied_before))).item())


def adamw_update(
    lists: TorchLists,
    grads: list[torch.Tensor],
    hparams: list[HParams],
    grad_mul: torch.Tensor,
    skip: torch.Tensor,
    lr_factor: torch.Tensor,
) -> None:
    """AdamW with `_fused_adamw_`, one call per (group, dtype, layout class): it divides the grads by
    `grad_scale` and leaves everything untouched when `found_inf` is 1. Groups with bf16 or 8-bit state go to
    their `LowbitUpdate` (backends/lowbit_reference.py) instead."""
    grad_divisor = grad_mul.reciprocal()
    for update in lists.updates:
        hp = hparams[update.group]
        indices = update.indices
        group_grads = grads if indices is None else [grads[i] for i in indices]
        if type(update) is LowbitUpdate:  # bf16 or 8-bit moments: the kernel's arithmetic, in torch
            update(group_grads, hp, grad_mul, skip, lr_factor)
            continue
        fused_adamw(update, group_grads, lr_factor * hp.lr, hp, grad_divisor, skip)


def adamw_update_host(
    lists: TorchLists,
    grads: list[torch.Tensor],
    hparams: list[HParams],
    grad_mul: np.float32,
    skip: np.float32,
    lr_factor: np.float32,
) -> None:
    """`adamw_update` with the decisions as host scalars: a skipped step runs nothing (what `found_inf` = 1
    leaves: every tensor untouched), and `_fused_adamw_` gets `grad_scale` only when the grads are scaled
    (a clip, or a loss scale): given one, torch's CPU kernel writes the scaled grads back into the grads, 4
    bytes per param more than the 32 of an update that only reads them; a factor of exactly 1 changes nothing."""
    if skip:
        return
    grad_divisor = None
    if grad_mul != 1.0:
        grad_divisor = lists.grad_divisor
        grad_divisor.fill_(float(np.float32(1.0) / grad_mul))
    scalars = None
    for update in lists.updates:
        hp = hparams[update.group]
        indices = update.indices
        group_grads = grads if indices is None else [grads[i] for i in indices]
        if type(update) is LowbitUpdate:  # takes its scalars as 0-dim tensors
            if scalars is None:
                scalars = [torch.tensor(float(x), dtype=torch.float32) for x in (grad_mul, skip, lr_factor)]
            update(group_grads, hp, *scalars)
            continue
        fused_adamw(update, group_grads, float(lr_factor * hp.lr), hp, grad_divisor, None)


def fused_adamw(update: _Update, grads: list[torch.Tensor], lr, hp: HParams, grad_divisor, found_inf) -> None:
    """One `_fused_adamw_` call, on the update's working copies when it has them (see _Update)."""
    if update.grads32 is not None:
        if update.copy_in is not None:
            torch._foreach_copy_(*update.copy_in)
        torch._foreach_copy_(update.grads32, grads)
        grads = update.grads32
    torch._fused_adamw_(
        update.params,
        grads,
        update.exp_avgs,
        update.exp_avg_sqs,
        update.max_exp_avg_sqs,
        update.steps,
        lr=lr,
        beta1=hp.beta1,
        beta2=hp.beta2,
        weight_decay=hp.weight_decay,
        eps=hp.eps,
        amsgrad=update.amsgrad,
        maximize=hp.maximize,
        grad_scale=grad_divisor,
        found_inf=found_inf,
    )
    if update.copy_out is not None:
        torch._foreach_copy_(*update.copy_out)


# ------------------------------------------------------------------------------------------------------------
# the decisions: kernels/decide.py's sections, under the same names and in the same order (that module says why
# each is what it is). One code for two kinds of values: 0-dim fp32/int64 tensors (no host read, any device), or
# numpy fp32/int64 scalars and numpy bools on the host (CPU tensors, where a read waits for nothing). On the host
# every +, -, * and / is numpy's fp32 scalar arithmetic (IEEE, rounded to nearest, nothing contracted) and sqrt
# is correctly rounded: the decision kernel's arithmetic (div_rn, sqrt_rn, fp fusion off), so the CPU step
# decides what the GPU's does, bit for bit (tests/core/test_host_decisions.py runs the kernel through Triton's
# interpreter against it). torch 2.13's CPU fp32 `sqrt` and `/` are an ulp off for some inputs, so the 0-dim
# tensor path agrees with both to an ulp. Python numbers mix with either kind as weak scalars (cast to fp32
# first); the few operations whose spelling differs go through the helpers below.


def _is_tensor(x) -> bool:
    return type(x) is torch.Tensor


def where(cond, a, b):
    if _is_tensor(cond):
        return torch.where(cond, a, b)
    return a if cond else b


def isfinite(x):
    return torch.isfinite(x) if _is_tensor(x) else np.isfinite(x)


def sqrt(x):
    """On the host the kernels' `sqrt_rn`: the fp64 root of an fp32 value rounded to fp32 is the correctly
    rounded fp32 root (numpy's fp32 sqrt, like torch 2.13's CPU one, is not for some inputs)."""
    if _is_tensor(x):
        return x.sqrt()
    return np.float32(math.sqrt(x)) if x >= 0 else np.float32("nan")  # (NaN for NaN and x < 0, as IEEE's)


# min and max: on the host the kernel's `tl.minimum` / `tl.maximum`, where a NaN operand gives the other one
# (PTX min/max); torch's clamp and minimum give NaN. They differ only on a non-finite step, which is skipped.


def clamp_min(x, low: float):
    if _is_tensor(x):
        return x.clamp(min=low)
    return x if x >= low else np.float32(low)


def clamp_max(x, high: float):
    if _is_tensor(x):
        return x.clamp(max=high)
    return x if x <= high else np.float32(high)


def minimum(a, b):
    if _is_tensor(a):
        return torch.minimum(a, b)
    return b if b < a or a != a else a


def as_float(x):
    """A bool or integer value as fp32 (`.float()`)."""
    return x.float() if _is_tensor(x) else np.float32(x)


def as_long(x):
    """A bool value as int64 (`.long()`)."""
    return x.long() if _is_tensor(x) else np.int64(x)


def constant_like(x, value: float):
    """An fp32 constant of x's kind (a 0-dim tensor on x's device, or a host scalar)."""
    return torch.full_like(x, value) if _is_tensor(x) else np.float32(value)


def false_like(x):
    return torch.zeros_like(x) if _is_tensor(x) else np.False_


def reciprocal(x):
    return x.reciprocal() if _is_tensor(x) else np.float32(1.0) / x


def per_tensor_sums(lists: TorchLists, grads: list[torch.Tensor], grad_scale: torch.Tensor | None) -> torch.Tensor:
    """Per-tensor sums of squares of the (unscaled) grads, in plan order: `_foreach_norm` per dtype (fp32
    accumulation), put back in order when there are several dtypes."""
    norms = [
        torch.stack(torch._foreach_norm(grads if i is None else [grads[k] for k in i], 2, dtype=torch.float32))
        for i in lists.norm_indices
    ]
    if lists.order is None:
        norms = norms[0]
    else:
        norms = torch.empty_like(lists.order, dtype=torch.float32).index_copy_(0, lists.order, torch.cat(norms))
    if grad_scale is not None:
        norms = norms * grad_scale.reciprocal()
    return norms * norms


def decide(
    sumsq,
    fstate: torch.Tensor | np.ndarray,
    istate: torch.Tensor | np.ndarray,
    rules: StepRules,
    lr0: float | torch.Tensor,
    grad_scale=None,
    found_inf=None,
) -> tuple:
    """The decision kernel from the global sum of squares on: updates `fstate` / `istate` in place and returns
    (grad multiplier, skip flag as fp32, lr factor, whether this step is the window's new worst). `sumsq`,
    `grad_scale` and `found_inf` are 0-dim tensors, or host scalars with the buffers as numpy arrays on their
    memory (CPU tensors: `host_scalars`); the results are of the same kind."""
    host = not _is_tensor(sumsq)
    if host:  # numpy arrays on the buffers' memory (`host_scalars`): their elements are numpy scalars
        f, i = list(fstate), list(istate)
    else:
        f, i = fstate.unbind(), istate.unbind()
    new_f, new_i = list(f), list(i)
    norm, nonfinite, finite = global_norm(sumsq, found_inf)
    mean, ready, zscore, is_spike, spike_ceiling = zscore_statistics(new_f, new_i, f, i, norm, finite, rules)
    skip, spike_skip = skip_decision(norm, nonfinite, zscore, is_spike, mean, rules)
    grad_mul = clip_coefficient(norm, is_spike, spike_ceiling, grad_scale, rules)
    applied_before, lr_factor = lr_schedule(i, norm, rules)
    count_step(
        new_f,
        new_i,
        f,
        i,
        applied_before,
        skip,
        nonfinite,
        finite,
        spike_skip,
        is_spike,
        norm,
        grad_mul,
        lr_factor,
        lr0,
        zscore,
    )
    worse = worst_step_window(new_f, new_i, f, i, norm, nonfinite, finite, zscore, ready, applied_before)
    if host:
        fstate[:] = new_f
        istate[:] = new_i
    else:
        fstate.copy_(torch.stack([x.to(torch.float32) for x in new_f]))
        istate.copy_(torch.stack(new_i))
    return grad_mul, new_f[layout.F_SKIP], lr_factor, worse


def global_norm(sumsq, found_inf):
    """The global norm and whether it is non-finite (or GradScaler found inf); and its negation, used below."""
    norm = sqrt(sumsq)
    nonfinite = ~isfinite(norm)
    if found_inf is not None:
        nonfinite = nonfinite | (found_inf != 0)
    return norm, nonfinite, ~nonfinite


def zscore_statistics(new_f, new_i, f, i, norm, finite, rules: StepRules):
    """The norm's z-score against the running statistics and the spike test; then the statistics absorb finite
    norms, a spike only up to its ceiling (plain mean and variance during the warm-up, an EMA after it)."""
    mean, var, count = f[layout.F_NORM_MEAN], f[layout.F_NORM_VAR], i[layout.I_STATS_COUNT]
    std = sqrt(clamp_min(var, 0.0))
    ready = count >= rules.zscore_warmup
    zscore = where(ready & finite, (norm - mean) / (std + layout.ZSCORE_STD_EPS), 0.0)
    is_spike = ready & finite & (zscore > rules.zscore_threshold)
    spike_ceiling = mean + rules.zscore_threshold * std

    value = where(is_spike, spike_ceiling, norm)
    in_warmup = count < rules.zscore_warmup
    warm_sum = f[layout.F_WARMUP_SUM] + value
    warm_sumsq = f[layout.F_WARMUP_SUMSQ] + value * value
    new_count = count + 1
    warm_mean = warm_sum / as_float(new_count)
    warm_var = clamp_min(warm_sumsq / as_float(new_count) - warm_mean * warm_mean, 0.0)
    alpha = rules.zscore_alpha
    ema_mean = alpha * mean + (1.0 - alpha) * value
    ema_var = alpha * var + (1.0 - alpha) * (value - ema_mean) * (value - ema_mean)
    new_f[layout.F_WARMUP_SUM] = where(finite & in_warmup, warm_sum, f[layout.F_WARMUP_SUM])
    new_f[layout.F_WARMUP_SUMSQ] = where(finite & in_warmup, warm_sumsq, f[layout.F_WARMUP_SUMSQ])
    new_f[layout.F_NORM_MEAN] = where(finite, where(in_warmup, warm_mean, ema_mean), mean)
    new_f[layout.F_NORM_VAR] = where(finite, where(in_warmup, warm_var, ema_var), var)
    new_i[layout.I_STATS_COUNT] = where(finite, new_count, count)
    return mean, ready, zscore, is_spike, spike_ceiling


def skip_decision(norm, nonfinite, zscore, is_spike, mean, rules: StepRules):
    """Whether the step is skipped (non-finite grads, or a spike skip), and whether it is a spike skip."""
    if rules.spike_skip_threshold:
        spike_skip = is_spike & (zscore > rules.spike_skip_threshold) & (norm >= rules.spike_skip_ratio * mean)
    else:
        spike_skip = false_like(is_spike)
    return nonfinite | spike_skip, spike_skip


def clip_coefficient(norm, is_spike, spike_ceiling, grad_scale, rules: StepRules):
    """The factor every grad is multiplied by: min(1, ceiling / (norm + eps)) over the loss scale."""
    ceiling = constant_like(norm, rules.max_grad_norm or float("inf"))
    if rules.clip_mode == layout.CLIP_ZSCORE:
        ceiling = where(is_spike, minimum(ceiling, spike_ceiling), ceiling)
    coef = clamp_max(ceiling / (norm + layout.CLIP_EPS), 1.0)
    return coef * reciprocal(grad_scale) if grad_scale is not None else coef


def lr_schedule(i, norm, rules: StepRules):
    """The count of updates applied before this one, and the schedule's factor at it (the next step's shown lrs:
    `show_next_lrs`, once the step's decisions are made)."""
    applied_before = i[layout.I_APPLIED_STEPS]
    if rules.schedule is None:
        return applied_before, constant_like(norm, 1.0)
    if _is_tensor(applied_before):
        return applied_before, rules.schedule.factor_tensor(applied_before)
    return applied_before, host_schedule_factor(rules.schedule, applied_before)


def show_next_lrs(lists: TorchLists, buffers: StepBuffers, hparams: list[HParams], schedule) -> None:
    """Every group's lr for the next step (base lr x the schedule's factor at the count of updates applied so far)
    into hparams[:, H_SHOWN_LR], which param_groups[g]["lr"] shows; the decision kernel's `lr_schedule` does this
    on the Triton path. Float lrs are kept in a device tensor until they change; tensor lrs are read on the device."""
    lrs = [row.lr for row in hparams]
    key = tuple(id(lr) if isinstance(lr, torch.Tensor) else lr for lr in lrs)
    if key != lists.lrs_key:
        device = buffers.hparams.device
        lists.base_lrs = torch.tensor([0.0 if isinstance(lr, torch.Tensor) else float(lr) for lr in lrs], device=device)
        lists.lrs_key = key
    base = lists.base_lrs
    if any(isinstance(lr, torch.Tensor) for lr in lrs):
        base = torch.stack([lr.reshape(()).float() if isinstance(lr, torch.Tensor) else b for lr, b in zip(lrs, base)])
    factor = schedule.factor_tensor(buffers.istate[layout.I_APPLIED_STEPS])
    torch.mul(base, factor, out=buffers.hparams[:, layout.H_SHOWN_LR])


def count_step(
    new_f,
    new_i,
    f,
    i,
    applied_before,
    skip,
    nonfinite,
    finite,
    spike_skip,
    is_spike,
    norm,
    grad_mul,
    lr_factor,
    lr0,
    zscore,
):
    """The counters and the scalars the update reads (grad multiplier, skip flag, lr factor)."""
    new_i[layout.I_APPLIED_STEPS] = applied_before + as_long(~skip)
    new_i[layout.I_SKIPPED_STEPS] = i[layout.I_SKIPPED_STEPS] + as_long(nonfinite)
    new_i[layout.I_SPIKE_SKIPS] = i[layout.I_SPIKE_SKIPS] + as_long(spike_skip & finite)
    new_i[layout.I_SPIKE_COUNT] = i[layout.I_SPIKE_COUNT] + as_long(is_spike)
    new_i[layout.I_LAST_SPIKE_STEP] = where(is_spike, applied_before, i[layout.I_LAST_SPIKE_STEP])
    new_i[layout.I_LAST_STEP_SKIPPED] = as_long(skip)
    new_f[layout.F_LAST_SPIKE_NORM] = where(is_spike, norm, f[layout.F_LAST_SPIKE_NORM])
    new_f[layout.F_GRAD_NORM] = norm
    new_f[layout.F_GRAD_MUL] = grad_mul
    new_f[layout.F_SKIP] = as_float(skip)
    new_f[layout.F_FOUND_INF] = as_float(nonfinite)
    new_f[layout.F_LR_FACTOR] = lr_factor
    new_f[layout.F_LAST_LR] = lr_factor * lr0
    new_f[layout.F_LAST_ZSCORE] = zscore


def worst_step_window(new_f, new_i, f, i, norm, nonfinite, finite, zscore, ready, applied_before):
    """The polling window: the largest z-score (its norm and step) and the worst step (a non-finite one counts
    as the worst), its index among all steps taken and its norm. Returns whether this step is the new worst."""
    new_max = ready & finite & (zscore > f[layout.F_MAX_ZSCORE])
    new_f[layout.F_MAX_ZSCORE] = where(new_max, zscore, f[layout.F_MAX_ZSCORE])
    new_f[layout.F_MAX_ZSCORE_NORM] = where(new_max, norm, f[layout.F_MAX_ZSCORE_NORM])
    new_i[layout.I_MAX_ZSCORE_STEP] = where(new_max, applied_before, i[layout.I_MAX_ZSCORE_STEP])
    worst_key = f[layout.F_WORST_KEY]
    key = where(nonfinite, float("inf"), zscore)
    worse = key > worst_key
    new_f[layout.F_WORST_KEY] = where(worse, key, worst_key)
    new_f[layout.F_WORST_NORM] = where(worse, norm, f[layout.F_WORST_NORM])
    steps_before = applied_before + i[layout.I_SKIPPED_STEPS] + i[layout.I_SPIKE_SKIPS]  # each step adds to one
    new_i[layout.I_WORST_STEP] = where(worse, steps_before, i[layout.I_WORST_STEP])
    return worse


def keep_worst(
    worst_sumsq: torch.Tensor, per_tensor_sumsq: torch.Tensor, worse, positions: torch.Tensor | None
) -> None:
    """The window's per-tensor sums: this step's go to their params' slots when it is the new worst (one op when
    the plan holds every param in order; none on the host when it is not the new worst)."""
    if not _is_tensor(worse):
        if worse:
            if positions is None:
                worst_sumsq.copy_(per_tensor_sumsq)
            else:
                worst_sumsq.index_copy_(0, positions, per_tensor_sumsq)
    elif positions is None:
        torch.where(worse, per_tensor_sumsq, worst_sumsq, out=worst_sumsq)
    else:
        kept = worst_sumsq.index_select(0, positions)
        worst_sumsq.index_copy_(0, positions, torch.where(worse, per_tensor_sumsq, kept))


def advance_steps(steps: list[torch.Tensor], skip) -> None:
    """The per-param `step` counters (what the bias correction reads): +1 only when the update is applied."""
    if _is_tensor(skip):
        torch._foreach_add_(steps, 1.0 - skip)
    elif not skip:
        torch._foreach_add_(steps, 1.0)
