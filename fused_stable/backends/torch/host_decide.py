"""The CPU step's decisions on host scalars: kernels/decide.py's sections under the same names and in the same
order, in numpy fp32/int64 scalars, taking only the branch each `where` of the tensor code (torch_decide.py)
would keep (about a third of the arithmetic, and no per-value dispatch: the step's fixed cost).

Every +, -, * and / is numpy's fp32 scalar arithmetic (IEEE, rounded to nearest, nothing contracted; Python
numbers mix in as weak scalars, cast to fp32 first) and sqrt is correctly rounded: the decision kernel's
arithmetic (div_rn, sqrt_rn, fp fusion off), so the CPU step decides what the GPU's does, bit for bit
(tests/core/test_host_decisions.py runs the kernel through Triton's interpreter against it). Min and max are the
kernel's `tl.minimum` / `tl.maximum`, where a NaN operand gives the other one (torch's clamp gives NaN); they
differ only on a non-finite step, which is skipped."""

from __future__ import annotations

import math

import numpy as np
import torch

from ... import layout
from ...layout import StepPolicy

F32 = np.float32
INF = F32("inf")

# The functions that read CPU tensors on the host (the only ones in the torch backend: torch_backend's
# `host_scalars`, `compiled_sums` and `read_decisions`, the schedule's factor and the compiled update's step
# counters below): tests/helpers.py's host-read guard, which stands in for a GPU's syncs, does not count their
# reads (on a CPU there is no queue)
HOST_READERS = ("host_scalars", "compiled_sums", "read_decisions", "host_schedule_factor", "read_steps")


def read_steps(values: torch.Tensor) -> np.ndarray:
    """The advanced `step` counters of one compiled update (a CPU tensor cpu_ops.advance_steps wrote) on the host:
    the update computes its scalars once per distinct value (updates.CompiledUpdate)."""
    return values.numpy()


def sqrt(x):
    """The kernels' `sqrt_rn`: the fp64 root of an fp32 value rounded to fp32 is the correctly rounded fp32 root
    (as numpy's fp32 sqrt is; torch 2.13's CPU fp32 sqrt is not, for 17% of 1e6 random fp32 values measured here).
    NaN for NaN and x < 0, as IEEE's."""
    return F32(math.sqrt(x)) if x >= 0 else F32("nan")


def clamp_min(x, low: float):
    return x if x >= low else F32(low)


def clamp_max(x, high: float):
    return x if x <= high else F32(high)


def decide(sumsq, fstate: np.ndarray, istate: np.ndarray, policy: StepPolicy, lr0: float, grad_scale, found_inf):
    """torch_decide.decide on host scalars: `sumsq`, `grad_scale` and `found_inf` are numpy fp32 scalars (the last
    two None when not given), `fstate` / `istate` numpy arrays on the buffers' memory, updated in place. Returns
    (grad multiplier, skip flag as fp32, lr factor, whether this step is the window's new worst)."""
    f, i = fstate.copy(), istate.copy()  # every section reads the state as it was before this step
    norm, nonfinite = global_norm(sumsq, found_inf)
    finite = not nonfinite
    ready, zscore, is_spike, spike_ceiling = zscore_statistics(fstate, istate, f, i, norm, finite, policy)
    skip, spike_skip = skip_decision(norm, nonfinite, zscore, is_spike, f[layout.F_NORM_MEAN], policy)
    grad_mul = clip_coefficient(norm, is_spike, spike_ceiling, grad_scale, policy)
    applied_before, lr_factor = lr_schedule(i, policy)
    count_step(fstate, istate, i, applied_before, skip, nonfinite, spike_skip, is_spike, norm, grad_mul, lr_factor, lr0)
    fstate[layout.F_LAST_ZSCORE] = zscore
    worse = worst_step_window(fstate, istate, f, i, norm, nonfinite, finite, zscore, ready, applied_before)
    return grad_mul, fstate[layout.F_SKIP], lr_factor, worse


def global_norm(sumsq, found_inf):
    """The global norm and whether it is non-finite (or GradScaler found inf)."""
    norm = sqrt(sumsq)
    nonfinite = not np.isfinite(norm) or (found_inf is not None and found_inf != 0)
    return norm, nonfinite


def zscore_statistics(fstate, istate, f, i, norm, finite: bool, policy: StepPolicy):
    """The norm's z-score against the running statistics and the spike test; then the statistics absorb a finite
    norm, a spike only up to its ceiling (plain mean and variance during the warm-up, an EMA after it)."""
    mean, var, count = f[layout.F_NORM_MEAN], f[layout.F_NORM_VAR], i[layout.I_STATS_COUNT]
    std = sqrt(clamp_min(var, 0.0))
    ready = bool(count >= policy.zscore_warmup)
    zscore = (norm - mean) / (std + layout.ZSCORE_STD_EPS) if ready and finite else F32(0.0)
    is_spike = ready and finite and bool(zscore > policy.zscore_threshold)
    spike_ceiling = mean + policy.zscore_threshold * std
    if finite:
        value = spike_ceiling if is_spike else norm
        new_count = count + 1
        if count < policy.zscore_warmup:
            warm_sum = f[layout.F_WARMUP_SUM] + value
            warm_sumsq = f[layout.F_WARMUP_SUMSQ] + value * value
            warm_mean = warm_sum / F32(new_count)
            fstate[layout.F_WARMUP_SUM] = warm_sum
            fstate[layout.F_WARMUP_SUMSQ] = warm_sumsq
            fstate[layout.F_NORM_MEAN] = warm_mean
            fstate[layout.F_NORM_VAR] = clamp_min(warm_sumsq / F32(new_count) - warm_mean * warm_mean, 0.0)
        else:
            alpha = policy.zscore_alpha
            ema_mean = alpha * mean + (1.0 - alpha) * value
            fstate[layout.F_NORM_MEAN] = ema_mean
            fstate[layout.F_NORM_VAR] = alpha * var + (1.0 - alpha) * (value - ema_mean) * (value - ema_mean)
        istate[layout.I_STATS_COUNT] = new_count
    return ready, zscore, is_spike, spike_ceiling


def skip_decision(norm, nonfinite: bool, zscore, is_spike: bool, mean, policy: StepPolicy):
    """Whether the step is skipped (non-finite grads, or a spike skip), and whether it is a spike skip."""
    spike_skip = bool(
        policy.spike_skip_threshold
        and is_spike
        and zscore > policy.spike_skip_threshold
        and norm >= policy.spike_skip_ratio * mean
    )
    return nonfinite or spike_skip, spike_skip


def clip_coefficient(norm, is_spike: bool, spike_ceiling, grad_scale, policy: StepPolicy):
    """The factor every grad is multiplied by: min(1, ceiling / (norm + eps)) over the loss scale."""
    ceiling = F32(policy.max_grad_norm or float("inf"))
    if policy.clip_mode == layout.CLIP_ZSCORE and is_spike and (spike_ceiling < ceiling or ceiling != ceiling):
        ceiling = spike_ceiling
    coef = clamp_max(ceiling / (norm + layout.CLIP_EPS), 1.0)
    return coef * (F32(1.0) / grad_scale) if grad_scale is not None else coef


def lr_schedule(i, policy: StepPolicy):
    """The count of updates applied before this one, and the schedule's factor at it."""
    applied_before = i[layout.I_APPLIED_STEPS]
    if policy.schedule is None:
        return applied_before, F32(1.0)
    return applied_before, host_schedule_factor(policy.schedule, applied_before)


def host_schedule_factor(schedule, applied_before: np.int64) -> np.float32:
    """The schedule's factor for a host count: its own fp32 tensor ops (its cosine is torch's), read back."""
    return F32(schedule.factor_tensor(torch.tensor(int(applied_before))).item())


def count_step(
    fstate, istate, i, applied_before, skip, nonfinite, spike_skip, is_spike, norm, grad_mul, lr_factor, lr0
):
    """The counters and the scalars the update reads (grad multiplier, skip flag, lr factor)."""
    istate[layout.I_APPLIED_STEPS] = applied_before + (not skip)
    istate[layout.I_SKIPPED_STEPS] = i[layout.I_SKIPPED_STEPS] + nonfinite
    istate[layout.I_SPIKE_SKIPS] = i[layout.I_SPIKE_SKIPS] + (spike_skip and not nonfinite)
    istate[layout.I_SPIKE_COUNT] = i[layout.I_SPIKE_COUNT] + is_spike
    if is_spike:
        istate[layout.I_LAST_SPIKE_STEP] = applied_before
        fstate[layout.F_LAST_SPIKE_NORM] = norm
    istate[layout.I_LAST_STEP_SKIPPED] = skip
    fstate[layout.F_GRAD_NORM] = norm
    fstate[layout.F_GRAD_MUL] = grad_mul
    fstate[layout.F_SKIP] = skip
    fstate[layout.F_FOUND_INF] = nonfinite
    fstate[layout.F_LR_FACTOR] = lr_factor
    fstate[layout.F_LAST_LR] = lr_factor * lr0


def worst_step_window(fstate, istate, f, i, norm, nonfinite, finite, zscore, ready, applied_before) -> bool:
    """The polling window: the largest z-score (its norm and step) and the worst step (a non-finite one counts
    as the worst), its index among all steps taken and its norm. Returns whether this step is the new worst."""
    if ready and finite and zscore > f[layout.F_MAX_ZSCORE]:
        fstate[layout.F_MAX_ZSCORE] = zscore
        fstate[layout.F_MAX_ZSCORE_NORM] = norm
        istate[layout.I_MAX_ZSCORE_STEP] = applied_before
    key = INF if nonfinite else zscore
    worse = bool(key > f[layout.F_WORST_KEY])
    if worse:
        fstate[layout.F_WORST_KEY] = key
        fstate[layout.F_WORST_NORM] = norm
        # each step adds to one of the three counts
        steps_before = applied_before + i[layout.I_SKIPPED_STEPS] + i[layout.I_SPIKE_SKIPS]
        istate[layout.I_WORST_STEP] = steps_before
    return worse
