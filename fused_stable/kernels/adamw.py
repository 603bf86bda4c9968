"""The decision kernel and the multi-tensor AdamW update kernel.

A step is three kinds of launch, in stream order, with no host read anywhere:
  1. norm pass (kernels/norm.py), one launch per grad dtype: per-chunk partial sums of squares;
  2. `_finalize_kernel`, one program: per-tensor and global sums of squares, the clip coefficient, the
     skip decision, running norm statistics, the lr schedule, the polling windows (the largest z-score and
     the worst step with its per-tensor sums, for a guard that reads only at logging steps) and the
     per-param `step` counters;
  3. `_adamw_kernel`, one launch per param dtype: reads those decisions and updates its chunk, or
     returns at once when the step is skipped.
Keeping every decision in one single-program kernel is what makes the step race-free (no program reads a
counter another program is writing) and safe to capture in a CUDA graph; it costs one tiny launch.

The buffer layout (fused_stable/layout.py) reaches the kernels as constexpr arguments with defaults, not as
module-level `tl.constexpr` globals, which Triton's dispatcher re-checks on every launch; constexpr values are
part of Triton's cache key, so a change in layout.py recompiles.

Rounding, against torch (fp contraction off in both kernels, IEEE `div_rn` / `sqrt_rn`): torch's AdamW
(for-loop and foreach paths) and the torch backend's decision ops evaluate one op at a time, each rounded to
fp32, with IEEE division and square root; Triton's defaults would contract `a * b + c` into one FMA and use
approximate division and square root (`div.full`, `sqrt.approx`). With contraction off and the `_rn`
functions the compiled kernels round exactly as the expressions are written, which is also what Triton's
interpreter does, so the CPU tests see the GPU's arithmetic (only `exp` and `cos`, in the bias correction and
the cosine schedule, stay approximate on the GPU). torch's own fused CUDA AdamW is compiled with contraction
on and differs from its foreach path in the last bit too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout
from .launch import ArgTemplate, LaunchConfig, PreparedLaunch
from .norm import TRITON_DTYPES, aligned_block, as_pointer, is_aligned, load_address, to_storage
from .tables import ChunkMap

# 8 warps x 32 threads x 4 elements = BLOCK: fp32 accesses are 128-bit and 16-bit param / grad accesses 64-bit,
# and both dtypes get the same register layout. With 8 elements per thread the 16-bit accesses would be
# 128-bit but the fp32 ones would not follow, and Triton would move every block through shared memory
# (bar.sync) to convert between the two layouts (tests/core/test_kernels_codegen.py checks this).
ADAMW_CONFIG = LaunchConfig(block=1024, num_warps=8, fp_fusion=False)
FINALIZE_CONFIG = LaunchConfig(block=1024, num_warps=4, fp_fusion=False)  # block: chunks / tensors per loop step

# update-table columns (int64 [num_tensors, TABLE_COLUMNS]); COL_MAX_EXP_AVG_SQ is 0 without amsgrad
COL_PARAM, COL_EXP_AVG, COL_EXP_AVG_SQ, COL_MASTER, COL_STEP, COL_NUMEL, COL_GROUP, COL_MAX_EXP_AVG_SQ = range(8)
TABLE_COLUMNS = 8

BLOCK_TENSORS = FINALIZE_CONFIG.block  # lanes of the decision kernel's loops over chunks and tensors


@triton.jit
def _segmented_add(a_value, a_start, b_value, b_start):
    """Combine step of a segmented inclusive sum: a segment start restarts the sum."""
    return tl.where(b_start != 0, b_value, a_value + b_value), a_start | b_start


@triton.jit
def _schedule_factor(
    n,
    schedule_total,
    schedule_warmup,
    schedule_min_ratio,
    SCHEDULE: tl.constexpr,
    SCHEDULE_CONSTANT: tl.constexpr,
    SCHEDULE_LINEAR: tl.constexpr,
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


@triton.jit(
    do_not_specialize=["num_chunks", "num_tensors", "num_groups", "zscore_warmup"],
    do_not_specialize_on_alignment=["scale_ptr", "found_inf_ptr", "external_sumsq_ptr"],
)
def _finalize_kernel(
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
    # the buffer layout (layout.py), as constexpr arguments with defaults: see the module doc
    F_GRAD_NORM: tl.constexpr = layout.F_GRAD_NORM,
    F_GRAD_MUL: tl.constexpr = layout.F_GRAD_MUL,
    F_SKIP: tl.constexpr = layout.F_SKIP,
    F_FOUND_INF: tl.constexpr = layout.F_FOUND_INF,
    F_LR_FACTOR: tl.constexpr = layout.F_LR_FACTOR,
    F_LAST_LR: tl.constexpr = layout.F_LAST_LR,
    F_NORM_MEAN: tl.constexpr = layout.F_NORM_MEAN,
    F_NORM_VAR: tl.constexpr = layout.F_NORM_VAR,
    F_LAST_ZSCORE: tl.constexpr = layout.F_LAST_ZSCORE,
    F_LAST_SPIKE_NORM: tl.constexpr = layout.F_LAST_SPIKE_NORM,
    F_WARMUP_SUM: tl.constexpr = layout.F_WARMUP_SUM,
    F_WARMUP_SUMSQ: tl.constexpr = layout.F_WARMUP_SUMSQ,
    F_MAX_ZSCORE: tl.constexpr = layout.F_MAX_ZSCORE,
    F_MAX_ZSCORE_NORM: tl.constexpr = layout.F_MAX_ZSCORE_NORM,
    F_WORST_KEY: tl.constexpr = layout.F_WORST_KEY,
    F_WORST_NORM: tl.constexpr = layout.F_WORST_NORM,
    I_APPLIED_STEPS: tl.constexpr = layout.I_APPLIED_STEPS,
    I_SKIPPED_STEPS: tl.constexpr = layout.I_SKIPPED_STEPS,
    I_SPIKE_SKIPS: tl.constexpr = layout.I_SPIKE_SKIPS,
    I_SPIKE_COUNT: tl.constexpr = layout.I_SPIKE_COUNT,
    I_LAST_SPIKE_STEP: tl.constexpr = layout.I_LAST_SPIKE_STEP,
    I_LAST_STEP_SKIPPED: tl.constexpr = layout.I_LAST_STEP_SKIPPED,
    I_STATS_COUNT: tl.constexpr = layout.I_STATS_COUNT,
    I_MAX_ZSCORE_STEP: tl.constexpr = layout.I_MAX_ZSCORE_STEP,
    I_WORST_STEP: tl.constexpr = layout.I_WORST_STEP,
    H_LR: tl.constexpr = layout.H_LR,
    H_SIZE: tl.constexpr = layout.H_SIZE,
    H_SHOWN_LR: tl.constexpr = layout.H_SHOWN_LR,
    SCHEDULE_NONE: tl.constexpr = layout.SCHEDULE_NONE,
    SCHEDULE_CONSTANT: tl.constexpr = layout.SCHEDULE_CONSTANT,
    SCHEDULE_LINEAR: tl.constexpr = layout.SCHEDULE_LINEAR,
    CLIP_ZSCORE: tl.constexpr = layout.CLIP_ZSCORE,
    ZSCORE_STD_EPS: tl.constexpr = layout.ZSCORE_STD_EPS,
    CLIP_EPS: tl.constexpr = layout.CLIP_EPS,
):
    # 1. per-tensor and global sums of squares, in a fixed order (deterministic). Chunks of one tensor are
    # adjacent, so a segmented scan over blocks of chunks gives every tensor's sum with coalesced loads, in
    # ceil(num_chunks / BLOCK_T) iterations however the chunks are spread over tensors; a tensor that spans
    # two blocks carries its running sum over. Each per-tensor sum is stored exactly once.
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
    sumsq = tl.sum(total, axis=0)
    if HAS_EXTERNAL_SUMSQ:
        sumsq = tl.load(external_sumsq_ptr)
    norm = tl.sqrt_rn(sumsq)
    nonfinite = ~(norm < float("inf"))  # the comparison is false for inf and for nan
    if HAS_FOUND_INF:
        nonfinite = nonfinite | (tl.load(found_inf_ptr) != 0.0)

    # 2. running statistics of the norm and the spike test (ZClip-style)
    mean = tl.load(fstate + F_NORM_MEAN)
    var = tl.load(fstate + F_NORM_VAR)
    stats_count = tl.load(istate + I_STATS_COUNT)
    std = tl.sqrt_rn(tl.maximum(var, 0.0))
    stats_ready = stats_count >= zscore_warmup
    zscore = tl.where(stats_ready & ~nonfinite, tl.div_rn(norm - mean, std + ZSCORE_STD_EPS), 0.0)
    is_spike = stats_ready & ~nonfinite & (zscore > zscore_threshold)
    spike_ceiling = mean + zscore_threshold * std
    # heavy tails: a small batch's normal steps reach z ~ 10 at only a few times the mean norm, so a skip can
    # also ask for the norm itself to be far above its mean
    spike_skip = is_spike & (spike_skip_threshold > 0.0) & (zscore > spike_skip_threshold)
    spike_skip = spike_skip & (norm >= spike_skip_ratio * mean)
    skip = nonfinite | spike_skip

    # clip coefficient, as torch.nn.utils.clip_grad_norm_: min(1, max_norm / (norm + eps))
    ceiling = tl.where(max_grad_norm > 0.0, max_grad_norm, float("inf"))
    if CLIP_MODE == CLIP_ZSCORE:
        ceiling = tl.where(is_spike, tl.minimum(ceiling, spike_ceiling), ceiling)
    coef = tl.minimum(tl.div_rn(ceiling, norm + CLIP_EPS), 1.0)
    grad_mul = coef
    if HAS_SCALE:
        grad_mul = coef * tl.div_rn(1.0, tl.load(scale_ptr))

    # statistics absorb finite norms, a spike only up to its ceiling so one spike cannot blow them up
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

    # 3. the lr schedule, at the count of updates applied before this one; and every group's lr for the next
    # step (base lr x the factor at the count after this one), where param_groups[g]["lr"] shows it (optim.py)
    applied_before = tl.load(istate + I_APPLIED_STEPS)
    factor = 1.0
    if SCHEDULE != SCHEDULE_NONE:
        factor = _schedule_factor(
            applied_before.to(tl.float32),
            schedule_total,
            schedule_warmup,
            schedule_min_ratio,
            SCHEDULE,
            SCHEDULE_CONSTANT,
            SCHEDULE_LINEAR,
        )
        next_factor = _schedule_factor(
            (applied_before + tl.where(skip, 0, 1)).to(tl.float32),
            schedule_total,
            schedule_warmup,
            schedule_min_ratio,
            SCHEDULE,
            SCHEDULE_CONSTANT,
            SCHEDULE_LINEAR,
        )
        for group_start in range(0, num_groups, BLOCK_T):
            groups = group_start + lanes
            in_range = groups < num_groups
            base = tl.load(hparams + groups * H_SIZE + H_LR, mask=in_range, other=0.0)
            tl.store(hparams + groups * H_SIZE + H_SHOWN_LR, base * next_factor, mask=in_range)

    # 4. counters and the scalars the update kernel reads
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
    new_max = stats_ready & ~nonfinite & (zscore > tl.load(fstate + F_MAX_ZSCORE))
    tl.store(fstate + F_MAX_ZSCORE, tl.where(new_max, zscore, tl.load(fstate + F_MAX_ZSCORE)))
    tl.store(fstate + F_MAX_ZSCORE_NORM, tl.where(new_max, norm, tl.load(fstate + F_MAX_ZSCORE_NORM)))
    tl.store(istate + I_MAX_ZSCORE_STEP, tl.where(new_max, applied_before, tl.load(istate + I_MAX_ZSCORE_STEP)))

    # 5. the worst step since the window was reset (a non-finite one counts as the worst): its index among all
    # steps taken, its norm, and its per-tensor sums, so a guard that reads only at logging steps can name the
    # tensors of a spike between two reads without any per-step work of its own
    worst_key = tl.load(fstate + F_WORST_KEY)
    key = tl.where(nonfinite, float("inf"), zscore)
    worse = key > worst_key
    tl.store(fstate + F_WORST_KEY, tl.where(worse, key, worst_key))
    tl.store(fstate + F_WORST_NORM, tl.where(worse, norm, tl.load(fstate + F_WORST_NORM)))
    steps_before = applied_before + skipped_before + spike_skips_before  # each step adds to exactly one of them
    tl.store(istate + I_WORST_STEP, tl.where(worse, steps_before, tl.load(istate + I_WORST_STEP)))
    if worse:
        tl.debug_barrier()  # the per-tensor sums were stored by other threads of this program in step 1
        for tensor_start in range(0, num_tensors, BLOCK_T):
            tensors = tensor_start + lanes
            in_range = tensors < num_tensors
            sums = tl.load(per_tensor_sumsq + tensors, mask=in_range, other=0.0)
            slots = tl.load(tensor_positions + tensors, mask=in_range, other=0)
            tl.store(worst_sumsq + slots, sums, mask=in_range)

    # 6. per-param step counters: bias correction advances only on applied steps
    increment = applied.to(tl.float32)
    for tensor_start in range(0, num_tensors, BLOCK_T):
        tensors = tensor_start + lanes
        in_range = tensors < num_tensors
        addrs = tl.load(step_addrs + tensors, mask=in_range, other=0).to(tl.pointer_type(tl.float32))
        steps = tl.load(addrs, mask=in_range, other=0.0)
        tl.store(addrs, steps + increment, mask=in_range)


@triton.jit
def _expm1(x):
    """exp(x) - 1 without the cancellation near 0 (a Taylor series there); x = -inf gives -1."""
    tail = 1.0 / 720 + tl.div_rn(x, 5040.0)
    series = x * (1.0 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * tail)))))
    return tl.where(tl.abs(x) < 0.5, series, tl.exp(x) - 1.0)


@triton.jit
def _adamw_block(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    master,
    max_exp_avg_sq,
    mask,
    grad_mul,
    decay,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    step_size,
    bias_correction2_sqrt,
    PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    AMSGRAD: tl.constexpr,
):
    """AdamW on one block, given its pointers (one per element); unmasked (vectorisable) when `mask` is None.
    `grad_mul` carries the clip coefficient, the loss scale and, for maximize=True, the sign."""
    other = None if mask is None else 0.0
    g = tl.load(grad, mask=mask, other=other).to(tl.float32) * grad_mul
    if HAS_MASTER:
        p = tl.load(master, mask=mask, other=other)
    else:
        p = tl.load(param, mask=mask, other=other).to(tl.float32)
    m = tl.load(exp_avg, mask=mask, other=other)
    v = tl.load(exp_avg_sq, mask=mask, other=other)
    # the same arithmetic, in the same order, as torch.optim.AdamW's single-tensor path
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    if AMSGRAD:  # normalise by the largest second moment so far (torch: state "max_exp_avg_sq")
        v_max = tl.maximum(tl.load(max_exp_avg_sq, mask=mask, other=other), v, propagate_nan=tl.PropagateNan.ALL)
        tl.store(max_exp_avg_sq, v_max, mask=mask)
        denom = tl.div_rn(tl.sqrt_rn(v_max), bias_correction2_sqrt) + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(exp_avg, m, mask=mask)
    tl.store(exp_avg_sq, v, mask=mask)
    if HAS_MASTER:
        tl.store(master, p, mask=mask)
    tl.store(param, to_storage(p, PARAM_DTYPE), mask=mask)


@triton.jit
def _adamw_kernel(
    table,  # int64 [num_tensors, TABLE_COLUMNS]
    grad_addrs,  # int64 [num_tensors]
    chunk_tensor,
    chunk_start,
    hparams,  # fp32 [num_groups, H_SIZE]
    fstate,  # fp32: decisions of the finalize kernel
    PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    AMSGRAD: tl.constexpr = False,
    # the table and buffer layouts, as constexpr arguments with defaults: see the module doc
    TABLE_COLUMNS: tl.constexpr = TABLE_COLUMNS,
    COL_PARAM: tl.constexpr = COL_PARAM,
    COL_EXP_AVG: tl.constexpr = COL_EXP_AVG,
    COL_EXP_AVG_SQ: tl.constexpr = COL_EXP_AVG_SQ,
    COL_MASTER: tl.constexpr = COL_MASTER,
    COL_STEP: tl.constexpr = COL_STEP,
    COL_NUMEL: tl.constexpr = COL_NUMEL,
    COL_GROUP: tl.constexpr = COL_GROUP,
    COL_MAX_EXP_AVG_SQ: tl.constexpr = COL_MAX_EXP_AVG_SQ,
    F_SKIP: tl.constexpr = layout.F_SKIP,
    F_GRAD_MUL: tl.constexpr = layout.F_GRAD_MUL,
    F_LR_FACTOR: tl.constexpr = layout.F_LR_FACTOR,
    H_SIZE: tl.constexpr = layout.H_SIZE,
    H_LR: tl.constexpr = layout.H_LR,
    H_BETA2: tl.constexpr = layout.H_BETA2,
    H_EPS: tl.constexpr = layout.H_EPS,
    H_WEIGHT_DECAY: tl.constexpr = layout.H_WEIGHT_DECAY,
    H_ONE_MINUS_BETA1: tl.constexpr = layout.H_ONE_MINUS_BETA1,
    H_ONE_MINUS_BETA2: tl.constexpr = layout.H_ONE_MINUS_BETA2,
    H_LOG_BETA1: tl.constexpr = layout.H_LOG_BETA1,
    H_LOG_BETA2: tl.constexpr = layout.H_LOG_BETA2,
    H_GRAD_SIGN: tl.constexpr = layout.H_GRAD_SIGN,
):
    if tl.load(fstate + F_SKIP) == 0.0:
        pid = tl.program_id(0).to(tl.int64)
        tensor = tl.load(chunk_tensor + pid)
        start = tl.load(chunk_start + pid)
        row = table + tensor * TABLE_COLUMNS
        end = tl.minimum(start + CHUNK, tl.load(row + COL_NUMEL))
        param_address = load_address(row + COL_PARAM)
        grad_address = load_address(grad_addrs + tensor)
        exp_avg_address = load_address(row + COL_EXP_AVG)
        exp_avg_sq_address = load_address(row + COL_EXP_AVG_SQ)
        master_address = load_address(row + COL_MASTER)  # 0 without master weights
        param = as_pointer(param_address, PARAM_DTYPE)
        grad = as_pointer(grad_address, PARAM_DTYPE)
        exp_avg = as_pointer(exp_avg_address, tl.float32)
        exp_avg_sq = as_pointer(exp_avg_sq_address, tl.float32)
        master = as_pointer(master_address, tl.float32)
        if AMSGRAD:
            max_address = load_address(row + COL_MAX_EXP_AVG_SQ)
        else:
            max_address = master_address  # never read or written: keeps the block calls uniform
        max_exp_avg_sq = as_pointer(max_address, tl.float32)
        step = tl.load(tl.load(row + COL_STEP).to(tl.pointer_type(tl.float32)))

        hp = hparams + tl.load(row + COL_GROUP) * H_SIZE
        lr = tl.load(hp + H_LR) * tl.load(fstate + F_LR_FACTOR)
        beta2 = tl.load(hp + H_BETA2)
        one_minus_beta1 = tl.load(hp + H_ONE_MINUS_BETA1)
        one_minus_beta2 = tl.load(hp + H_ONE_MINUS_BETA2)
        eps = tl.load(hp + H_EPS)
        decay = 1.0 - lr * tl.load(hp + H_WEIGHT_DECAY)
        grad_mul = tl.load(fstate + F_GRAD_MUL) * tl.load(hp + H_GRAD_SIGN)  # sign -1: maximize (exact)
        # 1 - beta ** step = -expm1(step * log(beta)), accurate in fp32 even for beta2 = 0.999 at step 1
        bias_correction1 = -_expm1(step * tl.load(hp + H_LOG_BETA1))
        bias_correction2_sqrt = tl.sqrt_rn(-_expm1(step * tl.load(hp + H_LOG_BETA2)))
        step_size = tl.div_rn(lr, bias_correction1)

        offsets = tl.arange(0, BLOCK).to(tl.int64)
        # full blocks without a mask, with 16-byte alignment hints when every address of this tensor allows
        # them (decided per tensor, so one unaligned view does not slow the others); then one masked tail
        full_end = start + (end - start) // BLOCK * BLOCK
        aligned = is_aligned(
            param_address | grad_address | exp_avg_address | exp_avg_sq_address | master_address | max_address
        )
        if aligned:
            for block_start in range(start, full_end, BLOCK):
                _adamw_block(
                    aligned_block(param, block_start) + offsets,
                    aligned_block(grad, block_start) + offsets,
                    aligned_block(exp_avg, block_start) + offsets,
                    aligned_block(exp_avg_sq, block_start) + offsets,
                    aligned_block(master, block_start) + offsets,
                    aligned_block(max_exp_avg_sq, block_start) + offsets,
                    None,
                    grad_mul,
                    decay,
                    beta2,
                    one_minus_beta1,
                    one_minus_beta2,
                    eps,
                    step_size,
                    bias_correction2_sqrt,
                    PARAM_DTYPE,
                    HAS_MASTER,
                    AMSGRAD,
                )
        else:
            for block_start in range(start, full_end, BLOCK):
                idx = block_start + offsets
                _adamw_block(
                    param + idx,
                    grad + idx,
                    exp_avg + idx,
                    exp_avg_sq + idx,
                    master + idx,
                    max_exp_avg_sq + idx,
                    None,
                    grad_mul,
                    decay,
                    beta2,
                    one_minus_beta1,
                    one_minus_beta2,
                    eps,
                    step_size,
                    bias_correction2_sqrt,
                    PARAM_DTYPE,
                    HAS_MASTER,
                    AMSGRAD,
                )
        if full_end < end:
            idx = full_end + offsets
            _adamw_block(
                param + idx,
                grad + idx,
                exp_avg + idx,
                exp_avg_sq + idx,
                master + idx,
                max_exp_avg_sq + idx,
                idx < end,
                grad_mul,
                decay,
                beta2,
                one_minus_beta1,
                one_minus_beta2,
                eps,
                step_size,
                bias_correction2_sqrt,
                PARAM_DTYPE,
                HAS_MASTER,
                AMSGRAD,
            )


def prepare_finalize(
    *,
    partials: torch.Tensor,
    chunk_owner: torch.Tensor,
    tensor_num_chunks: torch.Tensor,
    per_tensor_sumsq: torch.Tensor,
    worst_sumsq: torch.Tensor,
    tensor_positions: torch.Tensor,
    step_addrs: torch.Tensor,
    fstate: torch.Tensor,
    istate: torch.Tensor,
    hparams: torch.Tensor,
    rules: layout.StepRules,
    block_tensors: int | None = None,
) -> tuple[PreparedLaunch, ArgTemplate]:
    """One program that turns the norm pass's partial sums into this step's decisions (see module doc).

    The loss scale, GradScaler's found-inf flag and an externally reduced sum of squares are filled in per
    call (`run_finalize`)."""
    schedule = rules.schedule
    block = block_tensors or BLOCK_TENSORS
    args = ArgTemplate(
        _finalize_kernel,
        partials=partials,
        chunk_owner=chunk_owner,
        num_chunks=chunk_owner.numel(),
        tensor_num_chunks=tensor_num_chunks,
        num_tensors=per_tensor_sumsq.numel(),
        per_tensor_sumsq=per_tensor_sumsq,
        worst_sumsq=worst_sumsq,
        tensor_positions=tensor_positions,
        step_addrs=step_addrs,
        fstate=fstate,
        istate=istate,
        hparams=hparams,
        num_groups=hparams.shape[0],
        scale_ptr=fstate,  # any fp32 device tensor: its pointer is never read while the flag is off
        found_inf_ptr=fstate,
        external_sumsq_ptr=fstate,
        max_grad_norm=float(rules.max_grad_norm or 0.0),
        zscore_alpha=float(rules.zscore_alpha),
        zscore_threshold=float(rules.zscore_threshold),
        zscore_warmup=int(rules.zscore_warmup),
        spike_skip_threshold=float(rules.spike_skip_threshold or 0.0),
        spike_skip_ratio=float(rules.spike_skip_ratio),
        schedule_total=float(schedule.total_steps if schedule else 0),
        schedule_warmup=float(schedule.warmup_steps if schedule else 0),
        schedule_min_ratio=float(schedule.min_lr_ratio if schedule else 0.0),
        HAS_SCALE=False,
        HAS_FOUND_INF=False,
        HAS_EXTERNAL_SUMSQ=False,
        CLIP_MODE=rules.clip_mode,
        SCHEDULE=schedule.kind if schedule else layout.SCHEDULE_NONE,
        BLOCK_T=block,
    )
    return PreparedLaunch(_finalize_kernel, 1, FINALIZE_CONFIG), args


def run_finalize(
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


def prepare_adamw(
    *,
    table: torch.Tensor,
    grad_addrs: torch.Tensor,
    chunks: ChunkMap,
    hparams: torch.Tensor,
    fstate: torch.Tensor,
    param_dtype: torch.dtype,
    has_master: bool,
    amsgrad: bool = False,
    config: LaunchConfig = ADAMW_CONFIG,
) -> tuple[PreparedLaunch, ArgTemplate] | None:
    """AdamW over every tensor of one param dtype, with the finalize kernel's clip / skip / lr factor; None when
    there is nothing to update. Addresses that are multiples of 16 bytes get 128-bit accesses, per tensor."""
    if param_dtype not in TRITON_DTYPES:
        raise TypeError(f"fused_stable kernels support float32, bfloat16 and float16 params, got {param_dtype}")
    if chunks.num_chunks == 0:
        return None
    args = ArgTemplate(
        _adamw_kernel,
        table=table,
        grad_addrs=grad_addrs,
        chunk_tensor=chunks.chunk_tensor,
        chunk_start=chunks.chunk_start,
        hparams=hparams,
        fstate=fstate,
        PARAM_DTYPE=TRITON_DTYPES[param_dtype],
        HAS_MASTER=has_master,
        CHUNK=chunks.chunk_size,
        BLOCK=config.block,
        AMSGRAD=amsgrad,
    )
    return PreparedLaunch(_adamw_kernel, chunks.num_chunks, config), args


def run_adamw(prepared: tuple[PreparedLaunch, ArgTemplate], stream) -> None:
    launch, args = prepared
    launch(args.base, stream)
