"""One stress run: a scenario trained with one recipe on the shared workload (`run_one`).

Recipes, each built with the suite's update rule (`--optim`, `RULES`: adamw, lion, muon, sgd, adafactor):
- `usual`: the rule's reference optimizer (torch.optim.AdamW; lion_pytorch.Lion; torch.optim.Muon on the hidden
  matrices (a pretrained model's LoRA factors) beside torch.optim.AdamW on the rest, as muon_param_groups splits
  them with `muon_lora=True`; torch.optim.SGD with momentum
  0.9; torch.optim.Adafactor) + torch.nn.utils.clip_grad_norm_(1.0)
  + transformers-style warm-up/cosine LambdaLR (+ torch.amp.GradScaler in the fp16 scenario): what most
  fine-tuning scripts do.
- `guarded`: the rule's fused optimizer (FusedAdamW, FusedLion, FusedMuon, FusedSGD, FusedAdafactor;
  clip="zscore", max_grad_norm=1.0, device-side warm-up/cosine, spike skipping) with the stability guard
  (`fused_stable.guard`) in its `rollback` policy, checked every `log_every` steps, each check (on a pretrained
  model) with an evaluation of the held-out and retention losses (`train.evaluation.held_out.HeldOutLosses`, as
  `fused-stable sft` measures them; the one before the first step is the reference); a rollback restores an
  in-memory snapshot (model, optimizer, scaler) taken at the last clean check, halves the lr and keeps the data
  position (the window that spiked is not replayed).

Both recipes see the same model init, the same data order and the same injected fault, and both are measured
on the same held-out sets after the run. The workload (the tokenizer, the task's data, the held-out sets, the
base every run starts from) is built once per suite (`build_workload`).
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fused_stable.stress.scenarios import Scenario, StressConfig, is_real, shift_example

RECIPES = ("usual", "guarded")
FINAL_WINDOW = 10  # steps averaged into the "final loss"
EVAL_MAX_LENGTH = 256  # the held-out sets are not cut to the training max_length: their answers stay whole


# ---------------------------------------------------------------------------------------------- model and data
@dataclass
class Workload:
    tokenizer: object
    items: list
    shifted_items: list
    init_state: dict  # the trainable tensors every run starts from (tiny: the whole pre-trained model)
    model: object = None  # a pretrained model with LoRA adapters, shared by the runs (its base stays frozen)
    task_name: str | None = None  # the identity the evaluation expects
    before: dict | None = None  # the held-out evaluation of the base model
    losses: object = None  # HeldOutLosses: eval_loss and retention_loss (None: not measured)
    start_losses: dict | None = None  # their values on the model every run starts from


def build_workload(cfg: StressConfig) -> Workload:
    return build_real_workload(cfg) if is_real(cfg) else build_tiny_workload(cfg)


def build_tiny_workload(cfg: StressConfig) -> Workload:
    """The trainer's tokenizer, built-in task and embedded tiny Llama (full fine-tuning: every weight trains)."""
    from fused_stable.train.data import instructions
    from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model

    tokenizer = build_byte_tokenizer()
    examples = instructions.builtin_examples(cfg.examples, seed=cfg.seed)
    items = instructions.tokenize_examples(examples, tokenizer, cfg.max_length)
    shifted_items = instructions.tokenize_examples([shift_example(ex) for ex in examples], tokenizer, cfg.max_length)
    model = build_tiny_model(tokenizer)
    _pretrain(model, instructions.BatchOrder(items, cfg.batch_size, cfg.seed + 1, tokenizer.pad_token_id), cfg)
    # no evaluations on the tiny model (as sft's retention_probe=auto): its base is a 200-step scratch model, and
    # full fine-tuning moves its retention loss 1.27x in a clean 20-step run (measured), past the rise factor
    return Workload(tokenizer, items, shifted_items, {k: v.clone() for k, v in model.state_dict().items()})


def build_real_workload(cfg: StressConfig) -> Workload:
    """A pretrained model (`--model`, resolved as `fused-stable sft` does) with the sft defaults' LoRA adapters
    (r 8, all linear layers), the sft default task (`identity`: who the assistant is, mixed with general
    instructions answered by the base model itself) and its held-out evaluation, taken once on the base."""
    from fused_stable.train.config.keys import TrainConfig
    from fused_stable.train.data import instructions, tasks
    from fused_stable.train.evaluation.before_after import evaluate
    from fused_stable.train.model.adapters import apply_tuner
    from fused_stable.train.model.load import load_pretrained
    from fused_stable.train.model.sources import resolve_model

    source = resolve_model(cfg.model)
    model, tokenizer = load_pretrained(source, dtype=torch.float32)
    name, author = tasks.default_identity()
    examples = tasks.identity_examples(name, author, seed=cfg.seed, general=cfg.examples)
    items = instructions.tokenize_examples(examples, tokenizer, cfg.max_length)
    shifted_items = instructions.tokenize_examples([shift_example(ex) for ex in examples], tokenizer, cfg.max_length)
    before = evaluate(model, tokenizer, name=name, author=author)
    torch.manual_seed(cfg.seed)
    model = apply_tuner(model, TrainConfig(model=cfg.model))
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    work = Workload(tokenizer, items, shifted_items, init, model=model, task_name=name, before=before)
    _add_held_out_losses(work, model, tasks.identity_heldout(name, author, cfg.seed))  # LoRA at init: the base
    return work


def _add_held_out_losses(work: Workload, base, heldout: list) -> None:
    """The sets every run is measured on, as `fused-stable sft` measures them: eval_loss on held-out examples
    of the task, retention_loss on `base`'s own greedy answers to the retention probe's prompts; and their
    values on `base`, where every run starts."""
    from fused_stable.train.data import instructions, tasks
    from fused_stable.train.evaluation.held_out import HeldOutLosses, accepts_logits_to_keep, retention_items

    tokenizer = work.tokenizer
    sets = {
        "eval_loss": instructions.tokenize_examples(heldout, tokenizer, EVAL_MAX_LENGTH),
        "retention_loss": retention_items(base, tokenizer, tasks.retention_prompts(), max_length=EVAL_MAX_LENGTH),
    }
    work.losses = HeldOutLosses(
        sets, pad_id=tokenizer.pad_token_id, device="cpu", keep_logits=accepts_logits_to_keep(base)
    )
    work.start_losses = work.losses.measure(base)


def _fresh_model(work: Workload):
    """The model a run starts from: a new tiny Llama with the pre-trained weights, or the shared pretrained
    model with its adapters reset to their initial values."""
    if work.model is not None:
        from fused_stable.train.run.checkpoint import load_trainable_state

        load_trainable_state(work.model, work.init_state)
        return work.model
    from transformers import LlamaForCausalLM

    from fused_stable.train.model.tiny import tiny_llama_config

    model = LlamaForCausalLM(tiny_llama_config(len(work.tokenizer)))
    model.load_state_dict(work.init_state)
    return model


def _pretrain(model, batches, cfg: StressConfig) -> None:
    """A base worth fine-tuning: the random tiny model trained on the task with a plain, sane recipe, so the
    scenarios start from a model whose loss can visibly get worse (and 2x its clean final loss means ruin)."""
    torch.manual_seed(cfg.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(StressConfig(steps=cfg.pretrain_steps, warmup_steps=10)))
    for k in range(cfg.pretrain_steps):
        _loss(model, batches.batch(k)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def _loss(model, b) -> torch.Tensor:
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)),
        b.labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    ) / max(1, b.num_label_tokens)


def _lr_lambda(cfg: StressConfig) -> Callable[[int], float]:
    """transformers' get_cosine_schedule_with_warmup lambda (what schedules.warmup_cosine evaluates on the device)."""

    def f(n: int) -> float:
        if n < cfg.warmup_steps:
            return n / max(1, cfg.warmup_steps)
        progress = (n - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))

    return f


# ---------------------------------------------------------------------------------------------- one run
@dataclass
class RunResult:
    scenario: str
    recipe: str
    losses: list = field(default_factory=list)  # per optimizer step (a rolled-back run restarts its step count)
    final_loss: float = math.nan
    status: str = "ok"  # ok | diverged | stopped
    skipped_steps: int = 0  # updates not applied (non-finite grads, spikes, scaler overflow)
    rolled_back: int = 0  # rollbacks
    rolled_back_steps: int = 0  # optimizer steps undone by them
    alerts: int = 0
    wall_s: float = 0.0  # training (the evaluation apart)
    message: str = ""
    general_after: float | None = None  # pretrained model: held-out general accuracy after the run
    task_after: float | None = None  # ...and the target task's (identity) accuracy
    eval_loss_after: float | None = None  # the held-out losses after the run (both recipes)
    retention_loss_after: float | None = None
    evals: list = field(default_factory=list)  # guarded: {"step", "eval_loss", "retention_loss"} at each check
    eval_alerts: int = 0  # guarded: eval_loss_rise / retention_loss_rise alerts among `alerts`
    eval_s: float = 0.0  # the evaluations (during the run, and after it)
    cpu_s: float = 0.0  # this process's CPU time for the run and its evaluation


def fp16_grad_hooks(model) -> list:
    """fp16 gradients, emulated: every trainable parameter's gradient is rounded through float16 as it is
    produced, so a scaled gradient above 65504 becomes inf and one below 6e-8 becomes 0, as in an fp16 backward."""
    return [p.register_hook(lambda g: g.to(torch.float16).to(g.dtype)) for p in model.parameters() if p.requires_grad]


def run_one(work: Workload, cfg: StressConfig, scenario: Scenario, recipe: str) -> RunResult:
    """One scenario trained with one recipe on the shared workload: the recipe's optimizer, the training loop
    (the guarded recipe checks, rolls back or stops at every logging step), then the measurements of the model
    the run ended with."""
    torch.manual_seed(cfg.seed)
    model = _fresh_model(work)
    model.config.use_cache = False
    model.train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hooks = fp16_grad_hooks(model) if scenario.fp16 else []
    result = RunResult(scenario.name, recipe)
    run = _Run(work, cfg, scenario, recipe, model, trainable, result)
    cpu0 = time.process_time()  # CPU time: on a shared machine, a fairer measure of the cost than the wall clock
    t0 = time.perf_counter()
    run.train()
    result.wall_s = time.perf_counter() - t0 - run.eval_s  # training (the evaluations apart, as below)
    for h in hooks:
        h.remove()
    _measure_end(run)
    result.cpu_s = time.process_time() - cpu0
    return result


class _Run:
    """The state of one run while it trains: the recipe's optimizer, scheduler, scaler and guard, the optimizer
    steps (rolled back with the model) and micro-batches consumed (never), the rows logged so far."""

    def __init__(self, work: Workload, cfg: StressConfig, scenario: Scenario, recipe: str, model, trainable, result):
        self.work, self.cfg, self.scenario, self.recipe = work, cfg, scenario, recipe
        self.model, self.trainable, self.result = model, trainable, result
        self.params = [p for _, p in trainable]
        self.batch = scenario.batches(work.items, work.shifted_items, work.tokenizer, cfg)
        self.opts, self.scheds, self.scaler, self.guard = _recipe_optimizer(recipe, model, cfg, scenario)
        self.opt = self.opts[0]  # guarded: the one fused optimizer (usual Muon: Muon's, AdamW's beside it)
        self.snapshot = _snapshot(trainable, self.opt, self.scaler, 0) if self.guard else None
        self.held_out = work.losses if self.guard else None  # the guarded recipe evaluates at its checks
        if self.held_out is not None:
            self.guard.eval_reference(work.start_losses)  # every run starts from the workload's base
            result.evals.append({"step": 0, **work.start_losses})
        self.step, self.k = 0, 0
        self.pending: list[torch.Tensor] = []
        self.rows: list[dict] = []
        self.eval_s = 0.0

    def train(self) -> None:
        cfg, scenario, opt = self.cfg, self.scenario, self.opt
        while self.step < cfg.steps:
            loss = _loss(self.model, self.batch(self.k))
            self._backward_and_step(scenario.train_loss(loss, self.k))
            for each in self.opts:
                each.zero_grad(set_to_none=True)
            self.step += 1
            self.k += 1
            seen = loss.detach() if scenario.nan_at != self.k - 1 else loss.detach() * math.nan
            skipped = opt.last_step_skipped.float() if self.guard else torch.zeros(())
            self.pending.append(torch.stack([seen, skipped]))
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                if self._log_and_check() == "stop":
                    break

    def _backward_and_step(self, train_loss: torch.Tensor) -> None:
        """usual: backward, unscale, clip_grad_norm_, step (GradScaler's own skip counted), the scheduler; guarded:
        backward and the fused step (clip, skip and schedule inside FusedAdamW)."""
        opt, scaler = self.opt, self.scaler
        if self.recipe == "usual":
            scale_before = scaler.get_scale() if scaler else None
            (scaler.scale(train_loss) if scaler else train_loss).backward()
            for each in self.opts if scaler else ():
                scaler.unscale_(each)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)  # one global norm over every optimizer's params
            for each in self.opts:
                scaler.step(each) if scaler else each.step()
            if scaler:
                scaler.update()
                self.result.skipped_steps += scaler.get_scale() < scale_before  # torch backs off exactly on skips
            for sched in self.scheds:
                sched.step()
        else:
            (scaler.scale(train_loss) if scaler else train_loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()

    def _log_and_check(self) -> str | None:
        """A logging step: the rows since the last (one read); guarded, the held-out losses and the guard's
        decision: roll back to the snapshot, stop ("stop"), or take a new snapshot."""
        from fused_stable.guard import EVALUATED

        result, guard, step = self.result, self.guard, self.step
        losses = torch.stack(self.pending).tolist()
        self.pending.clear()
        new_rows = [
            {"step": step - len(losses) + 1 + i, "loss": v, "skipped": bool(skip)} for i, (v, skip) in enumerate(losses)
        ]
        self.rows += new_rows
        if not guard:
            return None
        result.skipped_steps += sum(r["skipped"] for r in new_rows)  # counted before a rollback undoes them
        if self.held_out is not None:
            started = time.perf_counter()
            new_rows[-1].update(self.held_out.measure(self.model))
            self.eval_s += time.perf_counter() - started
            result.evals.append({"step": step, **{key: new_rows[-1][key] for key in self.held_out.names}})
        decision = guard.check(step, self.opt, new_rows)
        result.alerts += len(decision.alerts)
        result.eval_alerts += sum(a.kind in EVALUATED.values() for a in decision.alerts)
        if decision.action == "rollback":
            _restore(self.snapshot, self.trainable, self.opt, self.scaler)
            result.rolled_back_steps += step - self.snapshot["step"]
            self.step = self.snapshot["step"]
            self.rows = [r for r in self.rows if r["step"] <= self.step]
            guard.apply_rollback(self.opt, decision.cut_lr, to_step=self.step, lr_factor=decision.lr_factor)
            return None
        if decision.action == "stop":
            result.status, result.message = "stopped", decision.message
            return "stop"
        if step % self.cfg.snapshot_every == 0 and not decision.alerts:
            self.snapshot = _snapshot(self.trainable, self.opt, self.scaler, step)
        return None


def _recipe_optimizer(recipe: str, model, cfg: StressConfig, scenario: Scenario):
    """([optimizers], [schedulers], scaler, guard): the rule's reference optimizer(s) with LambdaLR warm-up/cosine
    and torch's GradScaler, or its fused optimizer (z-score clipping, its schedule inside the step) bound to a
    rollback guard and our GradScaler. Both over the model's trainable params, at the same lr and weight decay."""
    from fused_stable import GradScaler, schedules
    from fused_stable.guard import Guard, GuardConfig

    lr = cfg.lr * scenario.lr_multiplier
    rule = RULES[cfg.optim]
    if recipe == "usual":
        opts = rule.usual(model, lr)
        scheds = [torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg)) for opt in opts]
        return opts, scheds, torch.amp.GradScaler("cpu") if scenario.fp16 else None, None
    guard = Guard(GuardConfig(policy="rollback", max_rollbacks=cfg.max_rollbacks, eval_rise=cfg.eval_rise))
    opt = rule.fused(
        model,
        lr,
        max_grad_norm=1.0,
        clip="zscore",
        zscore_warmup=cfg.zscore_warmup,
        lr_schedule=schedules.warmup_cosine(cfg.steps, cfg.warmup_steps),
        state_precision=cfg.state_precision,
        **guard.config.optimizer_kwargs(),
    )
    names = {id(p): n for n, p in model.named_parameters()}
    opt.param_names = [names[id(p)] for group in opt.param_groups for p in group["params"]]
    guard.bind(opt)
    return [opt], [], GradScaler("cpu") if scenario.fp16 else None, guard


WEIGHT_DECAY = 0.01  # both recipes, every rule (sft's default)


def _trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _muon_split(model, lr: float) -> list[dict]:
    """muon_param_groups over the trainable params: hidden 2-D matrices to Muon, the rest to AdamW, one lr. On a
    pretrained model (LoRA) the factors are the only hidden matrices that train, so they go to Muon
    (`muon_lora`, ms-swift's split, as `fused-stable sft --optim muon --muon_lora true`); the tiny model's full
    fine-tune has none, so the flag changes nothing there."""
    from fused_stable import muon_param_groups

    return muon_param_groups(model, lr=lr, weight_decay=WEIGHT_DECAY, muon_lora=True)


def _usual_muon(model, lr: float) -> list:
    """torch.optim.Muon on muon_param_groups' Muon group (torch's defaults: momentum 0.95, Nesterov, 5
    Newton-Schulz steps, the "original" lr adjustment, as FusedMuon's), torch AdamW on the rest."""
    groups = _muon_split(model, lr)  # a LoRA model's trainable params are all factors: no AdamW group then
    return [
        (torch.optim.Muon if group["use_muon"] else torch.optim.AdamW)(
            group["params"], lr=lr, weight_decay=WEIGHT_DECAY
        )
        for group in sorted(groups, key=lambda group: not group["use_muon"])
    ]


def _usual_lion(model, lr: float) -> list:
    from lion_pytorch import Lion

    return [Lion(_trainable(model), lr=lr, weight_decay=WEIGHT_DECAY)]


def _fused(name: str):
    def build(model, lr: float, **options):
        import fused_stable

        return getattr(fused_stable, name)(_trainable(model), lr=lr, weight_decay=WEIGHT_DECAY, **options)

    return build


def _fused_muon(model, lr: float, **options):
    from fused_stable import FusedMuon

    return FusedMuon(_muon_split(model, lr), **options)


def _usual_adamw(model, lr: float) -> list:
    return [torch.optim.AdamW(_trainable(model), lr=lr, weight_decay=WEIGHT_DECAY)]


SGD_MOMENTUM = 0.9  # both SGD recipes: the momentum users train SGD with (torch's default 0 is plain gradient descent)


def _usual_sgd(model, lr: float) -> list:
    return [torch.optim.SGD(_trainable(model), lr=lr, momentum=SGD_MOMENTUM, weight_decay=WEIGHT_DECAY)]


def _fused_sgd(model, lr: float, **options):
    from fused_stable import FusedSGD

    return FusedSGD(_trainable(model), lr=lr, momentum=SGD_MOMENTUM, weight_decay=WEIGHT_DECAY, **options)


def _usual_adafactor(model, lr: float) -> list:
    return [torch.optim.Adafactor(_trainable(model), lr=lr, weight_decay=WEIGHT_DECAY)]


@dataclass(frozen=True)
class StressRule:
    """How each recipe is built with one update rule: `usual(model, lr)` -> the reference optimizers,
    `fused(model, lr, **step_options)` -> the fused optimizer; their names for the header and the plot."""

    usual: Callable
    fused: Callable
    usual_name: str
    fused_name: str


RULES = {
    "adamw": StressRule(_usual_adamw, _fused("FusedAdamW"), "torch AdamW", "FusedAdamW"),
    "lion": StressRule(_usual_lion, _fused("FusedLion"), "lion-pytorch Lion", "FusedLion"),
    "muon": StressRule(_usual_muon, _fused_muon, "torch Muon + AdamW", "FusedMuon"),
    "sgd": StressRule(_usual_sgd, _fused_sgd, "torch SGD (momentum 0.9)", "FusedSGD"),
    "adafactor": StressRule(_usual_adafactor, _fused("FusedAdafactor"), "torch Adafactor", "FusedAdafactor"),
}


def _measure_end(run: _Run) -> None:
    """The run's losses and final loss, its rollbacks, and both recipes' measurements of the model it ended with:
    the held-out losses, and on the pretrained model what it still knows and what it learnt."""
    result, work = run.result, run.work
    result.losses = [r["loss"] for r in run.rows]
    tail = result.losses[-FINAL_WINDOW:]
    result.final_loss = sum(tail) / len(tail) if tail else math.nan
    if run.guard:
        result.rolled_back = run.guard.rollbacks
    t0 = time.perf_counter()
    if work.losses is not None:  # both recipes: the held-out losses of the model the run ended with
        after = work.losses.measure(run.model)
        result.eval_loss_after, result.retention_loss_after = after.get("eval_loss"), after.get("retention_loss")
    if work.model is not None:  # what the pretrained model still knows, and what it learnt
        from fused_stable.train.evaluation.before_after import evaluate

        scores = evaluate(run.model, work.tokenizer, name=work.task_name)
        result.general_after, result.task_after = scores["general"]["accuracy"], scores["identity"]["accuracy"]
    result.eval_s = run.eval_s + time.perf_counter() - t0


def _snapshot(trainable: list, opt, scaler, step: int) -> dict:
    """An in-memory checkpoint of the trainable tensors (what the trainer's checkpoints hold), the optimizer and
    the scaler, serialised like one on disk (no live tensors shared with the run)."""
    buffer = io.BytesIO()
    torch.save(
        {
            "model": {n: p.detach() for n, p in trainable},
            "opt": opt.state_dict(),
            "scaler": scaler.state_dict() if scaler else None,
        },
        buffer,
    )
    return {"bytes": buffer.getvalue(), "step": step}


def _restore(snapshot: dict, trainable: list, opt, scaler) -> None:
    saved = torch.load(io.BytesIO(snapshot["bytes"]), weights_only=True)
    with torch.no_grad():
        for name, p in trainable:
            p.copy_(saved["model"][name])
    opt.load_state_dict(saved["opt"])
    if scaler is not None:
        scaler.load_state_dict(saved["scaler"])
