"""Tolerances from a measured floor, for the trajectory tests in low precision (bf16 / fp16 autocast).

Under autocast two correct AdamW implementations drift apart on their own: their fp32 results differ in the last
bit on some elements, that flips some bf16 / fp16 roundings in the next forward pass, the gradients then differ
by low-precision ulps, and Adam's per-element normalisation turns that into differences far above fp32 rounding.
How far depends on the library versions, the CPU and the data, so no constant fits every machine. The floor is
measured in the test, on the same run: torch's for-loop AdamW (the reference) against

- torch's fused AdamW (`AdamW(fused=True)`), and
- torch's AdamW computing in float64, each param the correctly rounded result (`ExactAdamW`),

and fused_stable must stay within FLOOR_FACTOR times the larger of the two deviations, never below one fp32 ulp
of the largest value compared. Both alternatives are needed: on CPU torch's fused kernel repeats its for-loop's
arithmetic on most elements, so in the fp16 Lightning run it ended 3.7e-9 from the reference (fused_stable:
7.2e-7), while the float64 run, which differs by rounding on every element as fused_stable's kernels do, ended
8.3e-6 away (torch 2.13, this project's CPU machine; 2026-12-01).

FLOOR_FACTOR = 4. The floor is one sample of a chaotic drift, and so is fused_stable's deviation: measured over 12
runs of the Lightning test's recipe (6 data seeds x bf16 and fp16, torch 2.13 on this project's CPU machine,
2026-12-01), fused_stable's parameters ended 0.02x to 2.3x the floor from torch's (median 0.06x), and the same run
with the lr 1% too high, a small real bug, ended 4.4x to 23,000x the floor (median ~60x; on the test's own data
1,670x in bf16 and 18x in fp16).

Losses and gradient norms are compared step by step, where one flipped rounding moves a single step's value and
a floor sampled from two other runs says little (measured: the floor of the grad norms was below 2.4e-7 in 4 of
those 12 runs while fused_stable's moved by up to 1.7e-4 at one step). The first step, before any parameter has
moved, must agree to fp32 rounding; later steps within one unit roundoff of the autocast format (`UNIT_ROUNDOFF`:
2^-8 for bf16, 2^-11 for fp16), relative: the size of one rounding in that format, which the drift stays well
below (measured over the same 12 runs: at most 1.3e-4 relative in bf16, 1.7e-5 in fp16).
"""

from __future__ import annotations

import math

import numpy as np
import torch

FLOOR_FACTOR = 4.0
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


class ExactAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW run on float64 copies of the params and their gradients: each step's result is rounded
    once into the fp32 params (the moments stay float64). The same algorithm as the reference, without its fp32
    rounding: how far a correct implementation may drift from torch's in low precision."""

    def __init__(self, params, **kwargs):
        super().__init__(params, dict(kwargs))
        self.exact = [[p.detach().double().clone() for p in g["params"]] for g in self.param_groups]
        groups = [
            {"params": exact, **{k: v for k, v in g.items() if k != "params"}}
            for exact, g in zip(self.exact, self.param_groups)
        ]
        self.inner = torch.optim.AdamW(groups)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group, inner, exact in zip(self.param_groups, self.inner.param_groups, self.exact):
                inner["lr"] = group["lr"]  # a host LR scheduler drives the outer groups
                for p, e in zip(group["params"], exact):
                    e.copy_(p)
                    e.grad = None if p.grad is None else p.grad.double()
            self.inner.step()
            for group, exact in zip(self.param_groups, self.exact):
                for p, e in zip(group["params"], exact):
                    p.copy_(e)
        return loss


def _values(x) -> list[torch.Tensor]:
    """A module's parameters, a list of tensors, or a list of numbers, as float64 tensors."""
    if isinstance(x, torch.nn.Module):
        return [p.detach().double() for p in x.parameters()]
    if isinstance(x, (list, tuple)) and x and all(torch.is_tensor(t) for t in x):
        return [t.detach().double() for t in x]
    return [torch.as_tensor(x, dtype=torch.float64).flatten()]


def deviation(a, b) -> float:
    """The largest absolute difference between two modules' parameters, two lists of tensors or of numbers."""
    pairs = list(zip(_values(a), _values(b)))
    assert pairs and all(x.shape == y.shape for x, y in pairs)
    return max(float((x - y).abs().max()) for x, y in pairs)


def fp32_ulp(x) -> float:
    """One fp32 ulp of the largest magnitude in `x`: the least two fp32 computations of it can differ by."""
    largest = max(float(v.abs().max()) for v in _values(x))
    return float(np.spacing(np.float32(largest)))


def scale_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between `a` and `b` in fp32 ulps of the tensor's largest magnitude (the rounding
    of `p + step` lands on the param's grid, whatever one element's own size)."""
    return float((a - b).abs().max() / (torch.maximum(a.abs().max(), b.abs().max()) * 2**-23))


def assert_within_floor(what: str, ours, reference, alternatives: list, factor: float = FLOOR_FACTOR) -> float:
    """ours (fused_stable) within `factor` x the floor (the largest deviation of torch's `alternatives` from the
    torch `reference`) of the reference; returns the floor. Modules (their parameters), lists of tensors or of
    numbers."""
    floor = max(deviation(alt, reference) for alt in alternatives)
    allowed = factor * max(floor, fp32_ulp(reference))
    got = deviation(ours, reference)
    assert math.isfinite(got) and got <= allowed, (
        f"{what}: {got:.3g} from torch's, allowed {allowed:.3g} = {factor:g} x the floor {floor:.3g} "
        "(torch's AdamW against its fused and its float64 self on the same run)"
    )
    return floor


def assert_steps_close(what: str, ours: list[float], reference: list[float], autocast_dtype: torch.dtype) -> None:
    """Per-step values of a run in low precision (losses, grad norms): the first step to fp32 rounding (nothing
    has moved yet), the later ones within one unit roundoff of the autocast format, relative."""
    assert len(ours) == len(reference) > 1, what
    first = abs(ours[0] - reference[0])
    assert first <= 4 * float(np.spacing(np.float32(abs(reference[0])))), f"{what} at the first step: {first:.3g}"
    unit = UNIT_ROUNDOFF[autocast_dtype]
    for step, (a, b) in enumerate(zip(ours, reference)):
        assert abs(a - b) <= unit * abs(b), f"{what} at step {step}: {a} against torch's {b} (allowed: {unit:g} rel)"
