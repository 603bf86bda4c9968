"""A state dict without FusedAdamW's own counters (torch.optim.AdamW's, or what torch.distributed.checkpoint's
get/set_optimizer_state_dict keep) continues the device-side schedule from the steps already taken
(docs/integrations.md): the applied-step count is recovered from the per-parameter `step` counters."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import BACKEND_PARAMS

from fused_stable import FusedAdamW, schedules

LR, STEPS_BEFORE = 0.1, 3


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("source", ["torch.optim.AdamW", "FusedAdamW without its counters"])
def test_a_state_without_counters_continues_the_schedule(backend, source):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (6, 40)]
    schedule = schedules.warmup_linear(10, 0)  # lr x 1.0, 0.9, 0.8, ...
    if source == "torch.optim.AdamW":
        first = torch.optim.AdamW(params, lr=LR)
    else:
        first = FusedAdamW(params, lr=LR, lr_schedule=schedule, backend=backend)
    for _ in range(STEPS_BEFORE):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        first.step()
    state = _round_trip(first.state_dict())
    state.pop("fused_stable", None)  # what get_/set_optimizer_state_dict drop
    resumed = FusedAdamW(
        [torch.nn.Parameter(p.detach().clone()) for p in params], lr=LR, lr_schedule=schedule, backend=backend
    )
    resumed.load_state_dict(state)
    assert resumed.applied_steps.item() == STEPS_BEFORE
    for p in resumed.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape, generator=gen)
    resumed.step()
    assert resumed.last_lr.item() == pytest.approx(LR * schedule.factor(STEPS_BEFORE), rel=1e-6)
    assert resumed.applied_steps.item() == STEPS_BEFORE + 1
