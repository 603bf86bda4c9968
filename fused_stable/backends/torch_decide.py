"""The torch backend's decisions: kernels/decide.py's sections under the same names and in the same order, for
0-dim tensors or for host scalars (see the comment below); backends/torch_backend.py runs them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .. import layout
from ..layout import HParams, StepBuffers, StepRules

# torch_backend.TorchLists (not imported: torch_backend imports this module)
TorchLists = Any

# The functions that read CPU tensors on the host (the only ones in the torch backend, with torch_backend's
# `host_scalars`): tests/helpers.py's host-read guard, which stands in for a GPU's syncs, does not count their
# reads (on a CPU there is no queue to wait for)
HOST_READERS = ("host_scalars", "host_schedule_factor")


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


def host_schedule_factor(schedule, applied_before: np.int64) -> np.float32:
    """The schedule's factor for a host count: its own fp32 tensor ops (its cosine is torch's), read back."""
    return np.float32(schedule.factor_tensor(torch.tensor(int(applied_before))).item())
