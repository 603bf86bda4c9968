"""Every threshold sits exactly where the docs put it: a z-score equal to a threshold does not cross it, the
next float above does ("z-score exceeds zscore_threshold", "skips steps above this z-score", guard alerts at
"z > 6"), and the guard's grad-norm alert needs the ratio condition too ("z > 6 and norm >= 5x the running
mean"; `guard_grad_ratio` 0 = z alone)."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch
from helpers import WITH_TENSOR_DECISIONS

from fused_stable import FusedAdamW
from fused_stable.guard import GRAD_SPIKE, LOSS_SPIKE, Guard

CLIP_Z, SKIP_Z = 2.5, 4.0


def _warm_optimizer(backend):
    """A one-element param (its grad norm is |grad|, exactly) whose norm statistics are warm."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = FusedAdamW(
        [p],
        lr=1e-3,
        clip="zscore",
        zscore_threshold=CLIP_Z,
        zscore_warmup=4,
        spike_skip_threshold=SKIP_Z,
        backend=backend,
    )
    for g in (1.0, 1.25, 1.0, 1.25, 1.125):
        p.grad = torch.tensor([g])
        opt.step()
    return opt


def _step_copy(opt, norm: np.float32):
    """One step of a copy of `opt` with grad norm `norm`; `opt` itself is untouched."""
    trial = copy.deepcopy(opt)
    trial.param_groups[0]["params"][0].grad = torch.tensor([float(norm)])
    trial.step()
    return trial


def _norm_at_zscore(opt, z: float) -> np.float32:
    """The float32 grad norm whose z-score, as the optimizer computes it, is exactly `z`."""
    mean, std = opt.grad_norm_mean.item(), opt.grad_norm_std.item()
    guess = np.float32(mean + z * (std + 1e-6))
    candidates = [guess]
    for direction in (np.float32(np.inf), np.float32(-np.inf)):
        x = guess
        for _ in range(8):
            x = np.nextafter(x, direction)
            candidates.append(x)
    for x in candidates:
        if _step_copy(opt, x).last_zscore.item() == z:
            return x
    raise AssertionError(f"no float32 norm within 8 ulps of {guess} gives z = {z} exactly")


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
def test_a_zscore_equal_to_the_clip_threshold_is_not_a_spike(backend):
    opt = _warm_optimizer(backend)
    at = _norm_at_zscore(opt, CLIP_Z)
    on = _step_copy(opt, at)
    assert on.spike_count.item() == 0 and on.last_spike_step.item() == -1
    assert not on.last_step_skipped.item()
    above = _step_copy(opt, np.nextafter(at, np.float32(np.inf)))
    assert above.last_zscore.item() > CLIP_Z
    assert above.spike_count.item() == 1 and not above.last_step_skipped.item()


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
def test_a_zscore_equal_to_spike_skip_threshold_is_applied_the_next_float_is_skipped(backend):
    opt = _warm_optimizer(backend)
    at = _norm_at_zscore(opt, SKIP_Z)
    on = _step_copy(opt, at)
    assert not on.last_step_skipped.item() and on.spike_skips.item() == 0
    assert on.applied_steps.item() == opt.applied_steps.item() + 1
    assert on.spike_count.item() == 1  # above the clip threshold: a (clipped) spike, not a skipped one
    above = _step_copy(opt, np.nextafter(at, np.float32(np.inf)))
    assert above.last_zscore.item() > SKIP_Z
    assert above.last_step_skipped.item() and above.spike_skips.item() == 1
    # skipped_steps counts non-finite steps only
    # (docs/optimizer.md: "skipped for non-finite gradients / for norm spikes")
    assert above.skipped_steps.item() == opt.skipped_steps.item() == 0 and not above.last_step_found_inf.item()
    assert above.applied_steps.item() == opt.applied_steps.item()
    assert torch.equal(above.param_groups[0]["params"][0], opt.param_groups[0]["params"][0])


# ------------------------------------------------------------------------------------------------ the guard
def _guarded_run(guard: Guard, spike: float, steps: int = 30, loss_at_end: float | None = None):
    """Steady N(0, 1) grads for `steps` steps, then one step with grads x `spike`; one check at the end.
    Losses are steady noise around 2.0 (and `loss_at_end` on the last step). Returns the check's decision."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (64, 32)]
    opt = FusedAdamW(params, lr=1e-3, clip="zscore", backend="torch")
    guard.bind(opt)
    rows = []
    for step in range(1, steps + 2):
        factor = spike if step == steps + 1 else 1.0
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * factor
        opt.step()
        loss = loss_at_end if step == steps + 1 and loss_at_end is not None else 2.0 + 0.05 * rng.gauss(0, 1)
        rows.append({"step": step, "loss": loss, "skipped": False})
    z = opt.max_zscore.item()
    guard.ratio_seen = opt.max_zscore_norm.item() / opt.grad_norm_mean.item()  # what the check compares
    return guard.check(steps + 1, opt, rows), z


def _kinds(decision):
    return [a.kind for a in decision.alerts]


def test_grad_spike_alert_needs_z_strictly_above_guard_grad_z():
    _, z = _guarded_run(Guard(grad_ratio=0.0), spike=1.6)
    assert 6.0 < z < 1e3
    on, _ = _guarded_run(Guard(grad_z=z, grad_ratio=0.0), spike=1.6)
    assert GRAD_SPIKE not in _kinds(on)
    below, _ = _guarded_run(Guard(grad_z=float(np.nextafter(np.float32(z), np.float32(0))), grad_ratio=0.0), spike=1.6)
    assert GRAD_SPIKE in _kinds(below)


def test_guard_grad_ratio_is_honoured():
    """A step at 1.6x the usual norm has a large z-score on a steady run (z ~ 9 here) but is no alert under the
    default ratio 5: heavy-tailed small batches look like that. Ratio 0 (z alone) or a ratio just below the
    step's norm / running mean alert; just above does not."""
    probe = Guard()
    default, z = _guarded_run(probe, spike=1.6)
    ratio = probe.ratio_seen
    assert z > 6.0 and 1.2 < ratio < 5.0
    assert GRAD_SPIKE not in _kinds(default)
    assert GRAD_SPIKE in _kinds(_guarded_run(Guard(grad_ratio=0.0), spike=1.6)[0])
    assert GRAD_SPIKE in _kinds(_guarded_run(Guard(grad_ratio=ratio * 0.999), spike=1.6)[0])
    assert GRAD_SPIKE not in _kinds(_guarded_run(Guard(grad_ratio=ratio * 1.001), spike=1.6)[0])
    # and a real spike (10x the mean norm) passes the default ratio
    assert GRAD_SPIKE in _kinds(_guarded_run(Guard(), spike=10.0)[0])


def test_loss_spike_alert_needs_z_strictly_above_guard_loss_z():
    loss = 2.4
    # the statistics the final check judges its last loss by: those of the 30 steady losses before it (a
    # non-finite last loss is not folded in)
    reference = Guard()
    _guarded_run(reference, spike=1.0, loss_at_end=float("nan"))
    z = reference.loss_stats.zscore(loss)
    assert 6.0 < z < 100
    on, _ = _guarded_run(Guard(loss_z=z), spike=1.0, loss_at_end=loss)
    assert LOSS_SPIKE not in _kinds(on)
    below, _ = _guarded_run(Guard(loss_z=math.nextafter(z, 0.0)), spike=1.0, loss_at_end=loss)
    assert LOSS_SPIKE in _kinds(below)
