"""accelerate: ``accelerator.prepare(model, FusedAdamW(...))`` trains a tiny Llama with no
``accelerator.clip_grad_norm_`` and matches torch AdamW + accelerate's clipping, under bf16 and under
accelerate's fp16 code path (its GradScaler). On CPU accelerate itself gives fp16 no autocast and no
scaler, which the first test pins down; the fp16 scaler path is then driven by handing the accelerator a
scaler, as it builds one on a GPU."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from integ_floor import ExactAdamW, assert_steps_close, assert_within_floor
from integ_models import TokenDataset, tiny_llama
from torch.optim.lr_scheduler import LambdaLR

import fused_stable
from fused_stable import FusedAdamW, schedules
from fused_stable.integrations.hf import DeviceScheduleLR

STEPS = 5
LR = 3e-3
MAX_NORM = 1.0


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # accelerate keeps one process-wide state; each test builds its own Accelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def batches():
    data = TokenDataset(n=4 * STEPS)
    return [
        {k: torch.stack([data[i][k] for i in range(s * 4, s * 4 + 4)]) for k in ("input_ids", "labels")}
        for s in range(STEPS)
    ]


def train(mixed_precision: str, fused: bool, scaler=None, poison_step: int | None = None, torch_kind="for-loop"):
    """`fused`: FusedAdamW; else torch's AdamW (`torch_kind`: its for-loop, or the floor's alternatives "fused"
    and "exact" of integ_floor) with accelerate's clipping."""
    acc = Accelerator(cpu=True, mixed_precision=mixed_precision)
    if scaler is not None:
        acc.scaler = scaler  # what Accelerator.__init__ does for fp16 on a GPU
    model = tiny_llama()
    sched = schedules.warmup_cosine(STEPS, 2)
    if fused:
        opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=0.1, max_grad_norm=MAX_NORM, lr_schedule=sched)
        lr_sched = DeviceScheduleLR(opt)  # a scheduler object for prepare() that changes no lr
    else:
        kind = dict(fused=torch_kind == "fused")
        opt = (ExactAdamW if torch_kind == "exact" else torch.optim.AdamW)(
            model.parameters(), lr=LR, weight_decay=0.1, **({} if torch_kind == "exact" else kind)
        )
        lr_sched = LambdaLR(opt, sched.factor)
    model, opt, lr_sched = acc.prepare(model, opt, lr_sched)
    losses, norms, skipped_by_accelerate = [], [], []
    for step, batch in enumerate(batches()):
        loss = model(**batch).loss
        acc.backward(loss)
        if poison_step == step:
            next(model.parameters()).grad[0, 0] = float("nan")
        if fused:
            opt.step()  # clipping, inf check and unscale happen inside
            norms.append(opt.optimizer.grad_norm.item())
        else:
            norms.append(acc.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
        skipped_by_accelerate.append(opt.step_was_skipped)
        lr_sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return acc, model, opt, losses, norms, skipped_by_accelerate


def assert_same_params(a, b, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_fp16_on_cpu_is_plain_fp32_in_accelerate():
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    # accelerate builds neither autocast nor a GradScaler for fp16 on CPU: it trains in fp32
    assert acc.scaler is None and acc.native_amp is False


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16", "no"])
def test_prepare_trains_like_adamw_with_accelerate_clipping(mixed_precision):
    _, ref_model, _, ref_losses, ref_norms, _ = train(mixed_precision, fused=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    _, model, opt, losses, norms, _ = train(mixed_precision, fused=True)
    assert max(ref_norms) > MAX_NORM  # the clip bites
    assert int(opt.optimizer.skipped_steps) == 0
    if mixed_precision != "bf16":  # fp32 (accelerate's fp16 on CPU is fp32 too, see above): torch's to rounding
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert_same_params(model, ref_model)
        return
    # bf16 autocast: the drift of low precision, measured on the same run (integ_floor)
    alternatives = []
    for kind in ("fused", "exact"):
        AcceleratorState._reset_state(reset_partial_state=True)
        alternatives.append(train(mixed_precision, fused=False, torch_kind=kind)[1])
    assert_within_floor("params", model, ref_model, alternatives)
    assert_steps_close("losses", losses, ref_losses, torch.bfloat16)
    assert_steps_close("grad norms", norms, ref_norms, torch.bfloat16)


@pytest.mark.parametrize("scaler_cls", [fused_stable.GradScaler, torch.amp.GradScaler], ids=["fused", "torch"])
def test_fp16_scaler_path_matches_and_overflow_does_not_advance_schedule(scaler_cls):
    # loss scale 2**10: scaled grads, unscaled inside the fused step
    _, ref_model, _, ref_losses, _, _ = train("no", fused=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    _, model, opt, losses, norms, _ = train("no", fused=True, scaler=scaler_cls("cpu", init_scale=2.0**10))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_params(model, ref_model)

    AcceleratorState._reset_state(reset_partial_state=True)
    acc, model, opt, losses, norms, skipped = train(
        "no", fused=True, scaler=scaler_cls("cpu", init_scale=2.0**10), poison_step=2
    )
    fused_opt = opt.optimizer
    # accelerate thinks no step was skipped (GradScaler always calls a scaling-aware optimizer's step)...
    assert skipped == [False] * STEPS
    # ...but the fused step skipped it: one skip, four applied updates, the scale backed off once
    assert int(fused_opt.skipped_steps) == 1 and int(fused_opt.applied_steps) == STEPS - 1
    assert acc.scaler.get_scale() == 2.0**9
    # and the device-side schedule counted only applied updates: last lr = factor(3), not factor(4)
    sched = schedules.warmup_cosine(STEPS, 2)
    assert fused_opt.last_lr.item() == pytest.approx(LR * sched.factor(STEPS - 2), rel=1e-6)
