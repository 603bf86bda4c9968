"""The real Lightning Trainer on a tiny Llama (CPU): FusedAdamW + FusedStableCallback follows the trajectory of
torch AdamW with Lightning's own gradient_clip_val at precision 32, bf16-mixed and fp16 with a scaler, logs the
pre-clip grad norm, skipped steps and the lr really used, refuses double clipping, resumes exactly from a
checkpoint, and works with manual optimization.

fp16 on CPU: Lightning turns Trainer(accelerator="cpu", precision="16-mixed") into bf16-mixed (with a warning),
so fp16 runs here through the MixedPrecision plugin (fp16_mixed_precision("cpu"), or MixedPrecision with torch's
GradScaler): real fp16 autocast and a real loss scaler on CPU.
"""

from __future__ import annotations

import contextlib
import csv
import os

import lightning as L
import pytest
import torch
from helpers import no_host_reads
from integ_floor import ExactAdamW, assert_steps_close, assert_within_floor
from integ_models import TokenDataset, tiny_llama
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim.lr_scheduler import LambdaLR

from fused_stable import FusedAdafactor, FusedAdamW, FusedLion, FusedMuon, FusedSGD, muon_param_groups, schedules
from fused_stable.integrations.lightning import FusedStableCallback, fp16_mixed_precision

STEPS = 6
LR = 3e-3
WEIGHT_DECAY = 0.1
CLIP = 1.0
INIT_SCALE = 2.0**10
PRECISIONS = ["32", "bf16-mixed", "fp16", "fp16-torch-scaler"]


def schedule() -> schedules.Schedule:
    return schedules.warmup_cosine(STEPS, 2)


def fused_adamw(module, **overrides):
    kwargs = dict(lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=CLIP, lr_schedule=schedule())
    kwargs.update(overrides)
    return FusedAdamW(module.parameters(), **kwargs)


def torch_adamw_scheduled(module, kind="for-loop"):
    """The usual recipe: torch AdamW, the same warm-up + cosine as a step-wise LambdaLR (Lightning clips).
    `kind`: the reference's for-loop implementation, or one of the floor's alternatives (integ_floor): "fused"
    (`AdamW(fused=True)`; told not to take the scaler's unscaling, which Lightning refuses next to its clipping,
    so GradScaler unscales first as for the reference) or "exact" (torch's AdamW in float64)."""
    opt = torch_adamw(module, kind)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": LambdaLR(opt, schedule().factor), "interval": "step"}}


def torch_adamw(module, kind="for-loop"):
    if kind == "exact":
        return ExactAdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=kind == "fused")
    if kind == "fused":
        opt._step_supports_amp_scaling = False
    return opt


class LlamaModule(L.LightningModule):
    """A tiny Llama; records what hooks see (grad norms, per-tensor norms, group 0's lr) at every optimizer step.

    ``poison_step`` (1-based optimizer step) writes an inf into one gradient after backward.
    ``manual`` trains with manual optimization, one optimizer step per batch (all optimizers in turn).
    """

    def __init__(self, make_optimizers, *, manual=False, poison_step=None, manual_clip=None):
        super().__init__()
        self.model = tiny_llama()
        self.make_optimizers = make_optimizers
        self.automatic_optimization = not manual
        self.poison_step = poison_step
        self.manual_clip = manual_clip
        self.hook_norms: list[float] = []
        self.hook_per_tensor: list[torch.Tensor] = []
        self.hook_lrs: list[float] = []
        self.losses: list[float] = []
        self.pre_clip_per_tensor: list[torch.Tensor] = []  # manual optimization: right after backward

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        self.manual_backward(loss)
        self.pre_clip_per_tensor.append(torch.stack([p.grad.float().norm() for p in self.parameters()]))
        for opt in optimizers:
            if self.manual_clip is not None:
                self.clip_gradients(opt, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm")
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
        return loss

    def on_after_backward(self):
        if self.poison_step is not None and self.trainer.global_step + 1 == self.poison_step:
            self.model.model.layers[0].mlp.up_proj.weight.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, optimizer):
        per_tensor = torch.stack([p.grad.float().norm() for p in self.parameters() if p.grad is not None])
        self.hook_per_tensor.append(per_tensor)
        self.hook_norms.append(float(per_tensor.norm()))
        self.hook_lrs.append(float(optimizer.param_groups[0]["lr"]))

    def configure_optimizers(self):
        return self.make_optimizers(self.model)


def loader(n: int = 4 * STEPS):
    return torch.utils.data.DataLoader(TokenDataset(n=n), batch_size=4, shuffle=False)


def precision_kwargs(precision: str) -> dict:
    if precision == "fp16":
        return {"plugins": [fp16_mixed_precision("cpu", init_scale=INIT_SCALE)]}
    if precision == "fp16-torch-scaler":
        return {
            "plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))]
        }
    return {"precision": "32-true" if precision == "32" else precision}


def fit(module, out, *, precision="32", callbacks=(), ckpt_path=None, log_every=1, **trainer_kwargs):
    """Trains on CPU; returns the trainer and the CSV-logged metrics merged per step."""
    logger = CSVLogger(str(out), name="logs")
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=logger,
        log_every_n_steps=log_every,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=list(callbacks),
        num_sanity_val_steps=0,
    )
    kwargs.update(precision_kwargs(precision))
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(**kwargs)
    trainer.fit(module, train_dataloaders=loader(), ckpt_path=ckpt_path)
    return trainer, read_metrics(logger)


def read_metrics(logger: CSVLogger) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    path = os.path.join(logger.log_dir, "metrics.csv")
    if not os.path.exists(path):  # nothing was logged
        return rows
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(row.pop("step"))
            rows.setdefault(step, {}).update({k: float(v) for k, v in row.items() if v != ""})
    return rows


def logged(metrics: dict[int, dict[str, float]], key: str) -> list[float]:
    return [metrics[step][key] for step in sorted(metrics) if key in metrics[step]]


def fused_of(trainer) -> FusedAdamW:
    (opt,) = [o for o in trainer.optimizers if isinstance(o, FusedAdamW)]
    return opt


def assert_same_params(module, reference, rtol, atol):
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# fp32 matches torch to rounding: (rtol, atol). Under bf16 / fp16 autocast the optimizers' last-bit differences
# flip low-precision roundings in later forward passes and the trajectories drift apart by far more, by how much
# depends on the machine: there the tolerance is measured on the same run (integ_floor: torch against torch).
FP32_TOLERANCE = (1e-5, 1e-6)


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    """The usual recipe per precision: torch AdamW + LambdaLR + Trainer(gradient_clip_val=1.0); in bf16 and fp16
    also the floor's alternatives (torch's fused and float64 AdamW), as "<precision>/<kind>"."""
    runs = {}
    for precision in ("32", "bf16-mixed", "fp16"):
        for kind in ("for-loop", "fused", "exact") if precision != "32" else ("for-loop",):
            module = LlamaModule(lambda model, kind=kind: torch_adamw_scheduled(model, kind))
            out = tmp_path_factory.mktemp(f"torch-{precision}-{kind}")
            trainer, metrics = fit(
                module, out, precision="fp16-torch-scaler" if precision == "fp16" else precision, gradient_clip_val=CLIP
            )
            runs[precision if kind == "for-loop" else f"{precision}/{kind}"] = (module, trainer, metrics)
    return runs


@pytest.mark.parametrize("precision", PRECISIONS)
def test_same_trajectory_as_torch_adamw_with_lightning_clipping(torch_runs, tmp_path, precision):
    reference = "fp16" if precision.startswith("fp16") else precision
    ref_module, _, _ = torch_runs[reference]
    module = LlamaModule(fused_adamw)
    trainer, metrics = fit(module, tmp_path, precision=precision, callbacks=[FusedStableCallback()])
    # the clip bites at every step of this run, or the comparison would not test it
    assert min(ref_module.hook_norms) > CLIP
    # logged at every step: the pre-clip, unscaled norm (torch's hook sees grads Lightning already unscaled)
    assert sorted(metrics) == list(range(STEPS))
    if precision == "32":
        rtol, atol = FP32_TOLERANCE
        assert module.losses == pytest.approx(ref_module.losses, rel=rtol, abs=atol)
        assert logged(metrics, "grad_norm") == pytest.approx(ref_module.hook_norms, rel=1e-5)
        assert_same_params(module, ref_module, rtol, atol)
    else:
        alternatives = [torch_runs[f"{reference}/{kind}"][0] for kind in ("fused", "exact")]
        floor = assert_within_floor("params", module, ref_module, alternatives)
        assert floor > 0  # the low-precision drift the floor stands for is there to be measured
        dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
        assert_steps_close("losses", module.losses, ref_module.losses, dtype)
        assert_steps_close("grad norms", logged(metrics, "grad_norm"), ref_module.hook_norms, dtype)
    # the lr the fused step used (device schedule) is the lr the torch step used (host LambdaLR)
    assert logged(metrics, "learning_rate") == pytest.approx(ref_module.hook_lrs, rel=1e-6, abs=1e-12)
    assert logged(metrics, "skipped_steps") == [0] * STEPS
    assert logged(metrics, "spike_skips") == [0] * STEPS
    opt = fused_of(trainer)
    assert int(opt.applied_steps) == STEPS
    if precision.startswith("fp16"):
        assert trainer.precision_plugin.scaler.get_scale() == INIT_SCALE  # no overflow, no growth yet


def test_fp16_overflow_step_is_skipped_like_torch_gradscaler(tmp_path):
    """An inf gradient under fp16: the fused step skips it and the scale backs off once, as in torch's recipe;
    with fused_stable's GradScaler the run is bit-identical to the one with torch's GradScaler."""

    def fused_constant_lr(model):
        return fused_adamw(model, lr_schedule=None)  # Lightning would advance a host scheduler on the skip

    module = LlamaModule(fused_constant_lr, poison_step=3)
    trainer, metrics = fit(module, tmp_path / "fused", precision="fp16", callbacks=[FusedStableCallback()])
    assert logged(metrics, "skipped_steps") == [0, 0, 1, 1, 1, 1]
    assert torch.isinf(torch.tensor(logged(metrics, "grad_norm")[2]))
    assert int(fused_of(trainer).applied_steps) == STEPS - 1
    assert trainer.precision_plugin.scaler.get_scale() == INIT_SCALE / 2

    with_torch_scaler = LlamaModule(fused_constant_lr, poison_step=3)
    torch_scaler_trainer, _ = fit(with_torch_scaler, tmp_path / "torch-scaler", precision="fp16-torch-scaler")
    assert_same_params(module, with_torch_scaler, rtol=0, atol=0)
    assert torch_scaler_trainer.precision_plugin.scaler.get_scale() == INIT_SCALE / 2

    runs = {}
    for kind in ("for-loop", "fused", "exact"):  # torch's recipe, and the floor's alternatives (integ_floor)
        runs[kind] = LlamaModule(lambda model, kind=kind: torch_adamw(model, kind), poison_step=3)
        trainer, _ = fit(runs[kind], tmp_path / kind, precision="fp16-torch-scaler", gradient_clip_val=CLIP)
        assert trainer.precision_plugin.scaler.get_scale() == INIT_SCALE / 2
    # at a constant lr of 3e-3 from the first step the fp16 drift is larger than in the scheduled run
    assert_within_floor("params", module, runs["for-loop"], [runs["fused"], runs["exact"]])


def test_skipped_step_keeps_params_and_does_not_advance_schedule(tmp_path):
    module = LlamaModule(fused_adamw, poison_step=3)
    snapshots = []

    class Snapshots(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            snapshots.append(pl_module.model.lm_head.weight.detach().clone())

    trainer, metrics = fit(module, tmp_path, callbacks=[FusedStableCallback(), Snapshots()])
    assert logged(metrics, "skipped_steps") == [0, 0, 1, 1, 1, 1]
    torch.testing.assert_close(snapshots[2], snapshots[1], rtol=0, atol=0)  # nothing applied at the inf step
    assert not torch.equal(snapshots[3], snapshots[2])
    # the step after the skip uses the lr the skipped step would have used
    lrs = logged(metrics, "learning_rate")
    applied = [lr for i, lr in enumerate(lrs) if i != 2]
    assert applied == pytest.approx([LR * schedule().factor(n) for n in range(STEPS - 1)], rel=1e-6, abs=1e-12)


def test_hooks_see_scaled_grads_under_fp16_and_the_optimizer_reports_unscaled_norms(tmp_path):
    """FusedAdamW unscales inside step(), so Lightning does not unscale before on_before_optimizer_step: hooks see
    grads times the loss scale; opt.grad_norm and per_tensor_grad_norms() are the unscaled pre-clip values."""
    module = LlamaModule(fused_adamw)
    per_step = []

    class ReadOptimizer(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            opt = fused_of(trainer)
            per_step.append((float(opt.grad_norm), opt.per_tensor_grad_norms().clone()))

    trainer, _ = fit(module, tmp_path, precision="fp16", callbacks=[ReadOptimizer()])
    scale = trainer.precision_plugin.scaler.get_scale()
    assert scale == INIT_SCALE
    assert max(norm for norm, _ in per_step) > CLIP  # pre-clip: not capped at max_grad_norm
    for hook_norm, hook_per_tensor, (norm, per_tensor) in zip(module.hook_norms, module.hook_per_tensor, per_step):
        assert hook_norm == pytest.approx(scale * norm, rel=1e-5)
        torch.testing.assert_close(hook_per_tensor, scale * per_tensor, rtol=1e-5, atol=0)


@pytest.mark.parametrize("precision", ["32", "fp16"])
def test_checkpoint_resume_is_exact(tmp_path, precision):
    """Two epochs of three steps, with a skipped step in the first: resuming from the end of epoch 0 gives the
    uninterrupted run's parameters, counters, loss scale and logs exactly."""

    def make():
        return LlamaModule(fused_adamw, poison_step=2)

    kw = dict(precision=precision, max_steps=-1, max_epochs=2, limit_train_batches=3, enable_checkpointing=True)
    full = make()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    full_trainer, full_metrics = fit(full, tmp_path / "full", callbacks=[FusedStableCallback(), ckpt], **kw)
    first_epoch = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert first_epoch.exists()

    resumed = make()
    trainer, metrics = fit(
        resumed, tmp_path / "resumed", callbacks=[FusedStableCallback()], ckpt_path=str(first_epoch), **kw
    )
    assert trainer.global_step == full_trainer.global_step == STEPS
    assert_same_params(resumed, full, rtol=0, atol=0)
    full_opt, opt = fused_of(full_trainer), fused_of(trainer)
    assert int(opt.skipped_steps) == int(full_opt.skipped_steps) == 1  # the skip in epoch 0 came from the file
    assert int(opt.applied_steps) == int(full_opt.applied_steps) == STEPS - 1
    for p, q in zip(resumed.parameters(), full.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], full_opt.state[q][key])
    if precision == "fp16":
        assert trainer.precision_plugin.scaler.get_scale() == full_trainer.precision_plugin.scaler.get_scale()
    for step in (3, 4, 5):
        for key in ("grad_norm", "learning_rate", "skipped_steps"):
            assert metrics[step][key] == full_metrics[step][key], (step, key)


def two_optimizers(make):
    """Body (embeddings + decoder layers) and head in two optimizers, as manual optimization allows."""

    def build(model):
        head = list(model.lm_head.parameters())
        body = [p for n, p in model.named_parameters() if not n.startswith("lm_head.")]
        return [make(body), make(head)]

    return build


def test_manual_optimization_two_optimizers_match_torch(tmp_path):
    ref = LlamaModule(
        two_optimizers(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY)),
        manual=True,
        manual_clip=CLIP,
    )
    fit(ref, tmp_path / "ref", max_steps=2 * STEPS)
    fused = two_optimizers(lambda ps: FusedAdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=CLIP))
    module = LlamaModule(fused, manual=True)
    trainer, metrics = fit(module, tmp_path / "fused", max_steps=2 * STEPS, callbacks=[FusedStableCallback()])
    # manual optimization: global_step counts every optimizer's step (so max_steps does too)
    assert trainer.global_step == 2 * STEPS
    assert module.losses == pytest.approx(ref.losses, rel=1e-5, abs=1e-6)
    # each optimizer clips its own params (as Lightning's clip_gradients(opt) does): two logged norms per step;
    # the head (lm_head.weight) is the model's last parameter
    body_norms = [float(t[:-1].norm()) for t in ref.pre_clip_per_tensor]
    head_norms = [float(t[-1]) for t in ref.pre_clip_per_tensor]
    assert len(body_norms) == STEPS and max(body_norms) > CLIP
    assert logged(metrics, "grad_norm") == pytest.approx(body_norms, rel=1e-5)
    assert logged(metrics, "grad_norm-1") == pytest.approx(head_norms, rel=1e-5)
    assert_same_params(module, ref, 1e-5, 1e-6)


def test_manual_optimization_under_fp16_equals_automatic(tmp_path):
    auto = LlamaModule(fused_adamw)
    fit(auto, tmp_path / "auto", precision="fp16")
    manual = LlamaModule(fused_adamw, manual=True)
    trainer, metrics = fit(manual, tmp_path / "manual", precision="fp16", callbacks=[FusedStableCallback()])
    assert_same_params(manual, auto, rtol=0, atol=0)
    assert logged(metrics, "grad_norm") == pytest.approx([n / INIT_SCALE for n in auto.hook_norms], rel=1e-5)


def test_lightning_clipping_together_with_max_grad_norm_is_refused(tmp_path):
    for precision in ("32", "bf16-mixed"):
        module = LlamaModule(fused_adamw)
        before = [p.detach().clone() for p in module.parameters()]
        with pytest.raises(MisconfigurationException, match="would clip twice.*Remove gradient_clip_val"):
            fit(
                module,
                tmp_path / precision,
                precision=precision,
                gradient_clip_val=CLIP,
                callbacks=[FusedStableCallback()],
            )
        assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))


def test_lightning_clipping_without_max_grad_norm(tmp_path):
    """Under mixed precision refused with a message that says what to do; at precision 32 it trains like torch
    AdamW + gradient_clip_val, warns why, and leaves the (post-clip) grad_norm out of the logs."""
    no_clip = dict(max_grad_norm=None, lr_schedule=None)
    with pytest.raises(MisconfigurationException, match="cannot clip for FusedAdamW under precision='bf16-mixed'"):
        fit(
            LlamaModule(lambda m: fused_adamw(m, **no_clip)),
            tmp_path / "bf16",
            precision="bf16-mixed",
            gradient_clip_val=CLIP,
            callbacks=[FusedStableCallback()],
        )

    ref = LlamaModule(lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
    fit(ref, tmp_path / "ref", gradient_clip_val=CLIP)
    module = LlamaModule(lambda m: fused_adamw(m, **no_clip))
    with pytest.warns(UserWarning, match="FusedAdamW only sees clipped gradients"):
        _, metrics = fit(module, tmp_path / "fp32", gradient_clip_val=CLIP, callbacks=[FusedStableCallback()])
    assert logged(metrics, "grad_norm") == []
    assert logged(metrics, "skipped_steps") == [0] * STEPS
    assert_same_params(module, ref, 1e-5, 1e-6)


def test_overridden_configure_gradient_clipping_is_warned(tmp_path):
    class OwnClipping(LlamaModule):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            pass  # a user hook that could clip: FusedAdamW must be the only one that does

    with pytest.warns(UserWarning, match="overrides configure_gradient_clipping"):
        fit(OwnClipping(fused_adamw), tmp_path, max_steps=1, callbacks=[FusedStableCallback()])


def test_host_scheduler_from_configure_optimizers(tmp_path):
    """A torch LR scheduler returned by configure_optimizers drives FusedAdamW's lr as it drives torch AdamW's
    (the callback logs it); like any host scheduler, Lightning also advances it on a step FusedAdamW skips."""

    def with_scheduler(make):
        def build(model):
            opt = make(model.parameters())
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": LambdaLR(opt, schedule().factor), "interval": "step"},
            }

        return build

    ref = LlamaModule(with_scheduler(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY)))
    fit(ref, tmp_path / "ref", gradient_clip_val=CLIP)
    fused = with_scheduler(lambda ps: FusedAdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=CLIP))
    module = LlamaModule(fused)
    _, metrics = fit(module, tmp_path / "fused", callbacks=[FusedStableCallback()])
    assert logged(metrics, "learning_rate") == pytest.approx(ref.hook_lrs, rel=1e-6, abs=1e-12)
    assert_same_params(module, ref, 1e-5, 1e-6)

    skipping = LlamaModule(fused, poison_step=3)
    _, metrics = fit(skipping, tmp_path / "skip", callbacks=[FusedStableCallback()])
    lrs = logged(metrics, "learning_rate")
    assert lrs[3] == pytest.approx(LR * schedule().factor(3), rel=1e-6)  # advanced past the skipped step


def test_without_the_callback_lightning_refuses_clipping_under_mixed_precision(tmp_path):
    """What Lightning itself does (so the callback's earlier refusal only improves the message)."""
    module = LlamaModule(fused_adamw)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(module, tmp_path, precision="fp16", gradient_clip_val=CLIP)


def test_callback_needs_a_fused_optimizer(tmp_path):
    module = LlamaModule(lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    with pytest.raises(MisconfigurationException, match="return a fused_stable.FusedAdamW.*AdamW"):
        fit(module, tmp_path, callbacks=[FusedStableCallback()])


def test_reads_the_device_only_at_logging_steps(tmp_path):
    host_reads_at = []

    class Checked(FusedStableCallback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            logging_step = trainer._logger_connector.should_update_logs
            with contextlib.nullcontext() if logging_step else no_host_reads():
                super().on_train_batch_end(trainer, pl_module, *args)
            if logging_step:
                host_reads_at.append(trainer.global_step)

    module = LlamaModule(fused_adamw)
    _, metrics = fit(module, tmp_path, log_every=2, callbacks=[Checked()])
    assert host_reads_at == [2, 4, 6]
    assert sorted(s for s in metrics if "grad_norm" in metrics[s]) == [1, 3, 5]
    assert logged(metrics, "grad_norm") == pytest.approx(module.hook_norms[1::2], rel=1e-5)


def test_gradient_accumulation_logs_once_per_optimizer_step(tmp_path):
    plain = LlamaModule(fused_adamw)
    fit(plain, tmp_path / "plain", accumulate_grad_batches=2, max_steps=3)
    module = LlamaModule(fused_adamw)
    trainer, metrics = fit(
        module, tmp_path / "cb", accumulate_grad_batches=2, max_steps=3, callbacks=[FusedStableCallback()]
    )
    assert trainer.global_step == 3 and len(module.hook_norms) == 3
    # Lightning logs under the count of optimizer steps taken (its `_batches_that_stepped`)
    assert sorted(s for s in metrics if "grad_norm" in metrics[s]) == [0, 1, 2]
    assert logged(metrics, "grad_norm") == pytest.approx(module.hook_norms, rel=1e-5)
    assert_same_params(module, plain, rtol=0, atol=0)  # the callback changes nothing


def test_learning_rate_monitor_shows_the_scheduled_lr(tmp_path):
    """Lightning's LearningRateMonitor reads param_groups[0]["lr"] before each step: it should show the lr that
    step uses, as it does for torch AdamW + a LambdaLR scheduler."""
    module = LlamaModule(fused_adamw)
    _, metrics = fit(module, tmp_path, callbacks=[LearningRateMonitor(logging_interval="step"), FusedStableCallback()])
    expected = [LR * schedule().factor(n) for n in range(STEPS)]
    assert logged(metrics, "learning_rate") == pytest.approx(expected, rel=1e-6, abs=1e-12)  # the callback's
    assert logged(metrics, "lr-FusedAdamW") == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_the_callback_sets_the_state_precision_and_checkpoints_keep_it(tmp_path):
    """FusedStableCallback(state_precision="bf16"): every group of the FusedAdamW stores bf16 moments from the
    first step, and a checkpoint holds them as such (the compact form)."""
    module = LlamaModule(fused_adamw)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    kw = dict(max_steps=-1, max_epochs=1, limit_train_batches=3, enable_checkpointing=True)
    trainer, _ = fit(module, tmp_path, callbacks=[FusedStableCallback(state_precision="bf16"), ckpt], **kw)
    opt = fused_of(trainer)
    assert all(group["state_precision"] == "bf16" for group in opt.param_groups)
    assert {opt.state[p]["exp_avg_sq"].dtype for p in module.parameters()} == {torch.bfloat16}
    saved = torch.load(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", weights_only=False)["optimizer_states"][0]
    assert {entry["exp_avg"].dtype for entry in saved["state"].values()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="state_precision must be one of"):
        FusedStableCallback(state_precision="int4")


def test_fused_lion_with_the_callback_follows_lion_pytorch_and_logs(tmp_path):
    """FusedLion is a fused optimizer to the callback as FusedAdamW is: a real fit logs its pre-clip grad norm and
    the scheduled lr, keeps Lion's one state, and follows lion-pytorch's Lion behind Lightning's own clip."""
    lion_pytorch = pytest.importorskip("lion_pytorch")
    lion_lr, lion_wd = 3e-4, 0.3

    def fused_lion(model):
        return FusedLion(
            model.parameters(), lr=lion_lr, weight_decay=lion_wd, max_grad_norm=CLIP, lr_schedule=schedule()
        )

    def reference_lion(model):
        opt = lion_pytorch.Lion(model.parameters(), lr=lion_lr, weight_decay=lion_wd)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": LambdaLR(opt, schedule().factor), "interval": "step"}}

    torch.manual_seed(0)
    module = LlamaModule(fused_lion)
    trainer, metrics = fit(module, tmp_path / "fused", callbacks=[FusedStableCallback()])
    torch.manual_seed(0)
    reference = LlamaModule(reference_lion)
    fit(reference, tmp_path / "reference", gradient_clip_val=CLIP)
    (opt,) = [o for o in trainer.optimizers if isinstance(o, FusedLion)]
    assert all("exp_avg" in opt.state[p] and "exp_avg_sq" not in opt.state[p] for p in module.parameters())
    assert logged(metrics, "grad_norm") == pytest.approx(module.hook_norms, rel=1e-5)
    expected = [lion_lr * schedule().factor(n) for n in range(STEPS)]
    assert logged(metrics, "learning_rate") == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert logged(metrics, "skipped_steps") == [0] * STEPS
    assert_same_params(module, reference, *FP32_TOLERANCE)
    # the refusals name the class the fit uses
    with pytest.raises(MisconfigurationException, match=r"FusedLion\(max_grad_norm=...\) would clip twice"):
        fit(LlamaModule(fused_lion), tmp_path / "twice", gradient_clip_val=CLIP, callbacks=[FusedStableCallback()])


def test_fused_sgd_with_the_callback_follows_torch_sgd_and_logs(tmp_path):
    """FusedSGD (momentum, Nesterov) is a fused optimizer to the callback as FusedAdamW is: a real fit logs its
    pre-clip grad norm and the scheduled lr, keeps SGD's one buffer, and follows torch.optim.SGD behind Lightning's
    own clip."""
    sgd = dict(lr=3e-2, momentum=0.9, nesterov=True, weight_decay=0.01)

    def fused_sgd(model):
        return FusedSGD(model.parameters(), **sgd, max_grad_norm=CLIP, lr_schedule=schedule())

    def reference_sgd(model):
        opt = torch.optim.SGD(model.parameters(), **sgd)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": LambdaLR(opt, schedule().factor), "interval": "step"}}

    torch.manual_seed(0)
    module = LlamaModule(fused_sgd)
    trainer, metrics = fit(module, tmp_path / "fused", callbacks=[FusedStableCallback()])
    torch.manual_seed(0)
    reference = LlamaModule(reference_sgd)
    fit(reference, tmp_path / "reference", gradient_clip_val=CLIP)
    (opt,) = [o for o in trainer.optimizers if isinstance(o, FusedSGD)]
    assert all(set(opt.state[p]) == {"step", "momentum_buffer"} for p in module.parameters())
    assert logged(metrics, "grad_norm") == pytest.approx(module.hook_norms, rel=1e-5)
    expected = [sgd["lr"] * schedule().factor(n) for n in range(STEPS)]
    assert logged(metrics, "learning_rate") == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert_same_params(module, reference, *FP32_TOLERANCE)


def test_fused_adafactor_with_the_callback_follows_torch_adafactor_and_logs(tmp_path):
    """FusedAdafactor (a matrix rule) is a fused optimizer to the callback as FusedAdamW is: a real fit logs its
    pre-clip grad norm and the scheduled lr, keeps torch's factored states, and follows torch.optim.Adafactor behind
    Lightning's own clip."""
    adafactor = dict(lr=3e-2, weight_decay=0.01)

    def fused_adafactor(model):
        return FusedAdafactor(model.parameters(), **adafactor, max_grad_norm=CLIP, lr_schedule=schedule())

    def reference_adafactor(model):
        opt = torch.optim.Adafactor(model.parameters(), **adafactor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": LambdaLR(opt, schedule().factor), "interval": "step"}}

    torch.manual_seed(0)
    module = LlamaModule(fused_adafactor)
    trainer, metrics = fit(module, tmp_path / "fused", callbacks=[FusedStableCallback()])
    torch.manual_seed(0)
    reference = LlamaModule(reference_adafactor)
    fit(reference, tmp_path / "reference", gradient_clip_val=CLIP)
    (opt,) = [o for o in trainer.optimizers if isinstance(o, FusedAdafactor)]
    for p in module.parameters():
        expected = {"step", "row_var", "col_var"} if p.ndim >= 2 else {"step", "variance"}
        assert set(opt.state[p]) == expected
    assert logged(metrics, "grad_norm") == pytest.approx(module.hook_norms, rel=1e-5)
    expected = [adafactor["lr"] * schedule().factor(n) for n in range(STEPS)]
    assert logged(metrics, "learning_rate") == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert_same_params(module, reference, *FP32_TOLERANCE)


@pytest.mark.parametrize("precision", ["fp32", "8bit"])
def test_fused_muon_with_the_callback_trains_both_kinds_of_group_and_logs(tmp_path, precision):
    """FusedMuon (Muon on muon_param_groups' hidden matrices, AdamW on the rest) is a fused optimizer to the
    callback as FusedAdamW is: a real fit logs its pre-clip grad norm (the hook's, over both kinds of group) and the
    scheduled lr, keeps Muon's momentum_buffer on the matrices and AdamW's moments on the rest, and moves both."""
    muon_lr = 2e-2

    def fused_muon(model):
        groups = muon_param_groups(model, lr=muon_lr, weight_decay=0.01)
        return FusedMuon(groups, max_grad_norm=CLIP, lr_schedule=schedule(), state_precision=precision)

    torch.manual_seed(0)
    module = LlamaModule(fused_muon)
    before = [p.detach().clone() for p in module.parameters()]
    trainer, metrics = fit(module, tmp_path / "fused", callbacks=[FusedStableCallback()])
    (opt,) = [o for o in trainer.optimizers if isinstance(o, FusedMuon)]
    muon = {id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    assert muon and len(muon) < len(before)
    for p in module.parameters():
        assert ("momentum_buffer" if id(p) in muon else "exp_avg") in opt.state[p]
    assert all(not torch.equal(p, b) for p, b in zip(module.parameters(), before))
    assert logged(metrics, "grad_norm") == pytest.approx(module.hook_norms, rel=1e-5)
    expected = [muon_lr * schedule().factor(n) for n in range(STEPS)]
    assert logged(metrics, "learning_rate") == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert logged(metrics, "skipped_steps") == [0] * STEPS
