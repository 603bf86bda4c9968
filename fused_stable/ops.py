"""One fused optimizer step (norm -> decisions -> AdamW) over the backends, and multi-tensor norm / scale.

Backends, one semantics:
  - "triton": the Triton kernels, for CUDA tensors (the default there);
  - "interpret": the same kernels run on CPU tensors by Triton's interpreter, which is how they are tested
    without a GPU; it needs TRITON_INTERPRET=1 before triton is first imported (FUSED_STABLE_BACKEND=interpret
    in the environment arranges that when fused_stable is imported first);
  - "torch": torch's own multi-tensor ops (`_foreach_norm`, `_fused_adamw_` with device `grad_scale` and
    `found_inf`), for CPU tensors (the default there) or anything the kernels do not cover.
Neither path reads a device value on the host. This module is the only place that picks a backend.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from . import layout
from .kernels.tables import build_chunk_map, upload_int64  # plain torch: importing it does not import triton
from .layout import StepRules

BACKENDS = ("triton", "interpret", "torch")
ENV_BACKEND = "FUSED_STABLE_BACKEND"


def resolve_backend(requested: str | None, device: torch.device) -> str:
    """The backend for tensors on `device`: an explicit request, else $FUSED_STABLE_BACKEND, else by device."""
    choice = requested or os.environ.get(ENV_BACKEND) or "auto"
    choice = choice.lower()
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"unknown fused_stable backend {choice!r}: use one of auto, {', '.join(BACKENDS)}")
    if choice == "triton" and device.type != "cuda":
        raise ValueError(
            f"backend 'triton' needs CUDA tensors, got {device.type}: use backend 'torch', or 'interpret' to run "
            "the Triton kernels on CPU through Triton's interpreter"
        )
    if choice == "interpret":
        if device.type != "cpu":
            raise ValueError(f"backend 'interpret' runs on CPU tensors only, got {device.type}")
        _require_interpreter()
    return choice


def _require_interpreter() -> None:
    from triton import knobs

    if not knobs.runtime.interpret:
        raise RuntimeError(
            "backend 'interpret' needs Triton's interpreter, which must be switched on before triton is imported: "
            f"start Python with TRITON_INTERPRET=1 (or {ENV_BACKEND}=interpret) in the environment"
        )


# --------------------------------------------------------------------------------------------------
# what the optimizer hands over for one step


@dataclass
class StepBatch:
    """The tensors taking part in one step (params with a grad), in the optimizer's parameter order."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    masters: list[torch.Tensor | None]  # fp32 master copy of a low-precision param, or None
    steps: list[torch.Tensor]  # fp32 0-dim per-param step counters (torch.optim.AdamW's `step`)
    groups: list[int]  # param-group index of each tensor
    positions: list[int]  # index of each tensor in the optimizer's flat parameter order
    group_hparams: list[tuple]  # per param group: (lr: float | Tensor, beta1, beta2, eps, weight_decay)
    originals: list[torch.Tensor]  # the optimizer's own param objects (DTensors under FSDP2; `params` are local)


@dataclass
class StepBuffers:
    """The optimizer's device buffers that a step reads and writes."""

    fstate: torch.Tensor  # fp32 [layout.F_SIZE]
    istate: torch.Tensor  # int64 [layout.I_SIZE]
    hparams: torch.Tensor  # fp32 [num_groups, layout.H_SIZE] (triton / interpret backends)


@dataclass
class StepCache:
    """What a backend keeps between steps: cached metadata and the last per-tensor sums of squares."""

    plan: object = None
    plan_key: tuple = ()
    hparams_key: tuple = ()
    per_tensor_sumsq: torch.Tensor | None = None  # in `positions` order below
    positions: torch.Tensor | None = None  # int64: where each entry of per_tensor_sumsq belongs
    extra: dict = field(default_factory=dict)


GlobalSumsq = Callable[[torch.Tensor, list], torch.Tensor]


def fused_step(
    backend: str,
    batch: StepBatch,
    buffers: StepBuffers,
    rules: StepRules,
    cache: StepCache,
    *,
    state_version: int,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    global_sumsq: GlobalSumsq | None = None,
) -> None:
    """Global norm, clip coefficient, skip decision, schedule and AdamW for every tensor in `batch`.

    `grad_scale` (a loss scale to divide the grads by) and `found_inf` (a flag from a GradScaler) are device
    tensors; `global_sumsq` maps the local per-tensor sums of squares to the global one (sharded params).
    """
    if backend == "torch":
        _torch_step(batch, buffers, rules, cache, grad_scale, found_inf, global_sumsq)
    else:
        _triton_step(batch, buffers, rules, cache, state_version, grad_scale, found_inf, global_sumsq)


# --------------------------------------------------------------------------------------------------
# torch backend


def _torch_step(batch, buffers, rules, cache, grad_scale, found_inf, global_sumsq) -> None:
    device = buffers.fstate.device
    by_dtype = _indices_by_dtype(batch.params)
    # index tensors are cached: building them from host lists every step would copy from pageable memory
    key = (tuple(batch.positions), tuple(tuple(v) for v in by_dtype.values()))
    if cache.extra.get("key") != key:
        cache.extra.update(
            key=key,
            positions=upload_int64(batch.positions, device),
            order=upload_int64([i for indices in by_dtype.values() for i in indices], device),
        )
    norms = [
        torch.stack(torch._foreach_norm([batch.grads[i] for i in indices], 2, dtype=torch.float32))
        for indices in by_dtype.values()
    ]
    norms = norms[0] if len(norms) == 1 else torch.empty_like(cache.extra["order"], dtype=torch.float32).index_copy_(
        0, cache.extra["order"], torch.cat(norms)
    )
    if grad_scale is not None:
        norms = norms * grad_scale.reciprocal()
    per_tensor_sumsq = norms * norms
    sumsq = global_sumsq(per_tensor_sumsq, batch.originals) if global_sumsq else per_tensor_sumsq.sum()
    cache.per_tensor_sumsq = per_tensor_sumsq
    cache.positions = cache.extra["positions"]

    lr0 = batch.group_hparams[0][0]
    grad_mul, skip, lr_factor = decide(sumsq, buffers.fstate, buffers.istate, rules, lr0, grad_scale, found_inf)

    applied = 1.0 - skip
    torch._foreach_add_(batch.steps, applied)
    # _fused_adamw_ divides the grads by `grad_scale` and leaves everything untouched when found_inf is 1
    grad_divisor = grad_mul.reciprocal()
    for (group, dtype), indices in _indices_by_group_and_dtype(batch).items():
        lr, beta1, beta2, eps, weight_decay = batch.group_hparams[group]
        lr = lr_factor * lr
        steps = [batch.steps[i] for i in indices]
        exp_avgs = [batch.exp_avgs[i] for i in indices]
        exp_avg_sqs = [batch.exp_avg_sqs[i] for i in indices]
        if dtype == torch.float32:
            params = [batch.params[i] for i in indices]
            grads = [batch.grads[i] for i in indices]
        else:  # the moments are fp32: update fp32 working copies (or the masters) and round back
            params, grads = _fp32_working_copies(cache, batch, group, indices)
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
            amsgrad=False, maximize=False, grad_scale=grad_divisor, found_inf=skip,
        )  # fmt: skip
        if dtype != torch.float32:
            torch._foreach_copy_([batch.params[i] for i in indices], params)


def _fp32_working_copies(cache: StepCache, batch: StepBatch, group: int, indices: list[int]):
    """fp32 params and grads for `_fused_adamw_` (which wants one dtype) over low-precision params.

    Persistent buffers, filled with `_foreach_copy_` each step: fresh `.float()` copies cost an allocation
    and page faults per step (several times the update itself on CPU). Masters, when kept, are the params.
    One set per (group, dtype), rebuilt when the params taking part change, so memory stays bounded.
    """
    low_params = [batch.params[i] for i in indices]
    slot, ptrs = ("fp32", group, low_params[0].dtype), tuple(p.data_ptr() for p in low_params)
    if cache.extra.get(slot, (None,))[0] != ptrs:
        cache.extra[slot] = (
            ptrs,
            [batch.masters[i] if batch.masters[i] is not None else torch.empty_like(batch.params[i], dtype=torch.float32) for i in indices],
            [torch.empty_like(batch.params[i], dtype=torch.float32) for i in indices],
        )
    _, params, grads = cache.extra[slot]
    copies = [(p32, p) for p32, p, i in zip(params, low_params, indices) if batch.masters[i] is None]
    if copies:
        torch._foreach_copy_([c[0] for c in copies], [c[1] for c in copies])
    torch._foreach_copy_(grads, [batch.grads[i] for i in indices])
    return params, grads


def decide(
    sumsq: torch.Tensor,
    fstate: torch.Tensor,
    istate: torch.Tensor,
    rules: StepRules,
    lr0: float | torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The finalize kernel's decisions with torch ops on 0-dim tensors (see kernels/adamw.py for the why).

    Updates `fstate` / `istate` in place and returns (grad multiplier, skip flag as fp32, lr factor).
    """
    f = fstate.unbind()
    i = istate.unbind()
    norm = sumsq.sqrt()
    nonfinite = ~torch.isfinite(norm)
    if found_inf is not None:
        nonfinite = nonfinite | (found_inf != 0)
    finite = ~nonfinite
    mean, var, count = f[layout.F_NORM_MEAN], f[layout.F_NORM_VAR], i[layout.I_STATS_COUNT]
    std = var.clamp(min=0.0).sqrt()
    ready = count >= rules.zscore_warmup
    zscore = torch.where(ready & finite, (norm - mean) / (std + layout.ZSCORE_STD_EPS), 0.0)
    is_spike = ready & finite & (zscore > rules.zscore_threshold)
    spike_ceiling = mean + rules.zscore_threshold * std
    if rules.spike_skip_threshold:
        spike_skip = is_spike & (zscore > rules.spike_skip_threshold)
    else:
        spike_skip = torch.zeros_like(is_spike)
    skip = nonfinite | spike_skip

    ceiling = torch.full_like(norm, rules.max_grad_norm or float("inf"))
    if rules.clip_mode == layout.CLIP_ZSCORE:
        ceiling = torch.where(is_spike, torch.minimum(ceiling, spike_ceiling), ceiling)
    coef = (ceiling / (norm + layout.CLIP_EPS)).clamp(max=1.0)
    grad_mul = coef * grad_scale.reciprocal() if grad_scale is not None else coef

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

    applied_before = i[layout.I_APPLIED_STEPS]
    if rules.schedule is not None:
        lr_factor = rules.schedule.factor_tensor(applied_before)
    else:
        lr_factor = torch.ones_like(norm)

    new_f = list(f)
    new_f[layout.F_GRAD_NORM] = norm
    new_f[layout.F_GRAD_MUL] = grad_mul
    new_f[layout.F_SKIP] = skip.float()
    new_f[layout.F_FOUND_INF] = nonfinite.float()
    new_f[layout.F_LR_FACTOR] = lr_factor
    new_f[layout.F_LAST_LR] = lr_factor * lr0
    new_f[layout.F_LAST_ZSCORE] = zscore
    new_max = ready & finite & (zscore > f[layout.F_MAX_ZSCORE])
    new_f[layout.F_MAX_ZSCORE] = torch.where(new_max, zscore, f[layout.F_MAX_ZSCORE])
    new_f[layout.F_MAX_ZSCORE_NORM] = torch.where(new_max, norm, f[layout.F_MAX_ZSCORE_NORM])
    new_f[layout.F_LAST_SPIKE_NORM] = torch.where(is_spike, norm, f[layout.F_LAST_SPIKE_NORM])
    new_f[layout.F_WARMUP_SUM] = torch.where(finite & in_warmup, warm_sum, f[layout.F_WARMUP_SUM])
    new_f[layout.F_WARMUP_SUMSQ] = torch.where(finite & in_warmup, warm_sumsq, f[layout.F_WARMUP_SUMSQ])
    new_f[layout.F_NORM_MEAN] = torch.where(finite, torch.where(in_warmup, warm_mean, ema_mean), mean)
    new_f[layout.F_NORM_VAR] = torch.where(finite, torch.where(in_warmup, warm_var, ema_var), var)
    fstate.copy_(torch.stack([x.to(torch.float32) for x in new_f]))

    new_i = list(i)
    new_i[layout.I_APPLIED_STEPS] = applied_before + (~skip).long()
    new_i[layout.I_SKIPPED_STEPS] = i[layout.I_SKIPPED_STEPS] + nonfinite.long()
    new_i[layout.I_SPIKE_SKIPS] = i[layout.I_SPIKE_SKIPS] + (spike_skip & finite).long()
    new_i[layout.I_SPIKE_COUNT] = i[layout.I_SPIKE_COUNT] + is_spike.long()
    new_i[layout.I_LAST_SPIKE_STEP] = torch.where(is_spike, applied_before, i[layout.I_LAST_SPIKE_STEP])
    new_i[layout.I_LAST_STEP_SKIPPED] = skip.long()
    new_i[layout.I_STATS_COUNT] = torch.where(finite, new_count, count)
    new_i[layout.I_MAX_ZSCORE_STEP] = torch.where(new_max, applied_before, i[layout.I_MAX_ZSCORE_STEP])
    istate.copy_(torch.stack(new_i))
    return grad_mul, new_f[layout.F_SKIP], lr_factor


def _indices_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    out: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        out.setdefault(tensor.dtype, []).append(index)
    return out


def _indices_by_group_and_dtype(batch: StepBatch) -> dict[tuple[int, torch.dtype], list[int]]:
    out: dict[tuple[int, torch.dtype], list[int]] = {}
    for index, (group, param) in enumerate(zip(batch.groups, batch.params)):
        out.setdefault((group, param.dtype), []).append(index)
    return out


# --------------------------------------------------------------------------------------------------
# triton / interpret backends


@dataclass
class _DtypeLaunch:
    dtype: torch.dtype
    indices: list[int]  # positions in the batch
    numels: torch.Tensor  # int64 [n]
    table: torch.Tensor  # int64 [n, TABLE_COLUMNS]
    chunks: object  # kernels.tables.ChunkMap
    partial_offset: int
    has_master: bool
    states_aligned: bool  # params, moments and masters all start on 16-byte boundaries
    grad_addrs: torch.Tensor | None = None
    grad_key: tuple = ()
    grads_aligned: bool = False


@dataclass
class _TritonPlan:
    launches: list[_DtypeLaunch]
    partials: torch.Tensor  # fp32 [total chunks]
    per_tensor_sumsq: torch.Tensor  # fp32 [num tensors], kernel order
    tensor_num_chunks: torch.Tensor
    step_addrs: torch.Tensor
    chunk_owner: torch.Tensor  # int64 [total chunks]: kernel-order tensor of each chunk
    positions: torch.Tensor  # int64 [num tensors]: flat parameter position of each kernel-order tensor
    kernel_order: list[int]  # batch indices in kernel order


def _build_plan(batch: StepBatch, device: torch.device) -> _TritonPlan:
    from .kernels.adamw import TABLE_COLUMNS
    from .kernels.norm import is_aligned

    launches, kernel_order, counts, owners = [], [], [], []
    offset = 0
    for dtype, indices in _indices_by_dtype(batch.params).items():
        numels = [batch.params[i].numel() for i in indices]
        chunks = build_chunk_map(numels, device)
        rows = []
        for i in indices:
            master = batch.masters[i]
            rows += [
                batch.params[i].data_ptr(), batch.exp_avgs[i].data_ptr(), batch.exp_avg_sqs[i].data_ptr(),
                master.data_ptr() if master is not None else 0, batch.steps[i].data_ptr(),
                batch.params[i].numel(), batch.groups[i], 0,
            ]  # fmt: skip
        launches.append(
            _DtypeLaunch(
                dtype=dtype,
                indices=indices,
                numels=upload_int64(numels, device),
                table=upload_int64(rows, device).view(len(indices), TABLE_COLUMNS),
                chunks=chunks,
                partial_offset=offset,
                has_master=batch.masters[indices[0]] is not None,
                states_aligned=is_aligned(
                    [t for i in indices for t in (batch.params[i], batch.exp_avgs[i], batch.exp_avg_sqs[i], batch.masters[i]) if t is not None]
                ),
            )
        )
        first = len(kernel_order)
        kernel_order += indices
        counts += chunks.tensor_num_chunks
        for local, count in enumerate(chunks.tensor_num_chunks):
            owners += [first + local] * count
        offset += chunks.num_chunks
    return _TritonPlan(
        launches=launches,
        partials=torch.zeros(max(offset, 1), dtype=torch.float32, device=device),
        per_tensor_sumsq=torch.zeros(len(kernel_order), dtype=torch.float32, device=device),
        tensor_num_chunks=upload_int64(counts, device),
        step_addrs=upload_int64([batch.steps[i].data_ptr() for i in kernel_order], device),
        chunk_owner=upload_int64(owners, device),
        positions=upload_int64([batch.positions[i] for i in kernel_order], device),
        kernel_order=kernel_order,
    )


def _triton_step(batch, buffers, rules, cache, state_version, grad_scale, found_inf, global_sumsq) -> None:
    from .kernels.adamw import launch_adamw, launch_finalize
    from .kernels.norm import is_aligned, launch_sumsq

    device = buffers.fstate.device
    # params and state are cached by address; `state_version` changes whenever the optimizer replaces state
    plan_key = (state_version, tuple(p.data_ptr() for p in batch.params), tuple(batch.groups))
    if plan_key != cache.plan_key:  # a new plan's launches have no grad addresses yet: checked below
        cache.plan, cache.plan_key = _build_plan(batch, device), plan_key
    plan: _TritonPlan = cache.plan

    _refresh_hparams(batch.group_hparams, buffers.hparams, cache)
    for launch in plan.launches:
        grads = [batch.grads[i] for i in launch.indices]
        grad_key = tuple(g.data_ptr() for g in grads)
        if grad_key != launch.grad_key:  # new grad storage (e.g. after zero_grad(set_to_none=True))
            _check_layouts([batch.params[i] for i in launch.indices], grads)
            launch.grad_addrs, launch.grad_key = upload_int64(list(grad_key), device), grad_key
            launch.grads_aligned = is_aligned(grads)
        launch_sumsq(
            launch.grad_addrs, launch.numels, launch.chunks, plan.partials, launch.partial_offset,
            launch.dtype, grad_scale, aligned=launch.grads_aligned,
        )  # fmt: skip

    external_sumsq = None
    if global_sumsq is not None:
        local = torch.zeros_like(plan.per_tensor_sumsq).index_add_(0, plan.chunk_owner, plan.partials[: plan.chunk_owner.numel()])
        external_sumsq = global_sumsq(local, [batch.originals[i] for i in plan.kernel_order]).reshape(())
    launch_finalize(
        partials=plan.partials,
        chunk_owner=plan.chunk_owner,
        tensor_num_chunks=plan.tensor_num_chunks,
        per_tensor_sumsq=plan.per_tensor_sumsq,
        step_addrs=plan.step_addrs,
        fstate=buffers.fstate,
        istate=buffers.istate,
        hparams=buffers.hparams,
        rules=rules,
        grad_scale=grad_scale,
        found_inf=found_inf,
        external_sumsq=external_sumsq,
    )
    for launch in plan.launches:
        launch_adamw(
            table=launch.table,
            grad_addrs=launch.grad_addrs,
            chunks=launch.chunks,
            hparams=buffers.hparams,
            fstate=buffers.fstate,
            param_dtype=launch.dtype,
            has_master=launch.has_master,
            aligned=launch.states_aligned and launch.grads_aligned,
        )
    cache.per_tensor_sumsq = plan.per_tensor_sumsq
    cache.positions = plan.positions


def _refresh_hparams(group_hparams: list[tuple], table: torch.Tensor, cache: StepCache) -> None:
    """Uploads changed float hyper-parameters; copies tensor lrs device-to-device every step (no sync)."""
    key = tuple(tuple(None if isinstance(v, torch.Tensor) else float(v) for v in row) for row in group_hparams)
    if key != cache.hparams_key:
        host = torch.tensor([_hparam_row(*row) for row in group_hparams], dtype=torch.float32)
        if table.device.type == "cuda":
            host = host.pin_memory()
        table.copy_(host, non_blocking=True)
        cache.hparams_key = key
    for g, row in enumerate(group_hparams):
        if isinstance(row[0], torch.Tensor):
            table[g, layout.H_LR].copy_(row[0])


def _hparam_row(lr, beta1: float, beta2: float, eps: float, weight_decay: float) -> list[float]:
    row = [0.0] * layout.H_SIZE
    row[layout.H_LR] = 0.0 if isinstance(lr, torch.Tensor) else float(lr)  # a tensor lr is copied in on the device
    row[layout.H_BETA1], row[layout.H_BETA2] = beta1, beta2
    row[layout.H_EPS], row[layout.H_WEIGHT_DECAY] = eps, weight_decay
    row[layout.H_ONE_MINUS_BETA1], row[layout.H_ONE_MINUS_BETA2] = 1.0 - beta1, 1.0 - beta2
    row[layout.H_LOG_BETA1] = math.log(beta1) if beta1 > 0 else float("-inf")
    row[layout.H_LOG_BETA2] = math.log(beta2) if beta2 > 0 else float("-inf")
    return row


def _check_layouts(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """The kernels walk memory linearly: param, grad and states must be dense with identical strides."""
    for p, g in zip(params, grads):
        if g.dtype != p.dtype or g.shape != p.shape:
            raise ValueError(
                f"a gradient of dtype {g.dtype} and shape {tuple(g.shape)} belongs to a parameter of dtype {p.dtype} "
                f"and shape {tuple(p.shape)}: a .grad must match its parameter"
            )
        if not _is_dense(p):
            raise ValueError(
                f"fused_stable kernels need dense parameters; got a parameter of shape {tuple(p.shape)} with "
                f"strides {p.stride()}: make it contiguous (e.g. nn.Parameter(t.contiguous())) or use backend='torch'"
            )
        if g.stride() != p.stride() and p.numel() > 1:
            raise ValueError(
                f"a gradient's strides {g.stride()} differ from its parameter's {p.stride()} (shape {tuple(p.shape)}): "
                "fused_stable kernels need matching layouts; use backend='torch' for such gradients"
            )


def _is_dense(t: torch.Tensor) -> bool:
    if t.is_contiguous() or t.numel() <= 1:
        return True
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return span == t.numel()


# --------------------------------------------------------------------------------------------------
# multi-tensor norm and scale for clip_grad_norm_


def total_norm_and_scale_(grads: list[torch.Tensor], max_norm: float, backend: str) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s L2 case with the fused kernels: returns the total norm (fp32)."""
    from .kernels.norm import launch_scale_, launch_sumsq

    device = grads[0].device
    by_dtype = _indices_by_dtype(grads)
    maps, offset = [], 0
    for dtype, indices in by_dtype.items():
        tensors = [grads[i] for i in indices]
        _check_layouts(tensors, tensors)
        chunks = build_chunk_map([t.numel() for t in tensors], device)
        maps.append((dtype, tensors, chunks, offset))
        offset += chunks.num_chunks
    partials = torch.zeros(max(offset, 1), dtype=torch.float32, device=device)
    addrs = {}
    for dtype, tensors, chunks, part_offset in maps:
        addrs[dtype] = (
            upload_int64([t.data_ptr() for t in tensors], device),
            upload_int64([t.numel() for t in tensors], device),
        )
        launch_sumsq(*addrs[dtype], chunks, partials, part_offset, dtype)
    total_norm = partials.sum().sqrt()
    coef = (max_norm / (total_norm + layout.CLIP_EPS)).clamp(max=1.0)
    for dtype, tensors, chunks, _ in maps:
        launch_scale_(*addrs[dtype], chunks, dtype, coef)
    return total_norm
