"""The decision kernel: one program that turns the norm pass's partial sums into this step's decisions.

A step is three kinds of launch, in stream order, with no host read anywhere: the norm pass (kernels/norm.py,
per grad dtype), `_decide_kernel` (here, one program: every decision of the step and its bookkeeping), and the
update (kernels/update.py, per param dtype), which reads the decisions and returns at once on a skipped step.
Keeping every decision in one single-program kernel is what makes the step race-free (no program reads a
counter another program is writing) and safe to capture in a CUDA graph; it costs one tiny launch.

The kernel is its sections, one @triton.jit helper each, in this order: per_tensor_sums, global_norm,
zscore_statistics, skip_decision, clip_coefficient, lr_schedule, count_step, worst_step_window, keep_worst,
advance_steps; backends/torch/torch_decide.py has functions of the same names, in the same order, so the two read
side by side.

The buffer layout (fused_stable/layout.py) reaches the code as constexpr defaults, not as module-level
`tl.constexpr` globals, which Triton's dispatcher re-checks on every launch: the kernel takes what it reads
itself as constexpr arguments, each helper the slots it touches. A kernel's constexpr values are part of
Triton's cache key, its helpers' defaults are not: `LAYOUT` (every constant of layout.py in one string, never
read) is what makes a change in layout.py recompile.

Rounding: as in the update kernel (kernels/update.py), contraction off and IEEE `div_rn` / `sqrt_rn`, so the
compiled kernel rounds op by op as written, as the torch backend's ops and Triton's interpreter do (only `cos`,
in the cosine schedule, stays approximate on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout
from .common import H_SIZE, KERNEL_LAYOUT, as_pointer
from .launch import ArgTemplate, LaunchConfig, PreparedLaunch

DECIDE_CONFIG = LaunchConfig(block=1024, num_warps=4, fp_fusion=False)  # block: chunks / tensors per loop step
BLOCK_TENSORS = DECIDE_CONFIG.block  # lanes of the decision kernel's loops over chunks and tensors


@triton.jit
def _segmented_add(a_value, a_start, b_value, b_start):
    """Combine step of a segmented inclusive sum: a segment start restarts the sum."""
    return tl.where(b_start != 0, b_value, a_value + b_value), a_start | b_start


@triton.jit
def per_tensor_sums(
    partials, chunk_owner, num_chunks, tensor_num_chunks, num_tensors, per_tensor_sumsq, BLOCK_T: tl.constexpr
):
    """Per-tensor sums of squares into `per_tensor_sumsq`, and the global one, in a fixed order (deterministic).

    Chunks of one tensor are adjacent, so a segmented scan over blocks of chunks gives every tensor's sum with
    coalesced loads, in ceil(num_chunks / BLOCK_T) iterations however the chunks are spread over tensors; a
    tensor that spans two blocks carries its running sum over. Each per-tensor sum is stored exactly once."""
    lanes = tl.arange(0, BLOCK_T)
    for tensor_start in range(0, num_tensors, BLOCK_T):
        tensors = tensor_start + lanes
        empty = (tensors < num_tensors) & (
            tl.load(tensor_num_chunks + tensors, mask=tensors < num_tensors, other=1) == 0
        )
        tl.store(per_tensor_sumsq + tensors, tl.zeros([BLOCK_T], dtype=tl.float32), mask=empty)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    carry = 0.0
    carry_owner = tl.full([], -1, tl.int64)
    for chunk_start in range(0, num_chunks, BLOCK_T):
        chunks = chunk_start + lanes
        valid = chunks < num_chunks
        part = tl.load(partials + chunks, mask=valid, other=0.0)
        owner = tl.load(chunk_owner + chunks, mask=valid, other=-1)
        previous = tl.load(chunk_owner + chunks - 1, mask=valid & (chunks > 0), other=-1)
        following = tl.load(chunk_owner + chunks + 1, mask=(chunks + 1) < num_chunks, other=-2)
        total += part
        part += tl.where((lanes == 0) & (owner == carry_owner), carry, 0.0)
        starts = ((lanes == 0) | (owner != previous)).to(tl.int32)
        running, _ = tl.associative_scan((part, starts), 0, _segmented_add)
        tl.store(per_tensor_sumsq + owner, running, mask=valid & (owner != following))
        carry = tl.sum(tl.where(lanes == BLOCK_T - 1, running, 0.0), axis=0)
        carry_owner = tl.sum(tl.where(lanes == BLOCK_T - 1, owner, 0), axis=0)
    return tl.sum(total, axis=0)


@triton.jit
def global_norm(
    sumsq, external_sumsq_ptr, found_inf_ptr, HAS_EXTERNAL_SUMSQ: tl.constexpr, HAS_FOUND_INF: tl.constexpr
):
    """The global norm, from this rank's sum of squares or one reduced elsewhere (across ranks), and whether it
    is non-finite (or GradScaler found inf)."""
    if HAS_EXTERNAL_SUMSQ:
        sumsq = tl.load(external_sumsq_ptr)
    norm = tl.sqrt_rn(sumsq)
    nonfinite = ~(norm < float("inf"))  # the comparison is false for inf and for nan
    if HAS_FOUND_INF:
        nonfinite = nonfinite | (tl.load(found_inf_ptr) != 0.0)
    return norm, nonfinite


@triton.jit
def zscore_statistics(
    fstate,
    istate,
    norm,
    nonfinite,
    zscore_alpha,
    zscore_threshold,
    zscore_warmup,
    F_NORM_MEAN: tl.constexpr = layout.F_NORM_MEAN,
    F_NORM_VAR: tl.constexpr = layout.F_NORM_VAR,
    F_WARMUP_SUM: tl.constexpr = layout.F_WARMUP_SUM,
    F_WARMUP_SUMSQ: tl.constexpr = layout.F_WARMUP_SUMSQ,
    I_STATS_COUNT: tl.constexpr = layout.I_STATS_COUNT,
    ZSCORE_STD_EPS: tl.constexpr = layout.ZSCORE_STD_EPS,
):
    """The norm's z-score against the running statistics (ZClip-style) and the spike test; then the statistics
    absorb finite norms, a spike only up to its ceiling so one spike cannot blow them up (plain mean and
    variance during the warm-up, an EMA after it)."""
    mean = tl.load(fstate + F_NORM_MEAN)
    var = tl.load(fstate + F_NORM_VAR)
    stats_count = tl.load(istate + I_STATS_COUNT)
    std = tl.sqrt_rn(tl.maximum(var, 0.0))
    stats_ready = stats_count >= zscore_warmup
    zscore = tl.where(stats_ready & ~nonfinite, tl.div_rn(norm - mean, std + ZSCORE_STD_EPS), 0.0)
    is_spike = stats_ready & ~nonfinite & (zscore > zscore_threshold)
    spike_ceiling = mean + zscore_threshold * std

    value = tl.where(is_spike, spike_ceiling, norm)
    old_sum = tl.load(fstate + F_WARMUP_SUM)
    old_sumsq = tl.load(fstate + F_WARMUP_SUMSQ)
    warm_sum = old_sum + value
    warm_sumsq = old_sumsq + value * value
    new_count = stats_count + 1
    warm_mean = tl.div_rn(warm_sum, new_count.to(tl.float32))
    warm_var = tl.maximum(tl.div_rn(warm_sumsq, new_count.to(tl.float32)) - warm_mean * warm_mean, 0.0)
    ema_mean = zscore_alpha * mean + (1.0 - zscore_alpha) * value
    ema_var = zscore_alpha * var + (1.0 - zscore_alpha) * (value - ema_mean) * (value - ema_mean)
    update_stats = ~nonfinite
    in_warmup = stats_count < zscore_warmup
    tl.store(fstate + F_WARMUP_SUM, tl.where(update_stats & in_warmup, warm_sum, old_sum))
    tl.store(fstate + F_WARMUP_SUMSQ, tl.where(update_stats & in_warmup, warm_sumsq, old_sumsq))
    tl.store(fstate + F_NORM_MEAN, tl.where(update_stats, tl.where(in_warmup, warm_mean, ema_mean), mean))
    tl.store(fstate + F_NORM_VAR, tl.where(update_stats, tl.where(in_warmup, warm_var, ema_var), var))
    tl.store(istate + I_STATS_COUNT, tl.where(update_stats, new_count, stats_count))
    return mean, stats_ready, zscore, is_spike, spike_ceiling


@triton.jit
def skip_decision(norm, nonfinite, zscore, is_spike, mean, spike_skip_threshold, spike_skip_ratio):
    """Whether the step is skipped (non-finite grads, or a spike skip), and whether it is a spike skip."""
    # heavy tails: a small batch's normal steps reach z ~ 10 at only a few times the mean norm, so a skip can
    # also ask for the norm itself to be far above its mean
    spike_skip = is_spike & (spike_skip_threshold > 0.0) & (zscore > spike_skip_threshold)
    spike_skip = spike_skip & (norm >= spike_skip_ratio * mean)
    return nonfinite | spike_skip, spike_skip


@triton.jit
def clip_coefficient(
    norm,
    is_spike,
    spike_ceiling,
    max_grad_norm,
    scale_ptr,
    HAS_SCALE: tl.constexpr,
    CLIP_MODE: tl.constexpr,
    CLIP_ZSCORE: tl.constexpr = layout.CLIP_ZSCORE,
    CLIP_EPS: tl.constexpr = layout.CLIP_EPS,
):
    """The factor every grad is multiplied by: the clip coefficient, as torch.nn.utils.clip_grad_norm_'s
    min(1, max_norm / (norm + eps)) (the ceiling lowered to the spike ceiling in zscore mode), over the loss scale."""
    ceiling = tl.where(max_grad_norm > 0.0, max_grad_norm, float("inf"))
    if CLIP_MODE == CLIP_ZSCORE:
        ceiling = tl.where(is_spike, tl.minimum(ceiling, spike_ceiling), ceiling)
    coef = tl.minimum(tl.div_rn(ceiling, norm + CLIP_EPS), 1.0)
    grad_mul = coef
    if HAS_SCALE:
        grad_mul = coef * tl.div_rn(1.0, tl.load(scale_ptr))
    return grad_mul


@triton.jit
def _schedule_factor(
    n,
    schedule_total,
    schedule_warmup,
    schedule_min_ratio,
    SCHEDULE: tl.constexpr,
    SCHEDULE_CONSTANT: tl.constexpr = layout.SCHEDULE_CONSTANT,
    SCHEDULE_LINEAR: tl.constexpr = layout.SCHEDULE_LINEAR,
):
    """The lr schedule's factor after `n` applied updates (fused_stable/schedules.py has the reference)."""
    warm = tl.div_rn(n, tl.maximum(schedule_warmup, 1.0))
    span = tl.maximum(schedule_total - schedule_warmup, 1.0)
    if SCHEDULE == SCHEDULE_CONSTANT:
        shape = 1.0
    elif SCHEDULE == SCHEDULE_LINEAR:
        shape = tl.maximum(tl.div_rn(schedule_total - n, span), 0.0)
    else:
        progress = tl.minimum(tl.maximum(tl.div_rn(n - schedule_warmup, span), 0.0), 1.0)
        shape = 0.5 * (1.0 + tl.cos(progress * 3.141592653589793))
    decay = schedule_min_ratio + (1.0 - schedule_min_ratio) * shape
    if SCHEDULE == SCHEDULE_CONSTANT:
        decay = 1.0
    return tl.where(n < schedule_warmup, warm, decay)


@triton.jit
def lr_schedule(
    istate,
    hparams,
    num_groups,
    skip,
    schedule_total,
    schedule_warmup,
    schedule_min_ratio,
    SCHEDULE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    I_APPLIED_STEPS: tl.constexpr = layout.I_APPLIED_STEPS,
    H_SIZE: tl.constexpr = H_SIZE,
    H_LR: tl.constexpr = layout.H_LR,
    H_SHOWN_LR: tl.constexpr = layout.H_SHOWN_LR,
    SCHEDULE_NONE: tl.constexpr = layout.SCHEDULE_NONE,
):
    """The count of updates applied before this one, and the schedule's factor at it; and every group's lr for
    the next step (base lr x the factor at the count after this one), where param_groups[g]["lr"] shows it."""
    applied_before = tl.load(istate + I_APPLIED_STEPS)
    factor = 1.0
    if SCHEDULE != SCHEDULE_NONE:
        n = applied_before.to(tl.float32)
        factor = _schedule_factor(n, schedule_total, schedule_warmup, schedule_min_ratio, SCHEDULE)
        n_next = (applied_before + tl.where(skip, 0, 1)).to(tl.float32)
        next_factor = _schedule_factor(n_next, schedule_total, schedule_warmup, schedule_min_ratio, SCHEDULE)
        lanes = tl.arange(0, BLOCK_T)
        for group_start in range(0, num_groups, BLOCK_T):
            groups = group_start + lanes
            in_range = groups < num_groups
            base = tl.load(hparams + groups * H_SIZE + H_LR, mask=in_range, other=0.0)
            tl.store(hparams + groups * H_SIZE + H_SHOWN_LR, base * next_factor, mask=in_range)
    return applied_before, factor


@triton.jit
def count_step(
    fstate,
    istate,
    hparams,
    applied_before,
    skip,
    nonfinite,
    spike_skip,
    is_spike,
    norm,
    grad_mul,
    factor,
    zscore,
    F_GRAD_NORM: tl.constexpr = layout.F_GRAD_NORM,
    F_GRAD_MUL: tl.constexpr = layout.F_GRAD_MUL,
    F_SKIP: tl.constexpr = layout.F_SKIP,
    F_FOUND_INF: tl.constexpr = layout.F_FOUND_INF,
    F_LR_FACTOR: tl.constexpr = layout.F_LR_FACTOR,
    F_LAST_LR: tl.constexpr = layout.F_LAST_LR,
    F_LAST_ZSCORE: tl.constexpr = layout.F_LAST_ZSCORE,
    F_LAST_SPIKE_NORM: tl.constexpr = layout.F_LAST_SPIKE_NORM,
    I_APPLIED_STEPS: tl.constexpr = layout.I_APPLIED_STEPS,
    I_SKIPPED_STEPS: tl.constexpr = layout.I_SKIPPED_STEPS,
    I_SPIKE_SKIPS: tl.constexpr = layout.I_SPIKE_SKIPS,
    I_SPIKE_COUNT: tl.constexpr = layout.I_SPIKE_COUNT,
    I_LAST_SPIKE_STEP: tl.constexpr = layout.I_LAST_SPIKE_STEP,
    I_LAST_STEP_SKIPPED: tl.constexpr = layout.I_LAST_STEP_SKIPPED,
    H_LR: tl.constexpr = layout.H_LR,
):
    """The counters and the scalars the update kernel reads (grad multiplier, skip flag, lr factor). Returns
    whether the update is applied (1 or 0), and the counts of skipped steps before this one."""
    applied = tl.where(skip, 0, 1).to(tl.int64)
    skipped_before = tl.load(istate + I_SKIPPED_STEPS)
    spike_skips_before = tl.load(istate + I_SPIKE_SKIPS)
    tl.store(istate + I_APPLIED_STEPS, applied_before + applied)
    tl.store(istate + I_SKIPPED_STEPS, skipped_before + nonfinite.to(tl.int64))
    tl.store(istate + I_SPIKE_SKIPS, spike_skips_before + (spike_skip & ~nonfinite).to(tl.int64))
    tl.store(istate + I_SPIKE_COUNT, tl.load(istate + I_SPIKE_COUNT) + is_spike.to(tl.int64))
    tl.store(istate + I_LAST_SPIKE_STEP, tl.where(is_spike, applied_before, tl.load(istate + I_LAST_SPIKE_STEP)))
    tl.store(istate + I_LAST_STEP_SKIPPED, skip.to(tl.int64))
    tl.store(fstate + F_LAST_SPIKE_NORM, tl.where(is_spike, norm, tl.load(fstate + F_LAST_SPIKE_NORM)))
    tl.store(fstate + F_GRAD_NORM, norm)
    tl.store(fstate + F_GRAD_MUL, grad_mul)
    tl.store(fstate + F_SKIP, skip.to(tl.float32))
    tl.store(fstate + F_FOUND_INF, nonfinite.to(tl.float32))
    tl.store(fstate + F_LR_FACTOR, factor)
    tl.store(fstate + F_LAST_LR, tl.load(hparams + H_LR) * factor)
    tl.store(fstate + F_LAST_ZSCORE, zscore)
    return applied, skipped_before, spike_skips_before


@triton.jit
def worst_step_window(
    fstate,
    istate,
    norm,
    nonfinite,
    zscore,
    stats_ready,
    applied_before,
    skipped_before,
    spike_skips_before,
    F_MAX_ZSCORE: tl.constexpr = layout.F_MAX_ZSCORE,
    F_MAX_ZSCORE_NORM: tl.constexpr = layout.F_MAX_ZSCORE_NORM,
    F_WORST_KEY: tl.constexpr = layout.F_WORST_KEY,
    F_WORST_NORM: tl.constexpr = layout.F_WORST_NORM,
    I_MAX_ZSCORE_STEP: tl.constexpr = layout.I_MAX_ZSCORE_STEP,
    I_WORST_STEP: tl.constexpr = layout.I_WORST_STEP,
):
    """The polling window since it was last reset, for a guard that reads only at logging steps: the largest
    z-score (its norm and step), and the worst step (a non-finite one counts as the worst), its index among all
    steps taken and its norm. Returns whether this step is the window's new worst."""
    new_max = stats_ready & ~nonfinite & (zscore > tl.load(fstate + F_MAX_ZSCORE))
    tl.store(fstate + F_MAX_ZSCORE, tl.where(new_max, zscore, tl.load(fstate + F_MAX_ZSCORE)))
    tl.store(fstate + F_MAX_ZSCORE_NORM, tl.where(new_max, norm, tl.load(fstate + F_MAX_ZSCORE_NORM)))
    tl.store(istate + I_MAX_ZSCORE_STEP, tl.where(new_max, applied_before, tl.load(istate + I_MAX_ZSCORE_STEP)))
    worst_key = tl.load(fstate + F_WORST_KEY)
    key = tl.where(nonfinite, float("inf"), zscore)
    worse = key > worst_key
    tl.store(fstate + F_WORST_KEY, tl.where(worse, key, worst_key))
    tl.store(fstate + F_WORST_NORM, tl.where(worse, norm, tl.load(fstate + F_WORST_NORM)))
    steps_before = applied_before + skipped_before + spike_skips_before  # each step adds to exactly one of them
    tl.store(istate + I_WORST_STEP, tl.where(worse, steps_before, tl.load(istate + I_WORST_STEP)))
    return worse


@triton.jit
def keep_worst(worse, per_tensor_sumsq, worst_sumsq, tensor_positions, num_tensors, BLOCK_T: tl.constexpr):
    """The window's per-tensor sums: this step's go to their params' slots when it is the new worst, so the guard
    can name the tensors of a spike between two reads without any per-step work of its own."""
    if worse:
        tl.debug_barrier()  # the per-tensor sums were stored by other threads of this program (per_tensor_sums)
        lanes = tl.arange(0, BLOCK_T)
        for tensor_start in range(0, num_tensors, BLOCK_T):
            tensors = tensor_start + lanes
            in_range = tensors < num_tensors
            sums = tl.load(per_tensor_sumsq + tensors, mask=in_range, other=0.0)
            slots = tl.load(tensor_positions + tensors, mask=in_range, other=0)
            tl.store(worst_sumsq + slots, sums, mask=in_range)


@triton.jit
def advance_steps(step_addrs, num_tensors, applied, BLOCK_T: tl.constexpr):
    """The per-param `step` counters (what the bias correction reads): +1 only when the update is applied."""
    increment = applied.to(tl.float32)
    lanes = tl.arange(0, BLOCK_T)
    for tensor_start in range(0, num_tensors, BLOCK_T):
        tensors = tensor_start + lanes
        in_range = tensors < num_tensors
        addrs = as_pointer(tl.load(step_addrs + tensors, mask=in_range, other=0), tl.float32)
        steps = tl.load(addrs, mask=in_range, other=0.0)
        tl.store(addrs, steps + increment, mask=in_range)


@triton.jit(
    do_not_specialize=["num_chunks", "num_tensors", "num_groups", "zscore_warmup"],
    do_not_specialize_on_alignment=["scale_ptr", "found_inf_ptr", "external_sumsq_ptr"],
)
def _decide_kernel(
    partials,  # fp32 [num_chunks] from the norm pass
    chunk_owner,  # int64 [num_chunks]: the tensor each chunk belongs to (ascending)
    num_chunks,
    tensor_num_chunks,  # int64 [num_tensors]
    num_tensors,
    per_tensor_sumsq,  # fp32 out [num_tensors]
    worst_sumsq,  # fp32 [every param]: the per-tensor sums of the window's worst step, by flat param position
    tensor_positions,  # int64 [num_tensors]: each tensor's flat param position (its slot in worst_sumsq)
    step_addrs,  # int64 [num_tensors]: addresses of the fp32 per-param `step` counters
    fstate,  # fp32 [layout.F_SIZE], read and written
    istate,  # int64 [layout.I_SIZE], read and written
    hparams,  # fp32 [num_groups, H_SIZE]; column H_SHOWN_LR written (with a schedule)
    num_groups,
    scale_ptr,  # fp32 [] loss scale (HAS_SCALE)
    found_inf_ptr,  # fp32 [] GradScaler's found_inf (HAS_FOUND_INF)
    external_sumsq_ptr,  # fp32 [] global sum of squares computed elsewhere, e.g. across ranks (HAS_EXTERNAL_SUMSQ)
    max_grad_norm,  # fixed ceiling; <= 0 means none
    zscore_alpha,
    zscore_threshold,
    zscore_warmup,
    spike_skip_threshold,  # <= 0 means never skip spikes
    spike_skip_ratio,  # a skipped spike's norm is also at least this many times the running mean (0: no condition)
    schedule_total,
    schedule_warmup,
    schedule_min_ratio,
    HAS_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_EXTERNAL_SUMSQ: tl.constexpr,
    CLIP_MODE: tl.constexpr,
    SCHEDULE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    LAYOUT: tl.constexpr = KERNEL_LAYOUT,  # the cache key's share of layout.py (see the module doc)
):
    sumsq = per_tensor_sums(
        partials, chunk_owner, num_chunks, tensor_num_chunks, num_tensors, per_tensor_sumsq, BLOCK_T
    )
    norm, nonfinite = global_norm(sumsq, external_sumsq_ptr, found_inf_ptr, HAS_EXTERNAL_SUMSQ, HAS_FOUND_INF)
    mean, stats_ready, zscore, is_spike, spike_ceiling = zscore_statistics(
        fstate, istate, norm, nonfinite, zscore_alpha, zscore_threshold, zscore_warmup
    )
    skip, spike_skip = skip_decision(norm, nonfinite, zscore, is_spike, mean, spike_skip_threshold, spike_skip_ratio)
    grad_mul = clip_coefficient(norm, is_spike, spike_ceiling, max_grad_norm, scale_ptr, HAS_SCALE, CLIP_MODE)
    applied_before, factor = lr_schedule(
        istate, hparams, num_groups, skip, schedule_total, schedule_warmup, schedule_min_ratio, SCHEDULE, BLOCK_T
    )
    applied, skipped_before, spike_skips_before = count_step(
        fstate, istate, hparams, applied_before, skip, nonfinite, spike_skip, is_spike, norm, grad_mul, factor, zscore
    )
    worse = worst_step_window(
        fstate, istate, norm, nonfinite, zscore, stats_ready, applied_before, skipped_before, spike_skips_before
    )
    keep_worst(worse, per_tensor_sumsq, worst_sumsq, tensor_positions, num_tensors, BLOCK_T)
    advance_steps(step_addrs, num_tensors, applied, BLOCK_T)


def prepare_decide(
    *,
    partials: torch.Tensor,
    chunk_owner: torch.Tensor,
    tensor_num_chunks: torch.Tensor,
    per_tensor_sumsq: torch.Tensor,
    tensor_positions: torch.Tensor,
    step_addrs: torch.Tensor,
    buffers: layout.StepBuffers,
    policy: layout.StepPolicy,
) -> tuple[PreparedLaunch, ArgTemplate]:
    """The one-program launch that turns the norm pass's partial sums into this step's decisions (module doc).

    The loss scale, GradScaler's found-inf flag and an externally reduced sum of squares are filled in per
    call (`run_decide`)."""
    schedule = policy.schedule
    args = ArgTemplate(
        _decide_kernel,
        partials=partials,
        chunk_owner=chunk_owner,
        num_chunks=chunk_owner.numel(),
        tensor_num_chunks=tensor_num_chunks,
        num_tensors=per_tensor_sumsq.numel(),
        per_tensor_sumsq=per_tensor_sumsq,
        worst_sumsq=buffers.worst_sumsq,
        tensor_positions=tensor_positions,
        step_addrs=step_addrs,
        fstate=buffers.fstate,
        istate=buffers.istate,
        hparams=buffers.hparams,
        num_groups=buffers.hparams.shape[0],
        scale_ptr=buffers.fstate,  # any fp32 device tensor: its pointer is never read while the flag is off
        found_inf_ptr=buffers.fstate,
        external_sumsq_ptr=buffers.fstate,
        max_grad_norm=float(policy.max_grad_norm or 0.0),
        zscore_alpha=float(policy.zscore_alpha),
        zscore_threshold=float(policy.zscore_threshold),
        zscore_warmup=int(policy.zscore_warmup),
        spike_skip_threshold=float(policy.spike_skip_threshold or 0.0),
        spike_skip_ratio=float(policy.spike_skip_ratio),
        schedule_total=float(schedule.total_steps if schedule else 0),
        schedule_warmup=float(schedule.warmup_steps if schedule else 0),
        schedule_min_ratio=float(schedule.min_lr_ratio if schedule else 0.0),
        HAS_SCALE=False,
        HAS_FOUND_INF=False,
        HAS_EXTERNAL_SUMSQ=False,
        CLIP_MODE=policy.clip_mode,
        SCHEDULE=schedule.kind if schedule else layout.SCHEDULE_NONE,
        BLOCK_T=BLOCK_TENSORS,
    )
    return PreparedLaunch(_decide_kernel, 1, DECIDE_CONFIG), args


def run_decide(
    prepared: tuple[PreparedLaunch, ArgTemplate],
    stream,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    external_sumsq: torch.Tensor | None = None,
) -> None:
    launch, args = prepared
    if grad_scale is None and found_inf is None and external_sumsq is None:
        launch(args.base, stream, (False, False, False))
        return
    dynamic = {}
    if grad_scale is not None:
        dynamic.update(scale_ptr=grad_scale, HAS_SCALE=True)
    if found_inf is not None:
        dynamic.update(found_inf_ptr=found_inf, HAS_FOUND_INF=True)
    if external_sumsq is not None:
        dynamic.update(external_sumsq_ptr=external_sumsq, HAS_EXTERNAL_SUMSQ=True)
    variant = (grad_scale is not None, found_inf is not None, external_sumsq is not None)
    launch(args.fill(**dynamic), stream, variant)
