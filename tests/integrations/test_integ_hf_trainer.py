"""The real transformers Trainer on a tiny Llama (CPU): FusedAdamW through fused_trainer_optimizers +
FusedStableCallback follows the same trajectory as the Trainer's own torch AdamW with max_grad_norm=1.0,
clips once, logs grad_norm / skipped_steps, and a skipped step does not advance the lr schedule."""

from __future__ import annotations

import pytest
import torch
from integ_models import TokenDataset, tiny_llama
from transformers import Trainer, TrainerCallback, TrainingArguments

from fused_stable import FusedAdafactor, FusedAdamW, FusedLion, FusedMuon, FusedSGD
from fused_stable.integrations.hf import (
    FusedStableCallback,
    FusedStableTrainerMixin,
    fused_trainer_optimizers,
    schedule_from_training_args,
)

STEPS = 6
LR = 3e-3


def make_args(out, **overrides) -> TrainingArguments:
    kw = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=LR,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        optim="adamw_torch",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kw.update(overrides)
    return TrainingArguments(**kw)


def train_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def run_baseline(out):
    model = tiny_llama()
    trainer = Trainer(model=model, args=make_args(out), train_dataset=TokenDataset())
    trainer.train()
    return model, train_logs(trainer)


class ParamSnapshots(TrainerCallback):
    """Copies of one weight after every step, and an optional non-finite grad injected before a step."""

    def __init__(self, poison_step: int | None = None):
        self.poison_step = poison_step
        self.snapshots = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.poison_step is not None and state.global_step + 1 == self.poison_step:
            model.model.layers[0].mlp.up_proj.weight.grad[0, 0] = float("inf")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.snapshots.append(model.lm_head.weight.detach().clone())


def count_norm_passes(trainer) -> list:
    """Spy on the Trainer's accelerator.clip_grad_norm_ (the real one runs): one entry per norm pass over all
    gradients that the Trainer makes itself, with its max_norm."""
    calls = []
    real = trainer.accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        calls.append(max_norm)
        return real(parameters, max_norm, *args, **kwargs)

    trainer.accelerator.clip_grad_norm_ = clip_grad_norm_
    return calls


def run_fused(out, trainer_cls=Trainer, poison_step=None, steps=STEPS):
    model = tiny_llama()
    args = make_args(out, max_steps=steps)
    snaps = ParamSnapshots(poison_step)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=TokenDataset(),
        optimizers=fused_trainer_optimizers(model, args),
        callbacks=[FusedStableCallback(), snaps],
    )
    trainer.norm_passes = count_norm_passes(trainer)
    trainer.train()
    return model, train_logs(trainer), trainer, snaps


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return run_baseline(tmp_path_factory.mktemp("base"))


@pytest.mark.parametrize(
    "trainer_cls",
    [Trainer, type("MixedTrainer", (FusedStableTrainerMixin, Trainer), {})],
    ids=["Trainer", "Trainer+FusedStableTrainerMixin"],
)
def test_same_trajectory_as_trainer_adamw_with_clipping(baseline, tmp_path, trainer_cls):
    base_model, base_logs = baseline
    model, logs, trainer, _ = run_fused(tmp_path, trainer_cls)
    assert len(logs) == len(base_logs) == STEPS
    # the clip must actually bite in this run, or the comparison would not test it
    assert max(h["grad_norm"] for h in base_logs) > 1.0
    for mine, ref in zip(logs, base_logs):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert mine["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-5, abs=1e-9)
        assert mine["skipped_steps"] == 0 and mine["spike_skips"] == 0
    for (name, p), q in zip(model.named_parameters(), base_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # clipping moved into the optimizer: the Trainer itself no longer clips
    assert trainer.args.max_grad_norm == 0.0
    assert isinstance(trainer.optimizer.optimizer, FusedAdamW)
    if issubclass(trainer_cls, FusedStableTrainerMixin):
        # the mixin also removes the norm pass transformers >= 5 makes every step only to log a grad norm
        assert trainer.norm_passes == []
    else:
        # without it that pass remains (max_norm inf: a norm and a multiply-by-one pass over every grad)
        assert trainer.norm_passes == [float("inf")] * STEPS


def test_skipped_step_keeps_params_and_does_not_advance_schedule(tmp_path):
    poison = 3
    model, logs, trainer, snaps = run_fused(tmp_path, poison_step=poison, steps=STEPS)
    opt = trainer.optimizer.optimizer
    assert [h["skipped_steps"] for h in logs] == [0, 0, 1, 1, 1, 1]
    assert torch.isinf(torch.tensor(logs[poison - 1]["grad_norm"]))
    torch.testing.assert_close(
        snaps.snapshots[poison - 1], snaps.snapshots[poison - 2], rtol=0, atol=0
    )  # nothing applied
    assert not torch.equal(snaps.snapshots[poison], snaps.snapshots[poison - 1])  # the next step applies again
    assert int(opt.applied_steps) == STEPS - 1
    # the lr of the step after the skip is the one the skipped step would have used
    sched = schedule_from_training_args(trainer.args, STEPS)
    applied_lrs = [h["learning_rate"] for i, h in enumerate(logs) if i != poison - 1]
    assert applied_lrs == pytest.approx([LR * sched.factor(n) for n in range(STEPS - 1)], rel=1e-5, abs=1e-9)
    # param_groups show the lr the next step would use (what monitors read); the Trainer's scheduler, which it
    # reads after every step, hands it plain numbers (a tensor would be .item()-ed: a device read per step)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(LR * sched.factor(STEPS - 1), rel=1e-6)
    assert opt.param_groups[0]["initial_lr"] == LR
    last = trainer.lr_scheduler.get_last_lr()
    assert all(type(lr) is float for lr in last) and last[0] == LR


def test_schedule_mapping_matches_transformers(tmp_path):
    from transformers.optimization import get_scheduler

    for kind, extra in [
        ("linear", {}),
        ("cosine", {}),
        ("constant_with_warmup", {}),
        ("cosine_with_min_lr", {"lr_scheduler_kwargs": {"min_lr_rate": 0.1}}),
    ]:
        args = make_args(tmp_path, lr_scheduler_type=kind, max_steps=20, warmup_steps=5, **extra)
        sched = schedule_from_training_args(args)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        ref = get_scheduler(
            kind, opt, num_warmup_steps=5, num_training_steps=20, scheduler_specific_kwargs=args.lr_scheduler_kwargs
        )
        for n in range(20):
            assert sched.factor(n) == pytest.approx(ref.get_last_lr()[0], abs=1e-7), (kind, n)
            opt.step()
            ref.step()


@pytest.mark.parametrize("trainer_max_grad_norm, fused_max_grad_norm", [(1.0, 1.0), (0.0, None)])
def test_fused_trainer_optimizers_moves_clipping_into_the_step(tmp_path, trainer_max_grad_norm, fused_max_grad_norm):
    """Without the callback too: the Trainer's max_grad_norm goes to FusedAdamW and is set to 0 in args, so a
    plain Trainer does not clip a second time."""
    args = make_args(tmp_path, max_grad_norm=trainer_max_grad_norm)
    opt, _ = fused_trainer_optimizers(tiny_llama(), args)
    assert opt.policy.max_grad_norm == fused_max_grad_norm
    assert args.max_grad_norm == 0.0


def test_bad_arguments_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no device-side equivalent"):
        schedule_from_training_args(make_args(tmp_path, lr_scheduler_type="polynomial"))
    with pytest.raises(ValueError, match="number of training steps"):
        schedule_from_training_args(make_args(tmp_path, max_steps=-1))
    model = tiny_llama()
    args = make_args(tmp_path)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[FusedStableCallback()])
    with pytest.raises(TypeError, match="fused_trainer_optimizers"):
        trainer.train()


def test_mixin_builds_the_optimizer_inside_train(baseline, tmp_path):
    """No optimizers= at all: FusedStableTrainerMixin builds FusedAdamW from the args in create_optimizer and
    adds the callback; same trajectory as the Trainer's torch AdamW with max_grad_norm=1.0."""
    base_model, base_logs = baseline
    model = tiny_llama()
    trainer_cls = type("MixedTrainer", (FusedStableTrainerMixin, Trainer), {})
    trainer = trainer_cls(model=model, args=make_args(tmp_path), train_dataset=TokenDataset())
    assert trainer.optimizer is None
    norm_passes = count_norm_passes(trainer)
    trainer.train()
    assert norm_passes == []  # neither a clip nor transformers' extra grad-norm pass: the fused step does both
    assert isinstance(trainer.optimizer.optimizer, FusedAdamW)
    assert trainer.args.max_grad_norm == 0.0
    logs = train_logs(trainer)
    assert len(logs) == STEPS
    for mine, ref in zip(logs, base_logs):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert mine["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-5, abs=1e-9)
    for (name, p), q in zip(model.named_parameters(), base_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("rule", [None, "muon"], ids=["adamw", "muon"])
def test_8bit_state_checkpoints_compact_and_resumes_exactly(tmp_path, rule):
    """fused_trainer_optimizers(state_precision="8bit"): the Trainer's optimizer.pt holds the compact state (int8
    / uint8 codes and fp32 scales, loadable with weights_only=True), and resuming from the checkpoint after step 3
    ends where the uninterrupted run ends, bit for bit. With rule="muon" (FusedMuon over muon_param_groups, the
    use_muon split) the hidden matrices keep Muon's momentum_buffer and the rest AdamW's moments."""

    def train(out, resume=None):
        model = tiny_llama(vocab_size=128)  # embedding and head of 4096 elements: quantised (the rest is smaller)
        args = make_args(out, save_strategy="steps", save_steps=3, save_only_model=False)
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=TokenDataset(),
            optimizers=fused_trainer_optimizers(model, args, rule=rule, state_precision="8bit"),
            callbacks=[FusedStableCallback()],
        )
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer

    full, trainer = train(tmp_path / "full")
    assert all(group["state_precision"] == "8bit" for group in trainer.optimizer.param_groups)
    saved = torch.load(tmp_path / "full" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    if rule == "muon":
        assert isinstance(trainer.optimizer.optimizer, FusedMuon)  # inside accelerate's wrapper
        muon = [set(e) for e in saved["state"].values() if "momentum_buffer" in e]
        assert muon and all(keys <= {"step", "momentum_buffer", "momentum_buffer_scale"} for keys in muon)
        saved["state"] = {k: e for k, e in saved["state"].items() if "exp_avg" in e}
    dtypes = {entry["exp_avg"].dtype for entry in saved["state"].values()}
    assert dtypes == {torch.int8, torch.float32}  # quantised matrices, small tensors (norms) in fp32
    assert all("exp_avg_scale" in e for e in saved["state"].values() if e["exp_avg"].dtype == torch.int8)
    resumed, _ = train(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-3"))
    for p, q in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("optim", "precision"),
    [
        ("adamw_torch", "fp32"),
        ("adamw_torch_fused", "fp32"),
        ("adamw_bnb_8bit", "8bit"),
        ("paged_adamw_8bit", "8bit"),
        ("lion_32bit", "fp32"),
        ("paged_lion_8bit", "8bit"),
    ],
)
def test_args_optim_names_the_state_precision(tmp_path, optim, precision):
    """`args.optim` (issue 35 item 6): an AdamW name is FusedAdamW, a Lion name FusedLion, with the state it names;
    an explicit state_precision wins over it."""
    opt, _ = fused_trainer_optimizers(tiny_llama(), make_args(tmp_path, optim=optim))
    assert type(opt) is (FusedLion if "lion" in optim else FusedAdamW)
    assert {group["state_precision"] for group in opt.param_groups} == {precision}
    opt, _ = fused_trainer_optimizers(tiny_llama(), make_args(tmp_path, optim=optim), state_precision="bf16")
    assert {group["state_precision"] for group in opt.param_groups} == {"bf16"}


def test_an_optim_without_a_fused_rule_is_refused(tmp_path):
    """FusedAdamW in place of the RMSprop `args.optim` asks for would be a silent substitution."""
    for optim in ("rmsprop",):
        with pytest.raises(ValueError, match=rf"optim '{optim}' has no fused rule.*supported optim values are: adamw"):
            fused_trainer_optimizers(tiny_llama(), make_args(tmp_path, optim=optim))
    with pytest.raises(
        ValueError, match=r"rule='rmsprop': fused_trainer_optimizers builds 'adamw' or 'lion' or 'muon'"
    ):
        fused_trainer_optimizers(tiny_llama(), make_args(tmp_path), rule="rmsprop")


def test_args_optim_lion_8bit_is_fused_lion_with_8bit_state_in_a_real_trainer(tmp_path):
    """`TrainingArguments(optim="lion_8bit")`: FusedLion (the Trainer's adam betas, as transformers gives them to
    bitsandbytes' Lion) with 8-bit state, trained by the real Trainer with the callback: Lion's one state (8-bit
    codes on the matrices), the pre-clip grad norm logged, and the Trainer no longer clipping."""
    model = tiny_llama(vocab_size=128)  # embedding and head of 4096 elements: quantised (the rest is smaller)
    args = make_args(tmp_path, optim="lion_8bit", learning_rate=1e-3, adam_beta2=0.99)
    optimizer, scheduler = fused_trainer_optimizers(model, args)
    assert type(optimizer) is FusedLion
    assert {group["state_precision"] for group in optimizer.param_groups} == {"8bit"}
    assert {(group["initial_lr"], group["betas"]) for group in optimizer.param_groups} == {(1e-3, (0.9, 0.99))}
    assert {group["weight_decay"] for group in optimizer.param_groups} == {0.1, 0.0}  # the Trainer's decay split
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(),
        optimizers=(optimizer, scheduler),
        callbacks=[FusedStableCallback()],
    )
    norm_passes = count_norm_passes(trainer)
    before = model.lm_head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(model.lm_head.weight, before)
    states = list(optimizer.state_dict()["state"].values())
    assert len(states) == len(list(model.parameters()))
    assert all("exp_avg" in st and not any("exp_avg_sq" in key for key in st) for st in states)
    assert {st["exp_avg"].dtype for st in states} == {torch.int8, torch.float32}
    logs = train_logs(trainer)
    assert len(logs) == STEPS and all(log["grad_norm"] > 0 and log["skipped_steps"] == 0 for log in logs)
    assert set(norm_passes) <= {float("inf")} and args.max_grad_norm == 0.0  # the Trainer measures, never clips
    # rule= chooses directly, whatever args.optim names; an explicit state_precision wins over the name's
    opt, _ = fused_trainer_optimizers(tiny_llama(), make_args(tmp_path), rule="lion", state_precision="bf16")
    assert type(opt) is FusedLion and {group["state_precision"] for group in opt.param_groups} == {"bf16"}
    opt, _ = fused_trainer_optimizers(tiny_llama(), make_args(tmp_path, optim="lion_8bit"), rule="adamw")
    assert type(opt) is FusedAdamW and {group["state_precision"] for group in opt.param_groups} == {"8bit"}


def test_args_optim_sgd_is_fused_sgd_on_the_stock_trainers_trajectory(tmp_path):
    """`TrainingArguments(optim="sgd")`: the stock Trainer runs torch.optim.SGD (momentum 0, its clip); the fused
    Trainer FusedSGD with the clip inside the step: the same losses, grad norms and params (fp32 ulps apart: the
    clip coefficient's sum runs in another order)."""
    torch.manual_seed(0)
    base_model = tiny_llama()
    base_args = make_args(tmp_path / "base", optim="sgd", learning_rate=0.05)
    stock = Trainer(model=base_model, args=base_args, train_dataset=TokenDataset())
    stock.train()
    assert type(stock.optimizer.optimizer) is torch.optim.SGD
    torch.manual_seed(0)
    model = tiny_llama()
    args = make_args(tmp_path / "fused", optim="sgd", learning_rate=0.05)
    optimizer, scheduler = fused_trainer_optimizers(model, args)
    assert type(optimizer) is FusedSGD and {g["state_precision"] for g in optimizer.param_groups} == {"fp32"}
    fused = Trainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(),
        optimizers=(optimizer, scheduler),
        callbacks=[FusedStableCallback()],
    )
    fused.train()
    base_logs, logs = train_logs(stock), train_logs(fused)
    assert len(logs) == len(base_logs) == STEPS and max(h["grad_norm"] for h in base_logs) > 1.0  # the clip bites
    for mine, ref in zip(logs, base_logs):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), base_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert all(set(optimizer.state[p]) == {"step"} for p in model.parameters())  # momentum 0: no buffer


def test_args_optim_adafactor_is_refused_saying_why(tmp_path):
    """The Trainer's `adafactor` is transformers' Adafactor (relative_step, scale_parameter, warmup_init), not
    torch.optim.Adafactor: FusedAdafactor in its place would be a silent substitution of the algorithm."""
    with pytest.raises(ValueError, match=r"optim 'adafactor' has no fused rule here: the HF Trainer's adafactor is"):
        fused_trainer_optimizers(tiny_llama(), make_args(tmp_path, optim="adafactor"))


def test_rule_adafactor_follows_torch_adafactor_in_a_real_trainer(tmp_path):
    """fused_trainer_optimizers(rule="adafactor") is torch.optim.Adafactor with the clip inside the step: against the
    stock Trainer driving torch.optim.Adafactor (its clip, its LambdaLR warm-up + cosine), the same losses, grad norms
    and params (fp32 ulps apart: the clip coefficient's sum runs in another order)."""
    torch.manual_seed(0)
    base_model = tiny_llama()
    base_args = make_args(tmp_path / "base", weight_decay=0.0)
    reference = torch.optim.Adafactor(base_model.parameters(), lr=LR)
    stock = Trainer(model=base_model, args=base_args, train_dataset=TokenDataset(), optimizers=(reference, None))
    stock.train()
    torch.manual_seed(0)
    model = tiny_llama()
    initial = [p.detach().clone() for p in model.parameters()]
    args = make_args(tmp_path / "fused", weight_decay=0.0)
    optimizer, scheduler = fused_trainer_optimizers(model, args, rule="adafactor")
    assert type(optimizer) is FusedAdafactor and {g["state_precision"] for g in optimizer.param_groups} == {"fp32"}
    fused = Trainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(),
        optimizers=(optimizer, scheduler),
        callbacks=[FusedStableCallback()],
    )
    fused.train()
    base_logs, logs = train_logs(stock), train_logs(fused)
    assert len(logs) == len(base_logs) == STEPS and max(h["grad_norm"] for h in base_logs) > 1.0  # the clip bites
    for mine, ref in zip(logs, base_logs):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), base_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert set(optimizer.state[p]) == set(reference.state[q])
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), initial))  # every param trained
