"""The torch backend's decisions: kernels/decide.py's sections under the same names and in the same order, on
0-dim tensors (see the comment below), and the steps around them that both kinds of decisions share (the
per-tensor sums, the worst step's sums, the `step` counters); torch_backend.py runs them."""

from __future__ import annotations

from typing import Any

import torch

from ... import layout
from ...layout import StepBuffers, StepPolicy

# torch_backend.TorchLists (not imported: torch_backend imports this module)
TorchLists = Any

# ------------------------------------------------------------------------------------------------------------
# the decisions: kernels/decide.py's sections, under the same names and in the same order (that module says why
# each is what it is), on 0-dim fp32/int64 tensors: no host read, any device (meta, or CUDA tensors given this
# backend). A CPU step decides on host scalars instead (host_decide.py, the same sections, bit for bit the
# kernel's); torch 2.13's CPU fp32 `sqrt` and `/` are an ulp off for some inputs, so these tensor ops agree with
# both to an ulp. Python numbers mix in as weak scalars.


def where(cond, a, b):
    return torch.where(cond, a, b)


def clamp_min(x, low: float):
    return x.clamp(min=low)


def clamp_max(x, high: float):
    return x.clamp(max=high)


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
    fstate: torch.Tensor,
    istate: torch.Tensor,
    policy: StepPolicy,
    lr0: float | torch.Tensor,
    grad_scale=None,
    found_inf=None,
) -> tuple:
    """The decision kernel from the global sum of squares on: updates `fstate` / `istate` in place and returns
    (grad multiplier, skip flag as fp32, lr factor, whether this step is the window's new worst), all 0-dim
    tensors like `sumsq`, `grad_scale` and `found_inf`."""
    f, i = fstate.unbind(), istate.unbind()
    new_f, new_i = list(f), list(i)
    norm, nonfinite, finite = global_norm(sumsq, found_inf)
    mean, ready, zscore, is_spike, spike_ceiling = zscore_statistics(new_f, new_i, f, i, norm, finite, policy)
    skip, spike_skip = skip_decision(norm, nonfinite, zscore, is_spike, mean, policy)
    grad_mul = clip_coefficient(norm, is_spike, spike_ceiling, grad_scale, policy)
    applied_before, lr_factor = lr_schedule(i, norm, policy)
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


def global_norm(sumsq, found_inf):
    """The global norm and whether it is non-finite (or GradScaler found inf); and its negation, used below."""
    norm = sumsq.sqrt()
    nonfinite = ~torch.isfinite(norm)
    if found_inf is not None:
        nonfinite = nonfinite | (found_inf != 0)
    return norm, nonfinite, ~nonfinite


def zscore_statistics(new_f, new_i, f, i, norm, finite, policy: StepPolicy):
    """The norm's z-score against the running statistics and the spike test; then the statistics absorb finite
    norms, a spike only up to its ceiling (plain mean and variance during the warm-up, an EMA after it)."""
    mean, var, count = f[layout.F_NORM_MEAN], f[layout.F_NORM_VAR], i[layout.I_STATS_COUNT]
    std = clamp_min(var, 0.0).sqrt()
    ready = count >= policy.zscore_warmup
    zscore = where(ready & finite, (norm - mean) / (std + layout.ZSCORE_STD_EPS), 0.0)
    is_spike = ready & finite & (zscore > policy.zscore_threshold)
    spike_ceiling = mean + policy.zscore_threshold * std

    value = where(is_spike, spike_ceiling, norm)
    in_warmup = count < policy.zscore_warmup
    warm_sum = f[layout.F_WARMUP_SUM] + value
    warm_sumsq = f[layout.F_WARMUP_SUMSQ] + value * value
    new_count = count + 1
    warm_mean = warm_sum / new_count.float()
    warm_var = clamp_min(warm_sumsq / new_count.float() - warm_mean * warm_mean, 0.0)
    alpha = policy.zscore_alpha
    ema_mean = alpha * mean + (1.0 - alpha) * value
    ema_var = alpha * var + (1.0 - alpha) * (value - ema_mean) * (value - ema_mean)
    new_f[layout.F_WARMUP_SUM] = where(finite & in_warmup, warm_sum, f[layout.F_WARMUP_SUM])
    new_f[layout.F_WARMUP_SUMSQ] = where(finite & in_warmup, warm_sumsq, f[layout.F_WARMUP_SUMSQ])
    new_f[layout.F_NORM_MEAN] = where(finite, where(in_warmup, warm_mean, ema_mean), mean)
    new_f[layout.F_NORM_VAR] = where(finite, where(in_warmup, warm_var, ema_var), var)
    new_i[layout.I_STATS_COUNT] = where(finite, new_count, count)
    return mean, ready, zscore, is_spike, spike_ceiling


def skip_decision(norm, nonfinite, zscore, is_spike, mean, policy: StepPolicy):
    """Whether the step is skipped (non-finite grads, or a spike skip), and whether it is a spike skip."""
    if policy.spike_skip_threshold:
        spike_skip = is_spike & (zscore > policy.spike_skip_threshold) & (norm >= policy.spike_skip_ratio * mean)
    else:
        spike_skip = torch.zeros_like(is_spike)
    return nonfinite | spike_skip, spike_skip


def clip_coefficient(norm, is_spike, spike_ceiling, grad_scale, policy: StepPolicy):
    """The factor every grad is multiplied by: min(1, ceiling / (norm + eps)) over the loss scale."""
    ceiling = torch.full_like(norm, policy.max_grad_norm or float("inf"))
    if policy.clip_mode == layout.CLIP_ZSCORE:
        ceiling = where(is_spike, torch.minimum(ceiling, spike_ceiling), ceiling)
    coef = clamp_max(ceiling / (norm + layout.CLIP_EPS), 1.0)
    return coef * grad_scale.reciprocal() if grad_scale is not None else coef


def lr_schedule(i, norm, policy: StepPolicy):
    """The count of updates applied before this one, and the schedule's factor at it (the next step's shown lrs:
    `show_next_lrs`, once the step's decisions are made)."""
    applied_before = i[layout.I_APPLIED_STEPS]
    if policy.schedule is None:
        return applied_before, torch.full_like(norm, 1.0)
    return applied_before, policy.schedule.factor_tensor(applied_before)


def show_next_lrs(lists: TorchLists, buffers: StepBuffers, hparams: list[tuple], schedule) -> None:
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
    new_i[layout.I_LAST_SPIKE_STEP] = where(is_spike, applied_before, i[layout.I_LAST_SPIKE_STEP])
    new_i[layout.I_LAST_STEP_SKIPPED] = skip.long()
    new_f[layout.F_LAST_SPIKE_NORM] = where(is_spike, norm, f[layout.F_LAST_SPIKE_NORM])
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
    if type(worse) is not torch.Tensor:  # a host decision
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


def advance_steps(steps: list[torch.Tensor], skip: torch.Tensor) -> None:
    """The per-param `step` counters (what the bias correction reads): +1 only when the update is applied (the
    0-dim tensor decisions' skip flag; the host path advances them in torch_backend.run_updates_host)."""
    torch._foreach_add_(steps, 1.0 - skip)
