"""Running grad-norm statistics, z-score (ZClip-style) clipping and spike skipping against plain Python."""

from __future__ import annotations

import io
import math
import random

import pytest
import torch
from helpers import BACKEND_PARAMS, WITH_TENSOR_DECISIONS, assert_close

from fused_stable import FusedAdamW


class ZScoreReference:
    """The documented policy, written plainly: warm-up mean/variance over the first `warmup` finite norms, then
    EMA; a norm whose z-score exceeds `threshold` is a spike, clipped (zscore mode) to mean + threshold * std
    and folded into the statistics at that value; spikes above `skip_threshold` whose norm is also at least
    `skip_ratio` x the running mean skip the step."""

    def __init__(self, alpha, threshold, warmup, max_norm, zscore_clip, skip_threshold, skip_ratio=0.0):
        self.alpha, self.threshold, self.warmup = alpha, threshold, warmup
        self.max_norm, self.zscore_clip, self.skip_threshold = max_norm, zscore_clip, skip_threshold
        self.skip_ratio = skip_ratio
        self.count, self.mean, self.var, self.seen = 0, 0.0, 0.0, []
        self.spikes = self.spike_skips = 0

    def step(self, norm):
        if not math.isfinite(norm):  # skipped; the statistics, their count and the spike counters stay as they are
            return 1.0, True, 0.0
        std = math.sqrt(max(self.var, 0.0))
        ready = self.count >= self.warmup
        z = (norm - self.mean) / (std + 1e-6) if ready else 0.0
        spike = ready and z > self.threshold
        ceiling_spike = self.mean + self.threshold * std
        skip = (
            spike
            and self.skip_threshold is not None
            and z > self.skip_threshold
            and norm >= self.skip_ratio * self.mean
        )
        ceiling = self.max_norm if self.max_norm else math.inf
        if self.zscore_clip and spike:
            ceiling = min(ceiling, ceiling_spike)
        coef = min(1.0, ceiling / (norm + 1e-6))
        value = ceiling_spike if spike else norm
        if self.count < self.warmup:
            self.seen.append(value)
            self.mean = sum(self.seen) / len(self.seen)
            self.var = sum(v * v for v in self.seen) / len(self.seen) - self.mean**2
        else:
            self.mean = self.alpha * self.mean + (1 - self.alpha) * value
            self.var = self.alpha * self.var + (1 - self.alpha) * (value - self.mean) ** 2
        self.count += 1
        self.spikes += spike
        self.spike_skips += skip
        return coef, skip, z


def norm_sequence():
    rng = random.Random(7)
    norms = [1.0 + 0.1 * rng.uniform(-1, 1) for _ in range(40)]
    norms[15], norms[22], norms[30], norms[31] = 40.0, 3.0, 1e3, 6.0
    norms[5], norms[25], norms[34] = math.nan, math.inf, math.nan  # non-finite in the warm-up and after it
    return norms


NONFINITE_STEPS = 3


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
@pytest.mark.parametrize(
    "clip, max_norm, skip_threshold, skip_ratio",
    [
        ("zscore", None, None, 0.0),
        ("zscore", 2.0, None, 0.0),
        ("fixed", 2.0, 20.0, 0.0),
        ("zscore", None, 8.0, 0.0),
        ("zscore", None, 8.0, 5.0),
    ],
    ids=["zscore", "zscore+ceiling", "fixed+skip", "zscore+skip", "zscore+skip+ratio"],
)
def test_zscore_rules_match_plain_python(backend, clip, max_norm, skip_threshold, skip_ratio):
    alpha, threshold, warmup = 0.9, 2.5, 10
    ref = ZScoreReference(alpha, threshold, warmup, max_norm, clip == "zscore", skip_threshold, skip_ratio)
    direction = torch.randn(50, generator=torch.Generator().manual_seed(0))
    direction /= direction.norm()
    init = torch.randn(50, generator=torch.Generator().manual_seed(1))
    ours, theirs = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt = FusedAdamW(
        [ours],
        lr=1e-2,
        max_grad_norm=max_norm,
        clip=clip,
        zscore_alpha=alpha,
        zscore_threshold=threshold,
        zscore_warmup=warmup,
        spike_skip_threshold=skip_threshold,
        spike_skip_ratio=skip_ratio,
        backend=backend,
    )
    torch_opt = torch.optim.AdamW([theirs], lr=1e-2)
    for norm in norm_sequence():
        grad = direction * norm
        ours.grad = grad.clone()
        opt.step()
        coef, skip, z = ref.step(float(grad.double().norm()))
        assert opt.last_step_skipped.item() == skip
        assert opt.last_zscore.item() == pytest.approx(z, rel=1e-4, abs=1e-4)
        if not skip:
            theirs.grad = grad * coef
            torch_opt.step()
        assert_close(ours, theirs, 1e-5, 1e-6, f"params after norm {norm}")
    assert opt.grad_norm_mean.item() == pytest.approx(ref.mean, rel=1e-5)
    # the warm-up variance sumsq/n - mean^2 cancels in fp32: an ulp of error in either term is eps32 * mean^2
    # in the variance, eps32 * mean^2 / var relative in the std (2.4e-5 for these norms, var/mean^2 = 5e-3);
    # measured: 1.1e-5 (torch backend), 6e-7 (kernels)
    std_rtol = torch.finfo(torch.float32).eps * ref.mean**2 / ref.var
    assert 1e-5 < std_rtol < 5e-5
    assert opt.grad_norm_std.item() == pytest.approx(math.sqrt(ref.var), rel=std_rtol)
    assert opt.spike_count.item() == ref.spikes >= 2
    assert opt.spike_skips.item() == ref.spike_skips
    assert opt.skipped_steps.item() == NONFINITE_STEPS  # spike skips are counted apart from non-finite ones
    if skip_threshold is not None:
        assert ref.spike_skips >= 1
    if skip_ratio:  # the sequence has spikes above the z threshold below the ratio: the ratio keeps them
        z_alone = ZScoreReference(alpha, threshold, warmup, max_norm, clip == "zscore", skip_threshold)
        assert sum(z_alone.step(n)[1] for n in norm_sequence()) > ref.spike_skips


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_no_false_alarms_on_a_steady_run(backend):
    p = torch.nn.Parameter(torch.randn(100))
    opt = FusedAdamW([p], lr=1e-3, clip="zscore", spike_skip_threshold=6.0, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        p.grad = torch.randn(100, generator=gen)  # norms ~ 10 +- 0.7: a normal run
        opt.step()
    # z > 2.5 happens to ~1% of normal steps: ZClip clips those gently by design, but nothing near an
    # alarm level (a guard alerts far above the clip threshold) and nothing is skipped
    assert opt.spike_skips.item() == 0 and opt.skipped_steps.item() == 0
    assert opt.spike_count.item() <= 4
    assert 2.0 < opt.max_zscore.item() < 5.0


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_spike_bookkeeping_and_state_round_trip(backend):
    p = torch.nn.Parameter(torch.randn(10))
    opt = FusedAdamW([p], lr=1e-3, clip="zscore", zscore_warmup=5, backend=backend)
    for step in range(12):
        p.grad = torch.full((10,), 100.0 if step == 8 else (1.0 if step % 2 else 1.2))
        opt.step()
    assert opt.spike_count.item() == 1
    assert opt.last_spike_step.item() == 8
    assert opt.last_spike_norm.item() == pytest.approx(100.0 * math.sqrt(10), rel=1e-6)
    assert opt.max_zscore_step.item() == 8 and opt.max_zscore.item() > 100
    assert opt.max_zscore_norm.item() == pytest.approx(100.0 * math.sqrt(10), rel=1e-6)
    opt.reset_max_zscore()
    assert opt.max_zscore.item() == float("-inf") and opt.max_zscore_step.item() == -1
    p.grad = torch.full((10,), 1.2)
    opt.step()
    assert opt.max_zscore_step.item() == 12 and opt.max_zscore.item() < 2.5
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = FusedAdamW([q], lr=1e-3, clip="zscore", zscore_warmup=5, backend=backend)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    for name in ("grad_norm_mean", "grad_norm_std", "spike_count", "last_spike_step", "applied_steps", "max_zscore"):
        assert torch.equal(getattr(opt, name), getattr(opt2, name)), name


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_reset_grad_norm_stats_rewarms_detection(backend):
    p = torch.nn.Parameter(torch.randn(10))
    opt = FusedAdamW([p], lr=1e-3, clip="zscore", zscore_warmup=4, backend=backend)
    for step in range(6):
        p.grad = torch.full((10,), 1.0 if step % 2 else 1.2)
        opt.step()
    p.grad = torch.full((10,), 10.0)  # a new regime: a spike against the old statistics
    opt.step()
    assert opt.spike_count.item() == 1
    opt.reset_grad_norm_stats()
    for _ in range(6):  # the new regime is the new normal once the statistics warm up again
        p.grad = torch.full((10,), 10.0)
        opt.step()
    assert opt.spike_count.item() == 1
    assert opt.grad_norm_mean.item() == pytest.approx(10.0 * math.sqrt(10), rel=1e-5)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_worst_step_window_matches_plain_python(backend):
    """The decision's polling window: the step with the largest z-score (a non-finite one counts as the worst,
    the first of equals stays), its norm and its per-tensor grad norms, by flat param position. Two dtypes (the
    kernels order tensors by dtype) and a param without a grad (not in the step) put the slots out of order."""
    gen = torch.Generator().manual_seed(3)
    shapes, dtypes = [(6,), (3, 4), (5,), (2, 2)], [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(shapes, dtypes)]
    frozen = torch.nn.Parameter(torch.randn(3))
    order = [params[0], params[1], frozen, params[2], params[3]]  # param_groups order
    opt = FusedAdamW([{"params": order[:2]}, {"params": order[2:]}], lr=1e-3, zscore_warmup=4, backend=backend)
    spikes = {9: (2, 50.0), 13: (1, 20.0)}  # step -> (tensor, factor)
    nan_at, poll_after = 15, (10, 14, 17)
    worst = None  # (key, index, norm, per-tensor norms)
    polled = []
    for index in range(17):
        step = index + 1
        grads = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes)]
        if step in spikes:
            tensor, factor = spikes[step]
            grads[tensor] = grads[tensor] * factor
        if step == nan_at:
            grads[3] = grads[3] * math.nan
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        norms = [float(g.double().norm()) for g in grads]
        norm = math.sqrt(sum(n * n for n in norms))
        key = math.inf if not math.isfinite(norm) else opt.last_zscore.item()
        if worst is None or key > worst[0]:
            worst = (key, index, norm, [norms[0], norms[1], 0.0, norms[2], norms[3]])
        if step in poll_after:
            key, where, worst_norm, per_tensor = worst
            polled.append(where)
            assert opt.worst_step.item() == where, step
            assert opt.worst_step_zscore.item() == pytest.approx(key, rel=1e-6)
            assert_close(opt.worst_step_norm, torch.tensor(worst_norm), 1e-5, 1e-6, f"worst norm at {step}")
            assert_close(opt.worst_step_grad_norms(), torch.tensor(per_tensor), 1e-5, 1e-6, f"per-tensor at {step}")
            opt.reset_max_zscore()
            assert opt.worst_step.item() == -1 and opt.worst_step_zscore.item() == -math.inf
            assert opt.worst_step_grad_norms().abs().sum().item() == 0
            worst = None
    assert polled == [8, 12, 14]  # the two spikes (steps 9 and 13) and the non-finite step 15, as indices from 0
    assert opt.skipped_steps.item() == 1 and opt.applied_steps.item() == 16
