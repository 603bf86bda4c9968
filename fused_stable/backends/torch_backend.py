"""The fused step with torch's own multi-tensor ops (backend "torch", the default for CPU tensors).

`torch._foreach_norm` (fp32 accumulation) for the norm, a handful of 0-dim tensor ops that mirror the decision
kernel section by section (`decide`: the functions below it carry the names of kernels/decide.py's jit helpers,
in the same order), `torch._foreach_add_` on the step counters and `torch._fused_adamw_` with a device
`grad_scale` (= loss scale / clip coefficient) and `found_inf` (= skip). No host reads, and no
`_foreach_mul_` clip pass: 32 bytes per fp32 parameter instead of torch's 40.

`TorchLists` is this backend's side of a StepPlan, built once per plan: the per-dtype and per-(group, dtype)
lists `_fused_adamw_` takes, the index tensors that put per-tensor norms back in parameter order, and fp32
working copies for low-precision params (whose moments are fp32).

torch's CPU `_fused_adamw_` walks every tensor of a call as flat memory in the param's order, so it is wrong
for a param that is not dense, or whose grad or state tensors are laid out differently (a transposed grad):
those tensors go through contiguous fp32 working copies (copied in and back around the same call), which is
exact, and costs a copy only for them.
"""

from __future__ import annotations

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
    in the order of the Triton path: norm pass, decision kernel, update."""
    lists: TorchLists | None = plan.backend_cache
    if lists is None:
        lists = plan.backend_cache = TorchLists(plan, grads, buffers.fstate.device)
    per_tensor_sumsq = per_tensor_sums(lists, grads, grad_scale)
    sumsq = global_sumsq(per_tensor_sumsq, plan.params) if global_sumsq else per_tensor_sumsq.sum()
    lists.per_tensor_sumsq = per_tensor_sumsq

    grad_mul, skip, lr_factor, worse = decide(
        sumsq, buffers.fstate, buffers.istate, rules, hparams[0].lr, grad_scale, found_inf
    )
    keep_worst(buffers.worst_sumsq, per_tensor_sumsq, worse, None if lists.all_positions else lists.positions)

    if lists.meta:  # no values to update (the state exists now, as after torch's step); the ops below read scalars
        return
    if rules.schedule is not None:
        show_next_lrs(lists, buffers, hparams, rules.schedule)
    advance_steps(lists.steps, skip)
    adamw_update(lists, grads, hparams, grad_mul, skip, lr_factor)


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
        if update.grads32 is not None:  # the update runs on working copies (see _Update)
            if update.copy_in is not None:
                torch._foreach_copy_(*update.copy_in)
            torch._foreach_copy_(update.grads32, group_grads)
            group_grads = update.grads32
        torch._fused_adamw_(
            update.params,
            group_grads,
            update.exp_avgs,
            update.exp_avg_sqs,
            update.max_exp_avg_sqs,
            update.steps,
            lr=lr_factor * hp.lr,
            beta1=hp.beta1,
            beta2=hp.beta2,
            weight_decay=hp.weight_decay,
            eps=hp.eps,
            amsgrad=update.amsgrad,
            maximize=hp.maximize,
            grad_scale=grad_divisor,
            found_inf=skip,
        )
        if update.copy_out is not None:
            torch._foreach_copy_(*update.copy_out)


# ------------------------------------------------------------------------------------------------------------
# the decisions: kernels/decide.py's sections, under the same names and in the same order, with torch ops on
# 0-dim tensors (that module says why each is what it is)


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
    sumsq: torch.Tensor,
    fstate: torch.Tensor,
    istate: torch.Tensor,
    rules: StepRules,
    lr0: float | torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decision kernel from the global sum of squares on: updates `fstate` / `istate` in place and returns
    (grad multiplier, skip flag as fp32, lr factor, whether this step is the window's new worst)."""
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
    fstate.copy_(torch.stack([x.to(torch.float32) for x in new_f]))
    istate.copy_(torch.stack(new_i))
    return grad_mul, new_f[layout.F_SKIP], lr_factor, worse


def global_norm(sumsq: torch.Tensor, found_inf: torch.Tensor | None):
    """The global norm and whether it is non-finite (or GradScaler found inf); and its negation, used below."""
    norm = sumsq.sqrt()
    nonfinite = ~torch.isfinite(norm)
    if found_inf is not None:
        nonfinite = nonfinite | (found_inf != 0)
    return norm, nonfinite, ~nonfinite


def zscore_statistics(new_f, new_i, f, i, norm, finite, rules: StepRules):
    """The norm's z-score against the running statistics and the spike test; then the statistics absorb finite
    norms, a spike only up to its ceiling (plain mean and variance during the warm-up, an EMA after it)."""
    mean, var, count = f[layout.F_NORM_MEAN], f[layout.F_NORM_VAR], i[layout.I_STATS_COUNT]
    std = var.clamp(min=0.0).sqrt()
    ready = count >= rules.zscore_warmup
    zscore = torch.where(ready & finite, (norm - mean) / (std + layout.ZSCORE_STD_EPS), 0.0)
    is_spike = ready & finite & (zscore > rules.zscore_threshold)
    spike_ceiling = mean + rules.zscore_threshold * std

    value = torch.where(is_spike, spike_ceiling, norm)
    in_warmup = count < rules.zscore_warmup
    warm_sum = f[layout.F_WARMUP_SUM] + value
    warm_sumsq = f[layout.F_WARMUP_SUMSQ] + value * value
    new_count = count + 1
    warm_mean = warm_sum / new_count
    warm_var = (warm_sumsq / new_count - warm_mean * warm_mean).clamp(min=0.0)
    alpha = rules.zscore_alpha
    ema_mean = alpha * mean + (1.0 - alpha) * value
    ema_var = alpha * var + (1.0 - alpha) * (value - ema_mean) * (value - ema_mean)
    new_f[layout.F_WARMUP_SUM] = torch.where(finite & in_warmup, warm_sum, f[layout.F_WARMUP_SUM])
    new_f[layout.F_WARMUP_SUMSQ] = torch.where(finite & in_warmup, warm_sumsq, f[layout.F_WARMUP_SUMSQ])
    new_f[layout.F_NORM_MEAN] = torch.where(finite, torch.where(in_warmup, warm_mean, ema_mean), mean)
    new_f[layout.F_NORM_VAR] = torch.where(finite, torch.where(in_warmup, warm_var, ema_var), var)
    new_i[layout.I_STATS_COUNT] = torch.where(finite, new_count, count)
    return mean, ready, zscore, is_spike, spike_ceiling


def skip_decision(norm, nonfinite, zscore, is_spike, mean, rules: StepRules):
    """Whether the step is skipped (non-finite grads, or a spike skip), and whether it is a spike skip."""
    if rules.spike_skip_threshold:
        spike_skip = is_spike & (zscore > rules.spike_skip_threshold) & (norm >= rules.spike_skip_ratio * mean)
    else:
        spike_skip = torch.zeros_like(is_spike)
    return nonfinite | spike_skip, spike_skip


def clip_coefficient(norm, is_spike, spike_ceiling, grad_scale: torch.Tensor | None, rules: StepRules):
    """The factor every grad is multiplied by: min(1, ceiling / (norm + eps)) over the loss scale."""
    ceiling = torch.full_like(norm, rules.max_grad_norm or float("inf"))
    if rules.clip_mode == layout.CLIP_ZSCORE:
        ceiling = torch.where(is_spike, torch.minimum(ceiling, spike_ceiling), ceiling)
    coef = (ceiling / (norm + layout.CLIP_EPS)).clamp(max=1.0)
    return coef * grad_scale.reciprocal() if grad_scale is not None else coef


def lr_schedule(i, norm, rules: StepRules):
    """The count of updates applied before this one, and the schedule's factor at it (the next step's shown lrs:
    `show_next_lrs`, once the step's decisions are made)."""
    applied_before = i[layout.I_APPLIED_STEPS]
    if rules.schedule is not None:
        return applied_before, rules.schedule.factor_tensor(applied_before)
    return applied_before, torch.ones_like(norm)


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
    new_i[layout.I_APPLIED_STEPS] = applied_before + (~skip).long()
    new_i[layout.I_SKIPPED_STEPS] = i[layout.I_SKIPPED_STEPS] + nonfinite.long()
    new_i[layout.I_SPIKE_SKIPS] = i[layout.I_SPIKE_SKIPS] + (spike_skip & finite).long()
    new_i[layout.I_SPIKE_COUNT] = i[layout.I_SPIKE_COUNT] + is_spike.long()
    new_i[layout.I_LAST_SPIKE_STEP] = torch.where(is_spike, applied_before, i[layout.I_LAST_SPIKE_STEP])
    new_i[layout.I_LAST_STEP_SKIPPED] = skip.long()
    new_f[layout.F_LAST_SPIKE_NORM] = torch.where(is_spike, norm, f[layout.F_LAST_SPIKE_NORM])
    new_f[layout.F_GRAD_NORM] = norm
    new_f[layout.F_GRAD_MUL] = grad_mul
    new_f[layout.F_SKIP] = skip.float()
    new_f[layout.F_FOUND_INF] = nonfinite.float()
    new_f[layout.F_LR_FACTOR] = lr_factor
    new_f[layout.F_LAST_LR] = lr_factor * lr0
    new_f[layout.F_LAST_ZSCORE] = zscore


def worst_step_window(new_f, new_i, f, i, norm, nonfinite, finite, zscore, ready, applied_before):
    """The polling window: the largest z-score (its norm and step) and the worst step (a non-finite one counts
    as the worst), its index among all steps taken and its norm. Returns whether this step is the new worst."""
    new_max = ready & finite & (zscore > f[layout.F_MAX_ZSCORE])
    new_f[layout.F_MAX_ZSCORE] = torch.where(new_max, zscore, f[layout.F_MAX_ZSCORE])
    new_f[layout.F_MAX_ZSCORE_NORM] = torch.where(new_max, norm, f[layout.F_MAX_ZSCORE_NORM])
    new_i[layout.I_MAX_ZSCORE_STEP] = torch.where(new_max, applied_before, i[layout.I_MAX_ZSCORE_STEP])
    worst_key = f[layout.F_WORST_KEY]
    key = torch.where(nonfinite, float("inf"), zscore)
    worse = key > worst_key
    new_f[layout.F_WORST_KEY] = torch.where(worse, key, worst_key)
    new_f[layout.F_WORST_NORM] = torch.where(worse, norm, f[layout.F_WORST_NORM])
    steps_before = applied_before + i[layout.I_SKIPPED_STEPS] + i[layout.I_SPIKE_SKIPS]  # each step adds to one
    new_i[layout.I_WORST_STEP] = torch.where(worse, steps_before, i[layout.I_WORST_STEP])
    return worse


def keep_worst(
    worst_sumsq: torch.Tensor, per_tensor_sumsq: torch.Tensor, worse: torch.Tensor, positions: torch.Tensor | None
) -> None:
    """The window's per-tensor sums: this step's go to their params' slots when it is the new worst (one op when
    the plan holds every param in order)."""
    if positions is None:
        torch.where(worse, per_tensor_sumsq, worst_sumsq, out=worst_sumsq)
    else:
        kept = worst_sumsq.index_select(0, positions)
        worst_sumsq.index_copy_(0, positions, torch.where(worse, per_tensor_sumsq, kept))


def advance_steps(steps: list[torch.Tensor], skip: torch.Tensor) -> None:
    """The per-param `step` counters (what the bias correction reads): +1 only when the update is applied."""
    torch._foreach_add_(steps, 1.0 - skip)
