"""How one benchmark row is measured: step times, the bytes model, copy bandwidth, launches, syncs, memory.

CPU: `time.perf_counter` around each step after warm-up. CUDA: a pair of CUDA events around each step, with a
256 MiB buffer zeroed between steps (outside the events) so the L2 cache starts cold, as triton's do_bench does.
The contenders of a parameter set take turns step by step, so a shared machine's changing load hits them alike,
and each rotates over several independent input sets when one set is small enough to sit in a cache.

Warm-up runs until the step time settles (or its time budget is spent); the timed step count follows a time
budget per row (`--min-time` at least, `--max-time` at most, `--steps` / `--max-steps` as floor and cap), so a
row whose step takes seconds runs a few steps, not dozens. A row's spread (q1..q3) says whether it can be
judged: `too_wide` marks one whose interquartile range is over WIDE_SPREAD of its median.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

from .paramsets import tensor_bytes

MiB = 2**20
# The profiler (kineto) writes "USDT:... profiler_start/stop" lines straight to file descriptor 2 each time it
# starts and stops (some 60 per bench run), and c10 notes that memory allocated before profiling is not
# tracked (true, and irrelevant to a step's transient peak). Hidden unless `fused-stable bench --verbose`.
QUIET_PROFILER = True
_PROFILER_CHATTER = re.compile(
    r"^(USDT|STAGE|INFO):\d{4}-\d\d-\d\d \S+ \d+:\d+ \S+\.cpp:\d+\] "
    r"|^\[W\d{4} [\d:.]+ (?:\d+ )?\S+\.cpp:\d+\] Memory block of unknown size was allocated before the profiling"
)
# Warm-up ends once the last SETTLE_WINDOW steps are within SETTLE_TOLERANCE of their median (steady state: the
# first uses of the compiled ops, lazily allocated state and its first-touch page faults are behind), or when
# its budget (the row's --min-time) is spent.
SETTLE_WINDOW, SETTLE_TOLERANCE, WARMUP_MAX_STEPS = 3, 0.10, 200
# Fewest timed steps a row takes even when --max-time would allow fewer: a median and quartiles need three.
MIN_TIMED_STEPS = 3
# A row whose interquartile range is over this share of its median cannot be judged: a bimodal row (seen: q1
# 26.6 ms, median 73.4 ms) or a loaded machine; steady rows on an idle machine stay under 5%.
WIDE_SPREAD = 0.25
SMALL_SET_BYTES = 256 * MiB  # below this resident size a step could be served from a cache: rotate inputs
L2_FLUSH_BYTES = 256 * MiB

# Bytes each memory pass moves, from the total bytes of params (P), grads (G) and optimizer state (S: exp_avg +
# exp_avg_sq in their stored format, 8-bit codes with their scales, plus master weights if any).
# "foreach_update" counts torch's _multi_tensor_adam (non-capturable): wd mul 2P, lerp m 2S'+G, mul v 2S',
# addcmul v 2S'+G, sqrt 2S', div 2S', add eps 2S', addcdiv 2P+2S' with S' one state = S/2, i.e. 4P + 2G + 7S.
PASS_BYTES: dict[str, Callable[[int, int, int], int]] = {
    "norm": lambda P, G, S: G,  # read every grad once
    "grad_rw": lambda P, G, S: 2 * G,  # read and write every grad (clip scale, unscale_)
    "fused_update": lambda P, G, S: 2 * P + G + 2 * S,  # read p, g, m, v; write p, m, v
    "foreach_update": lambda P, G, S: 4 * P + 2 * G + 7 * S,
}


def state_bytes(optimizer: torch.optim.Optimizer, params) -> int:
    """Bytes of the per-element optimizer state, found after the first step: tensors as large as their param
    (fp32 or bf16 moments, 8-bit codes, master weights) and the 8-bit formats' per-block scales (a state tensor
    of more than one element; a table shared between params, such as bitsandbytes' code map, counts once).
    torchao's subclass tensors count their codes and scales."""
    total, seen = 0, set()
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            for t in _plain_tensors(value):
                if t.numel() > 1 and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.numel() * t.element_size()
    return total


def _plain_tensors(value) -> list[torch.Tensor]:
    """The plain tensors a state value stores: itself, or a tensor subclass's inner tensors (torchao)."""
    if not torch.is_tensor(value):
        return []
    flatten = getattr(value, "__tensor_flatten__", None)
    if flatten is None:
        return [value]
    names, _ = flatten()
    return [t for name in names for t in _plain_tensors(getattr(value, name))]


def bytes_per_step(passes, params, optimizer) -> int:
    P = tensor_bytes(params)
    G = tensor_bytes([p.grad for p in params])
    S = state_bytes(optimizer, params)
    return sum(PASS_BYTES[name](P, G, S) for name in passes)


def too_wide(q1: float, median: float, q3: float) -> bool:
    """Whether a spread is too wide to judge the row by its median (see WIDE_SPREAD)."""
    return not (median > 0 and (q3 - q1) <= WIDE_SPREAD * median)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Median bytes/s of a large contiguous copy (bytes read + bytes written): the device's practical ceiling."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = _interleaved_times([[lambda: dst.copy_(src)]], device, reps, flush=None)[0]
    return 2 * n * 4 / statistics.median(times)


def _interleaved_times(groups, device, n, flush, cpu_seconds=None) -> list[list[float]]:
    """Per-step wall times (s) of each group, the groups taking turns step by step (in an order that rotates
    every round), so load changes on a shared machine hit every contender alike. A group's steps cycle
    through its input sets. On CPU, `cpu_seconds` (a list per group) gets each step's process CPU time."""
    k = len(groups)
    times: list[list[float]] = [[] for _ in range(k)]
    if device.type == "cuda":
        events = [
            [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            for _ in range(k)
        ]
        synchronize(device)
        for i in range(n):
            for j in range(k):
                g = (i + j) % k
                if flush is not None:
                    flush.zero_()
                start, end = events[g][i]
                start.record()
                groups[g][i % len(groups[g])]()
                end.record()
        synchronize(device)
        return [[s.elapsed_time(e) / 1e3 for s, e in events[g]] for g in range(k)]
    for i in range(n):
        for j in range(k):
            g = (i + j) % k
            fn = groups[g][i % len(groups[g])]
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times[g].append(time.perf_counter() - t0)
            if cpu_seconds is not None:
                cpu_seconds[g].append(time.process_time() - c0)
    return times


def _host_seconds(fns, device, n) -> float:
    """Process CPU seconds per step spent inside the step call; on CUDA with a synchronize after each step,
    outside the measurement, so launch-queue back-pressure does not count."""
    total = 0.0
    for i in range(n):
        c0 = time.process_time()
        fns[i % len(fns)]()
        total += time.process_time() - c0
        synchronize(device)
    return total / n


def settled(times: list[float], window: int = SETTLE_WINDOW) -> bool:
    """Whether the last `window` step times are within SETTLE_TOLERANCE of their median."""
    if len(times) < window:
        return False
    last = times[-window:]
    mid = statistics.median(last)
    return mid > 0 and max(last) - min(last) <= SETTLE_TOLERANCE * mid


def warm_up(
    fns: list[Callable[[], None]], device: torch.device, *, min_steps: int, budget_s: float, done: list[float] = ()
) -> dict:
    """Step until the step time settles: at least `min_steps` steps (fewer if `budget_s` runs out first, never
    none) and every input set once; stops when settled or when the budget is spent. A budget of 0 takes
    exactly those steps (`--min-time 0`: the smoke plan). Returns the warm-up's step count, whether it
    settled, and the settled step time (the median of its last window). `done`: the times of steps already
    taken since the first (on `fns[0]`, ...), counted as warm-up steps and in its budget."""
    window = max(SETTLE_WINDOW, len(fns))
    times: list[float] = list(done)
    start = time.perf_counter() - sum(times)
    need = max(1, min_steps, len(fns))

    def finished() -> bool:
        if not times:
            return False
        if budget_s <= 0:
            return len(times) >= need
        spent = time.perf_counter() - start
        return (len(times) >= need and settled(times, window)) or spent >= budget_s or len(times) >= WARMUP_MAX_STEPS

    while not finished():
        t0 = time.perf_counter()
        fns[len(times) % len(fns)]()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return {
        "warmup_steps": len(times),
        "warmup_settled": settled(times, window),
        "step_s": statistics.median(times[-window:]),
    }


def timed_step_count(round_s: float, *, min_steps: int, min_time: float, max_time: float | None, max_steps: int) -> int:
    """Timed steps of a row whose round (one step of each interleaved group) takes `round_s`: enough for
    `min_time` seconds and at least `min_steps`; no more than `max_time` seconds allow (but at least
    MIN_TIMED_STEPS, for quartiles) and never over `max_steps`."""
    n = max(min_steps, math.ceil(min_time / max(round_s, 1e-9)))
    if max_time is not None and n * round_s > max_time:
        n = max(MIN_TIMED_STEPS, math.floor(max_time / max(round_s, 1e-9)))
    return int(max(1, min(n, max_steps)))


def time_steps(
    groups: list[list[Callable[[], None]]],
    device: torch.device,
    *,
    warmup: int,
    min_steps: int,
    min_time: float,
    max_steps: int,
    max_time: float | None = None,
    host: list[bool] | None = None,
    done: list[list[float]] | None = None,
) -> list[dict]:
    """Warm every group up until its step time settles, pick one step count from the row's time budget, time
    all groups interleaved, and give each group's host time (on CPU the process time of the timed steps
    themselves; on CUDA a separate pass, where `host[i]`). `done[i]`: times of group i's steps already taken
    (warm_up). Returns one timing dict per group."""
    done = done or [[] for _ in groups]
    warm = [warm_up(fns, device, min_steps=warmup, budget_s=min_time, done=d) for fns, d in zip(groups, done)]
    n = timed_step_count(
        sum(w["step_s"] for w in warm), min_steps=min_steps, min_time=min_time, max_time=max_time, max_steps=max_steps
    )
    flush = torch.empty(L2_FLUSH_BYTES // 4, device=device) if device.type == "cuda" else None
    cpu_seconds: list[list[float]] = [[] for _ in groups]
    all_times = _interleaved_times(groups, device, n, flush, cpu_seconds)
    del flush
    out = []
    for i, (fns, times) in enumerate(zip(groups, all_times)):
        q1, med, q3 = quartiles(times)
        if host is not None and not host[i]:
            host_s = None
        elif device.type == "cuda":
            host_s = _host_seconds(fns, device, min(n, 20))
        else:
            host_s = statistics.mean(cpu_seconds[i])
        timing = {"steps": n, "median_s": med, "q1_s": q1, "q3_s": q3, "iqr_s": q3 - q1, "min_s": min(times)}
        timing.update(too_wide=too_wide(q1, med, q3), host_cpu_s=host_s, **warm[i])
        timing.pop("step_s")
        out.append(timing)
    return out


def count_launches_and_syncs(step: Callable[[], None], device: torch.device, steps: int = 3) -> dict:
    """CUDA only: kernels per step from torch.profiler, host syncs per step from the profiler's runtime calls
    and from torch.cuda.set_sync_debug_mode warnings (the larger of the two)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    kernels: dict[str, int] = {}
    runtime_syncs = 0
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            kernels[evt.name] = kernels.get(evt.name, 0) + 1
        elif "Synchronize" in evt.name and evt.name.startswith(("cuda", "cu")):
            runtime_syncs += 1
    runtime_syncs -= 1  # the synchronize() that closes the profiled region is ours, not the step's

    synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    debug_syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    synchronize(device)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:6]
    return {
        "launches_per_step": sum(kernels.values()) / steps,
        "syncs_per_step": max(max(runtime_syncs, 0), debug_syncs) / steps,
        "top_kernels": [{"name": k[:120], "per_step": v / steps} for k, v in top],
    }


@contextlib.contextmanager
def _quiet_profiler():
    """Hold back what is written to file descriptor 2 inside the block (the profiler writes from C++, below
    sys.stderr), then pass on every line except the profiler's own start/stop chatter."""
    if not QUIET_PROFILER:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().decode(errors="replace").splitlines(keepends=True)
                if not _PROFILER_CHATTER.match(line)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _cpu_memory_events(fn: Callable[[], object]):
    """Run `fn` under the profiler's allocator tracking: (its result, the [memory] events in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return result, events


def net_allocation(fn: Callable[[], object], device: torch.device):
    """(fn's result, bytes it left allocated): what an optimizer keeps once built and stepped (moments, master
    weights, working copies, caches), wherever it stores them."""
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        synchronize(device)
        return result, torch.cuda.memory_allocated(device) - before
    result, events = _cpu_memory_events(fn)
    return result, sum(e.nbytes() for e in events)


def step_extra_memory(step: Callable[[], None], device: torch.device) -> int:
    """Bytes a step allocates beyond what is resident before it (its transient peak)."""
    synchronize(device)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    # CPU: the profiler's allocator events, replayed in order; the running sum's maximum is the transient peak.
    _, events = _cpu_memory_events(step)
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak
