"""`fused-stable stress`: reproducible failure scenarios, each trained twice, on the embedded tiny Llama (the fast
default) or, with `--model smollm2-135m` (any `--model` that `sft` takes), on a pretrained model with LoRA.

Recipes:
- `usual`: torch.optim.AdamW + torch.nn.utils.clip_grad_norm_(1.0) + transformers-style warm-up/cosine
  LambdaLR (+ torch.amp.GradScaler in the fp16 scenario): what most fine-tuning scripts do.
- `guarded`: FusedAdamW(clip="zscore", max_grad_norm=1.0, device-side warm-up/cosine, spike skipping) with the
  stability guard (`fused_stable.guard`) in its `rollback` policy, checked every `log_every` steps; a rollback
  restores an in-memory snapshot (model, optimizer, scaler) taken at the last clean check, halves the lr and
  keeps the data position (the window that spiked is not replayed).

Both recipes see the same model init, the same data order and the same injected fault, keyed by the data
position (micro-batch index), so a rolled-back run does not meet the bad batch again. Scenarios:
clean, lr_too_high, poisoned_batch, fp16_overflow_storm, nan_injection, distribution_shift (see SCENARIOS and
docs/guard.md for exactly what each one does).

A run "diverged" when its final loss (mean of the last 10 steps) is not finite or is above twice the clean
run's of the same recipe; a run the guard stopped is reported as "stopped". On a pretrained model every run is
also judged by what the model still knows: the trainer's held-out evaluation (fused_stable.train.evaluate:
`general` accuracy on known short answers, and the target task's accuracy, `identity`) after the run
(`general_after`, `task_after`), against the base model's (`general_before`, `task_before`). Outputs: a table
on stdout, `stress.json` and `stress.png` (loss curves, usual vs guarded, one panel per scenario) in
--output-dir.
"""

from __future__ import annotations

import io
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fused_stable.argcheck import OneLineParser, check_writable, number, parse_command, suggestion  # noqa: E402
from fused_stable.errors import UserError  # noqa: E402

RECIPES = ("usual", "guarded")
FINAL_WINDOW = 10  # steps averaged into the "final loss"


# ---------------------------------------------------------------------------------------------- settings
@dataclass
class StressConfig:
    model: str = "tiny"  # tiny (the embedded scratch Llama, full fine-tuning) or any sft --model (LoRA)
    steps: int = 120  # optimizer steps per run (one micro-batch each)
    batch_size: int = 8
    max_length: int = 96  # TINY_MIN_LENGTH on the tiny model
    lr: float = 1e-3  # a sane peak lr for fine-tuning the pre-trained tiny model
    pretrain_steps: int = 200  # the base: the embedded tiny Llama first trained on the task (shared by every run)
    pretrain_lr: float = 3e-3
    warmup_steps: int = 10
    log_every: int = 5  # the guard reads the device every log_every steps
    snapshot_every: int = 20  # the guarded recipe keeps a rollback snapshot taken at a clean check this often
    max_rollbacks: int = 5
    zscore_warmup: int = 25  # steps of grad norms the guarded optimizer collects before it can call one a spike
    lr_multiplier: float = 50.0  # lr_too_high: the peak lr this many times too high
    poison_weight: float = 1e4  # poisoned_batch: the loss weight of the corrupt batch
    seed: int = 0
    threads: int = 1
    examples: int = 2000  # tiny: built-in examples; a pretrained model: general examples mixed into its task


TINY_MIN_LENGTH = 96  # the tiny model's built-in prompts are this long

# the real-model suite's setup (`--model` other than tiny): LoRA on the identity task of `fused-stable sft`, sized to
# fit about 15 minutes on 2 CPU cores (12 runs and their evaluations; measured on this project's machine: a step of
# 2 x 64 tokens ~1.5 s, an evaluation ~25 s); the faults sit in the middle, after the guarded optimizer's norm
# statistics have warmed up
REAL_MODEL_DEFAULTS = dict(
    steps=24,
    batch_size=2,
    max_length=64,
    lr=1e-3,
    pretrain_steps=0,
    warmup_steps=3,
    log_every=5,
    snapshot_every=5,
    max_rollbacks=3,
    zscore_warmup=8,
    lr_multiplier=30.0,
    poison_weight=1e3,
    examples=50,
)


def is_real(cfg: StressConfig) -> bool:
    return cfg.model != "tiny"


@dataclass
class Scenario:
    name: str
    description: str
    lr_multiplier: float = 1.0
    fp16: bool = False
    # data-position keyed faults
    poison_at: int | None = None  # this micro-batch has garbage labels and a x poison_weight loss
    poison_weight: float = 1e4
    nan_at: int | None = None  # this micro-batch's loss becomes NaN
    storm: tuple[int, int] | None = None  # [start, end): losses x 2**storm_exponent before scaling (fp16 overflow)
    storm_exponent: int = 40
    shift_at: int | None = None  # from this micro-batch on, batches come from the shifted task

    @property
    def ends_on_other_data(self) -> bool:
        """Its final loss is measured on other data than the clean run's: not comparable with it."""
        return self.shift_at is not None


def scenarios(cfg: StressConfig) -> dict[str, Scenario]:
    mid = cfg.steps // 2
    storm = max(1, min(10, mid // 3))  # micro-batches on each side of the middle
    return {
        s.name: s
        for s in [
            Scenario("clean", "no fault: the reference for 'diverged'"),
            Scenario("lr_too_high", f"peak lr {cfg.lr_multiplier:g}x too high", lr_multiplier=cfg.lr_multiplier),
            Scenario(
                "poisoned_batch",
                f"micro-batch {mid}: random labels, loss weight x{cfg.poison_weight:g} (a huge gradient)",
                poison_at=mid,
                poison_weight=cfg.poison_weight,
            ),
            Scenario(
                "fp16_overflow_storm",
                f"fp16 grads + GradScaler; micro-batches {mid - storm}..{mid + storm - 1} overflow fp16 (loss x2^40)",
                fp16=True,
                storm=(mid - storm, mid + storm),
            ),
            Scenario("nan_injection", f"micro-batch {mid}: loss is NaN", nan_at=mid),
            Scenario(
                "distribution_shift", f"from micro-batch {mid}: a different prompt format, all upper case", shift_at=mid
            ),
        ]
    }


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


def build_workload(cfg: StressConfig) -> Workload:
    return build_real_workload(cfg) if is_real(cfg) else build_tiny_workload(cfg)


def build_tiny_workload(cfg: StressConfig) -> Workload:
    """The trainer's tokenizer, built-in task and embedded tiny Llama (full fine-tuning: every weight trains)."""
    from fused_stable.train import data
    from fused_stable.train.model import build_tiny_model
    from fused_stable.train.tokenizer import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    examples = data.builtin_examples(cfg.examples, seed=cfg.seed)
    items = data.tokenize_examples(examples, tokenizer, cfg.max_length)
    shifted_items = data.tokenize_examples([_shift_example(ex) for ex in examples], tokenizer, cfg.max_length)
    model = build_tiny_model(tokenizer)
    _pretrain(model, data.BatchOrder(items, cfg.batch_size, cfg.seed + 1, tokenizer.pad_token_id), cfg)
    return Workload(tokenizer, items, shifted_items, {k: v.clone() for k, v in model.state_dict().items()})


def build_real_workload(cfg: StressConfig) -> Workload:
    """A pretrained model (`--model`, resolved as `fused-stable sft` does) with the sft defaults' LoRA adapters
    (r 8, all linear layers), the sft default task (`identity`: who the assistant is, mixed with general
    instructions answered by the base model itself) and its held-out evaluation, taken once on the base."""
    from fused_stable.train import data, tasks
    from fused_stable.train.config import TrainConfig
    from fused_stable.train.evaluate import evaluate
    from fused_stable.train.model import apply_tuner, load_pretrained
    from fused_stable.train.sources import resolve_model

    source = resolve_model(cfg.model)
    model, tokenizer = load_pretrained(source, dtype=torch.float32)
    name, author = tasks.default_identity()
    examples = tasks.identity_examples(name, author, seed=cfg.seed, general=cfg.examples)
    items = data.tokenize_examples(examples, tokenizer, cfg.max_length)
    shifted_items = data.tokenize_examples([_shift_example(ex) for ex in examples], tokenizer, cfg.max_length)
    before = evaluate(model, tokenizer, name=name)
    torch.manual_seed(cfg.seed)
    model = apply_tuner(model, TrainConfig(model=cfg.model))
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return Workload(tokenizer, items, shifted_items, init, model=model, task_name=name, before=before)


def _fresh_model(work: Workload):
    """The model a run starts from: a new tiny Llama with the pre-trained weights, or the shared pretrained
    model with its adapters reset to their initial values."""
    if work.model is not None:
        from fused_stable.train.model import load_trainable_state

        load_trainable_state(work.model, work.init_state)
        return work.model
    from transformers import LlamaForCausalLM

    from fused_stable.train.model import tiny_llama_config

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


def _shift_example(example):
    """The shifted task: the same questions in a terse prompt format ("Q: ..."), everything upper case."""
    from fused_stable.train import data

    return data.Example(
        [{**m, "content": (("Q: " if m["role"] == "user" else "") + m["content"]).upper()} for m in example.messages]
    )


def _batch_source(work: Workload, cfg: StressConfig, scenario: Scenario):
    from fused_stable.train import data

    pad = work.tokenizer.pad_token_id
    normal = data.BatchOrder(work.items, cfg.batch_size, cfg.seed, pad)
    shifted = data.BatchOrder(work.shifted_items, cfg.batch_size, cfg.seed, pad)
    vocab = len(work.tokenizer)

    def batch(k: int):
        b = (shifted if scenario.shift_at is not None and k >= scenario.shift_at else normal).batch(k)
        if scenario.poison_at == k:
            gen = torch.Generator().manual_seed(cfg.seed + k)
            random_labels = torch.randint(3, vocab, b.labels.shape, generator=gen)
            b.labels = torch.where(b.attention_mask.bool(), random_labels, b.labels)
            b.num_label_tokens = int((b.labels[:, 1:] != data.IGNORE_INDEX).sum())
        return b

    return batch


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
    eval_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time for the run and its evaluation


def _fp16_grad_hooks(model) -> list:
    """fp16 gradients, emulated: every trainable parameter's gradient is rounded through float16 as it is
    produced, so a scaled gradient above 65504 becomes inf and one below 6e-8 becomes 0, as in an fp16 backward."""
    return [p.register_hook(lambda g: g.to(torch.float16).to(g.dtype)) for p in model.parameters() if p.requires_grad]


def run_one(work: Workload, cfg: StressConfig, scenario: Scenario, recipe: str) -> RunResult:
    from fused_stable import FusedAdamW, GradScaler, schedules
    from fused_stable.guard import Guard, GuardConfig

    torch.manual_seed(cfg.seed)
    model = _fresh_model(work)
    model.config.use_cache = False
    model.train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in trainable]
    names = [n for n, _ in trainable]
    hooks = _fp16_grad_hooks(model) if scenario.fp16 else []
    lr = cfg.lr * scenario.lr_multiplier
    batch = _batch_source(work, cfg, scenario)
    result = RunResult(scenario.name, recipe)
    guard = None
    if recipe == "usual":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
        scaler = torch.amp.GradScaler("cpu") if scenario.fp16 else None
    else:
        guard = Guard(GuardConfig(policy="rollback", max_rollbacks=cfg.max_rollbacks))
        opt = FusedAdamW(
            params,
            lr=lr,
            weight_decay=0.01,
            max_grad_norm=1.0,
            clip="zscore",
            zscore_warmup=cfg.zscore_warmup,
            lr_schedule=schedules.warmup_cosine(cfg.steps, cfg.warmup_steps),
            **guard.config.optimizer_kwargs(),
        )
        opt.param_names = names
        guard.bind(opt)
        scaler = GradScaler("cpu") if scenario.fp16 else None
        sched = None
    snapshot = _snapshot(trainable, opt, scaler, 0) if guard else None

    cpu0 = time.process_time()  # CPU time: on a shared machine, a fairer measure of the cost than the wall clock
    step, k = 0, 0  # optimizer steps (rolled back with the model), micro-batches consumed (never)
    pending: list[torch.Tensor] = []
    rows: list[dict] = []
    t0 = time.perf_counter()
    while step < cfg.steps:
        b = batch(k)
        loss = _loss(model, b)
        train_loss = loss
        if scenario.poison_at == k:
            train_loss = loss * scenario.poison_weight
        if scenario.nan_at == k:
            train_loss = loss * math.nan
        if scenario.storm is not None and scenario.storm[0] <= k < scenario.storm[1]:
            train_loss = loss * 2.0**scenario.storm_exponent
        if recipe == "usual":
            scale_before = scaler.get_scale() if scaler else None
            (scaler.scale(train_loss) if scaler else train_loss).backward()
            if scaler:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            if scaler:
                scaler.step(opt)
                scaler.update()
                result.skipped_steps += scaler.get_scale() < scale_before  # torch backs off exactly on skipped steps
            else:
                opt.step()
            sched.step()
        else:
            (scaler.scale(train_loss) if scaler else train_loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        k += 1
        seen = loss.detach() if scenario.nan_at != k - 1 else loss.detach() * math.nan
        skipped = opt.last_step_skipped.float() if guard else torch.zeros(())
        pending.append(torch.stack([seen, skipped]))
        if step % cfg.log_every == 0 or step == cfg.steps:
            losses = torch.stack(pending).tolist()
            pending.clear()
            new_rows = [
                {"step": step - len(losses) + 1 + i, "loss": v, "skipped": bool(skip)}
                for i, (v, skip) in enumerate(losses)
            ]
            rows += new_rows
            if guard:
                result.skipped_steps += sum(r["skipped"] for r in new_rows)  # counted before a rollback undoes them
                decision = guard.check(step, opt, new_rows)
                result.alerts += len(decision.alerts)
                if decision.action == "rollback":
                    _restore(snapshot, trainable, opt, scaler)
                    result.rolled_back_steps += step - snapshot["step"]
                    step = snapshot["step"]
                    rows = [r for r in rows if r["step"] <= step]
                    guard.apply_rollback(opt, cut_lr=decision.cut_lr)
                    continue
                if decision.action == "stop":
                    result.status, result.message = "stopped", decision.message
                    break
                if step % cfg.snapshot_every == 0 and not decision.alerts:
                    snapshot = _snapshot(trainable, opt, scaler, step)
    result.wall_s = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    result.losses = [r["loss"] for r in rows]
    tail = result.losses[-FINAL_WINDOW:]
    result.final_loss = sum(tail) / len(tail) if tail else math.nan
    if guard:
        result.rolled_back = guard.rollbacks
    if work.model is not None:  # what the pretrained model still knows, and what it learnt
        from fused_stable.train.evaluate import evaluate

        t0 = time.perf_counter()
        scores = evaluate(model, work.tokenizer, name=work.task_name)
        result.general_after, result.task_after = scores["general"]["accuracy"], scores["identity"]["accuracy"]
        result.eval_s = time.perf_counter() - t0
    result.cpu_s = time.process_time() - cpu0
    return result


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


# ---------------------------------------------------------------------------------------------- the suite
def judge(results: list[RunResult], other_data: Iterable[str] = ()) -> None:
    """Mark each run diverged (non-finite, or > 2x its recipe's clean final loss) unless the guard stopped it.
    The scenarios named in `other_data` end on other data than the clean run (`Scenario.ends_on_other_data`),
    so their loss is not compared with it (non-finite only; on a pretrained model the evaluation after the run
    says what it kept)."""
    other_data = set(other_data)
    clean = {r.recipe: r.final_loss for r in results if r.scenario == "clean"}
    for r in results:
        if r.status == "stopped":
            continue
        reference = None if r.scenario in other_data else clean.get(r.recipe)
        bad = not math.isfinite(r.final_loss) or (reference is not None and r.final_loss > 2.0 * reference)
        r.status = "diverged" if bad else "ok"


def format_table(results: list[RunResult], before: dict | None = None) -> str:
    """The markdown table; with a pretrained model's evaluation, `general` and task accuracy after each run
    (and the base model's in the first line)."""
    evaluated = any(r.general_after is not None for r in results)
    header = "| scenario | recipe | outcome | final loss |"
    if evaluated:
        header += " general after | task after |"
    header += " skipped steps | rollbacks (steps undone) | alerts | wall time |"
    lines = [header, "|" + "---|" * (header.count(" | ") + 1)]
    if evaluated and before is not None:
        lines.append(
            f"| base model | - | - | - | {before['general']['accuracy']:.3f} | {before['identity']['accuracy']:.3f} "
            "| - | - | - | - |"
        )
    for r in results:
        alerts = str(r.alerts) if r.recipe == "guarded" else "-"
        rollbacks = f"{r.rolled_back} ({r.rolled_back_steps})" if r.recipe == "guarded" else "-"
        line = f"| {r.scenario} | {r.recipe} | {r.status} | {r.final_loss:.3f} |"
        if evaluated:
            line += f" {_accuracy(r.general_after)} | {_accuracy(r.task_after)} |"
        lines.append(line + f" {r.skipped_steps} | {rollbacks} | {alerts} | {r.wall_s:.1f}s |")
    return "\n".join(lines)


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def plot(results: list[RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.scenario for r in results))
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for r in results:
            if r.scenario != name:
                continue
            ys = [v if math.isfinite(v) else float("nan") for v in r.losses]
            color = "tab:red" if r.recipe == "usual" else "tab:blue"
            label = f"{r.recipe}: {r.status}"
            if r.general_after is not None:
                label += f", general {r.general_after:.2f}, task {r.task_after:.2f}"
            ax.plot(range(1, len(ys) + 1), ys, lw=1.1, label=label, color=color)
            bad = next((i for i, v in enumerate(r.losses) if not math.isfinite(v)), None)
            if bad is not None and not math.isfinite(r.final_loss):  # NaN draws nothing: mark where the curve ends
                ax.axvline(bad + 1, color=color, ls="--", lw=1)
                ax.annotate(
                    f"{r.recipe}: loss non-finite from step {bad + 1}",
                    (bad + 1, 0.95),
                    xycoords=("data", "axes fraction"),
                    fontsize=8,
                    color=color,
                    ha="center",
                )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("train loss (per token)")
    fig.suptitle("fused-stable stress: usual recipe (torch AdamW + clip 1.0) vs guarded (FusedAdamW + guard)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_suite(
    cfg: StressConfig,
    names: list[str],
    progress: Callable[[str], None] = print,
    work: Workload | None = None,
    on_result: Callable[[list[RunResult]], None] | None = None,
) -> list[RunResult]:
    """Every named scenario (and `clean`, the reference) with both recipes; `on_result` sees the results so far
    after each run (the command writes them out, so a long suite cut short keeps what it measured)."""
    available = scenarios(cfg)
    work = work or build_workload(cfg)
    if "clean" not in names:
        names = ["clean"] + names  # the reference for "diverged"
    results = []
    for name in names:
        for recipe in RECIPES:
            r = run_one(work, cfg, available[name], recipe)
            knows = f"  general {r.general_after:.3f}  task {r.task_after:.3f}" if r.general_after is not None else ""
            progress(
                f"  {name:<22} {recipe:<8} final loss {r.final_loss:.3f}{knows}  skipped {r.skipped_steps}  "
                f"rollbacks {r.rolled_back}  {r.wall_s:.1f}s" + (f"  [{r.message}]" if r.message else "")
            )
            results.append(r)
            judge(results, other_data=[n for n, s in available.items() if s.ends_on_other_data])
            if on_result is not None:
                on_result(results)
    return results


# where each option makes sense: (low, high) for argcheck.number; stress runs are minutes, not days
_RANGES = {
    "steps": dict(low=20, high=100_000, integer=True),
    "pretrain_steps": dict(low=0, high=100_000, integer=True),
    "batch_size": dict(low=1, high=4096, integer=True),
    "max_length": dict(low=32, high=65536, integer=True),
    "lr": dict(low=0, high=1, low_open=True),
    "log_every": dict(low=1, high=100_000, integer=True),
    "max_rollbacks": dict(low=0, high=1000, integer=True),
    "seed": dict(low=0, high=2**32 - 1, integer=True),
    "threads": dict(low=1, high=1024, integer=True),
}


_HELPS = {
    "steps": "optimizer steps per run, one micro-batch each; faults sit at the middle",
    "pretrain_steps": "tiny: steps of plain training that make the shared base model (0: the random tiny Llama)",
    "batch_size": "sequences per step",
    "max_length": f"token limit per sequence (tiny: at least {TINY_MIN_LENGTH}, its built-in prompts need it)",
    "lr": "the sane peak lr of both recipes",
    "lr_multiplier": "lr_too_high: the peak lr this many times too high",
    "poison_weight": "poisoned_batch: the loss weight of the batch with random labels",
    "log_every": "the guarded recipe's guard reads the device every N steps",
    "max_rollbacks": "the guarded recipe gives up (stops) after this many rollbacks",
    "zscore_warmup": "steps the guarded optimizer's norm statistics warm up before a spike can be called",
    "seed": "data order, the adapters' init and the tiny base model's training",
    "threads": "torch CPU threads (1 is fastest and steadiest on a shared 2-core machine)",
}
_RANGES.update(
    lr_multiplier=dict(low=1, high=1e6),
    poison_weight=dict(low=1, high=1e12),
    zscore_warmup=dict(low=1, high=100_000, integer=True),
)


def build_parser() -> OneLineParser:
    tiny, real = StressConfig(), StressConfig(**REAL_MODEL_DEFAULTS)
    p = OneLineParser(
        prog="fused-stable stress",
        description=__doc__.split("\n\n")[0],
        aliases={
            "--output_dir": "--output-dir",
            "--out": "--output-dir",
            "--scenario": "--scenarios",
            "--iters": "--steps",
            "--max-steps": "--steps",
            "--learning-rate": "--lr",
        },
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny (the embedded scratch Llama, full fine-tuning; the fast "
        "default) or what `fused-stable sft --model` takes (smollm2-135m, an HF folder, a .gguf file): "
        "LoRA on the identity task, judged by the held-out evaluation after every run",
    )
    p.add_argument(
        "--scenarios", default="all", help=f"comma-separated subset of {', '.join(scenarios(tiny))} (default: all)"
    )
    p.add_argument(
        "--output-dir", default="runs/stress", help="where stress.json and stress.png go (default: runs/stress)"
    )
    for name, text in _HELPS.items():
        defaults = f"tiny {getattr(tiny, name):g}, pretrained {getattr(real, name):g}"
        if getattr(tiny, name) == getattr(real, name):
            defaults = f"{getattr(tiny, name):g}"
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=number(**_RANGES[name]),
            default=None,
            help=f"{text} (default: {defaults})",
        )
    return p


def config_from_args(args) -> StressConfig:
    """The options given, on top of the tiny suite's defaults or the pretrained model's."""
    base = {} if args.model == "tiny" else dict(REAL_MODEL_DEFAULTS)
    given = {name: getattr(args, name) for name in _HELPS if getattr(args, name) is not None}
    return StressConfig(model=args.model, **{**base, **given})


def main(argv: list[str]) -> int:
    """`fused-stable stress`; a bad option is one line on stderr and exit code 2, before anything is written."""
    args, code = parse_command(build_parser(), argv, "stress")
    if args is None:
        return code
    cfg = config_from_args(args)
    known = scenarios(cfg)
    names = list(known) if args.scenarios == "all" else [s.strip() for s in args.scenarios.split(",") if s.strip()]
    try:
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            close = suggestion(unknown[0], known) if unknown else None
            hint = f"did you mean {close!r}? " if close else ""
            what = f"unknown scenario {unknown[0]!r}" if unknown else "--scenarios names no scenario"
            raise UserError(f"{what}; {hint}choose from {', '.join(known)} or all")
        if not is_real(cfg) and cfg.max_length < TINY_MIN_LENGTH:
            raise UserError(
                f"--max-length must be at least {TINY_MIN_LENGTH} on the tiny model (its built-in prompts "
                f"need it), got {cfg.max_length}"
            )
        if cfg.steps < 2 * cfg.log_every:
            raise UserError(f"--steps must be at least 2 x --log-every ({2 * cfg.log_every}), got {cfg.steps}")
        if is_real(cfg):
            from fused_stable.train.sources import resolve_model

            resolve_model(cfg.model)  # a model that cannot be found: one line, before anything is written
        check_writable(args.output_dir, "--output-dir")
    except UserError as exc:
        print(f"fused-stable stress: error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.threads)
    os.makedirs(args.output_dir, exist_ok=True)
    what = (
        f"{cfg.model} with LoRA (r 8, all linear layers) on the identity task"
        if is_real(cfg)
        else "the embedded tiny Llama (full fine-tuning)"
    )
    print(
        f"fused-stable stress: {len(names)} scenario(s) x {RECIPES} on {what}, {cfg.steps} steps each, "
        f"{cfg.threads} thread(s)",
        flush=True,
    )
    t0 = time.perf_counter()
    work = build_workload(cfg)
    if work.before is not None:
        print(
            f"  base model: general {work.before['general']['accuracy']:.3f}"
            f"  task {work.before['identity']['accuracy']:.3f}"
            f"  ({time.perf_counter() - t0:.0f}s to load and evaluate)",
            flush=True,
        )
    json_path = os.path.join(args.output_dir, "stress.json")
    png_path = os.path.join(args.output_dir, "stress.png")

    def write(results: list[RunResult], finished: bool) -> None:
        _write_json(json_path, cfg, known, results, work, time.perf_counter() - t0, finished)

    results = run_suite(
        cfg,
        names,
        progress=lambda line: print(line, flush=True),
        work=work,
        on_result=lambda so_far: write(so_far, finished=False),
    )
    write(results, finished=True)
    print()
    print(format_table(results, work.before))
    plot(results, png_path)
    print(f"\nwrote {json_path} and {png_path} in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


def _json_value(v):
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def _write_json(
    path: str, cfg: StressConfig, known: dict, results: list[RunResult], work: Workload, wall_s: float, finished: bool
) -> None:
    """stress.json (written after every run, atomically: a suite cut short keeps what it measured)."""
    before = None
    if work.before is not None:
        before = {
            "general_before": work.before["general"]["accuracy"],
            "task_before": work.before["identity"]["accuracy"],
            "general_n": work.before["general"]["n"],
            "task_n": work.before["identity"]["n"],
        }
    report = {
        "config": asdict(cfg),
        "finished": finished,
        "base_model": before,
        "scenarios": {n: asdict(s) for n, s in known.items() if n in {r.scenario for r in results}},
        "results": [
            {k: _json_value(v) for k, v in asdict(r).items() if k != "losses"}
            | {"losses": [_json_value(x) for x in r.losses]}
            for r in results
        ],
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": cfg.threads,
            "cpus": os.cpu_count(),
        },
        "total_wall_s": wall_s,
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
