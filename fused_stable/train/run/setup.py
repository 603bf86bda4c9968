"""Building a run of `fused-stable sft` before anything is written: the config and the checkpoint to resume
(`_resolve`), every input checked, then the model, data, optimizer and trainer (`setup_run`, in named steps);
`RunSetup.start` then locks output_dir, loads the checkpoint and claims the run's entries in its manifest.

Imports of torch, transformers and the trainer's heavier rooms are inside the functions: `--help` and a bad
input end before any of them loads.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from fused_stable.errors import UserError
from fused_stable.train.evaluation.run_evaluations import held_out_losses
from fused_stable.train.run import stop_message

RUN_FILE = "run.yaml"


def evaluating(cfg) -> bool:
    """Whether the run evaluates its model before and after training (eval.json)."""
    return cfg.evaluation == "on" or (cfg.evaluation == "auto" and cfg.dataset == "identity")


def run_entries(cfg) -> list[str]:
    """The top-level entries of output_dir that a run with this config creates: claimed in its manifest
    (outputs.claim) before they are created, and exactly what a later --overwrite removes."""
    from fused_stable.train.evaluation.before_after import EVAL_FILE

    names = [
        RUN_FILE,
        "metrics.jsonl",
        "alerts.jsonl",
        "curves.png",
        "checkpoints",
        "model" if cfg.tuner == "full" else "adapter",
    ]
    loggers = (["tensorboard"] if tensorboard_on(cfg) else []) + (["wandb"] if cfg.report_to == "wandb" else [])
    return names + loggers + ([EVAL_FILE] if evaluating(cfg) else [])


def tensorboard_on(cfg) -> bool:
    """TensorBoard events are written with report_to tensorboard (the default) and tensorboard true."""
    return cfg.tensorboard and cfg.report_to == "tensorboard"


# what FusedAdamW.load_state_dict does to a state saved in another precision (docs/optimizer.md, "State dicts")
_CONVERSION = {"fp32": "decoded to fp32", "bf16": "rounded to bf16", "8bit": "quantised to 8-bit codes and scales"}


def _resolve(argv: list[str]):
    """The config, the checkpoint to resume from (None for a fresh run), and the damaged or incomplete
    checkpoints `resume latest` passed over (one line each)."""
    from fused_stable.train.config.keys import STATE_KEYS
    from fused_stable.train.config.resolve import resolve_config, same_state_value
    from fused_stable.train.run import checkpoint, outputs

    cfg, explicit = resolve_config(argv, log=print_rank0)
    if cfg.resume is None:
        return cfg, None, []
    if cfg.resume != "latest" and "output_dir" not in explicit:
        # a checkpoint path names its run: output_dir/checkpoints/step-N
        cfg.output_dir = os.path.dirname(os.path.dirname(os.path.abspath(cfg.resume)))
    try:
        path, passed_over = checkpoint.resolve_resume(cfg.output_dir, cfg.resume)
    except UserError as exc:
        if cfg.resume == "latest" and outputs.read_manifest(cfg.output_dir) is not None:
            raise UserError(stop_message.no_usable_checkpoint(str(exc), cfg.output_dir)) from None
        raise
    try:
        saved_cfg, _ = resolve_config([], base=checkpoint.checkpoint_config(path))
    except UserError as exc:
        raise UserError(f"{os.path.join(path, 'config.yaml')}: {exc}") from None
    changed = [
        k for k in STATE_KEYS if k in explicit and not same_state_value(k, getattr(saved_cfg, k), getattr(cfg, k))
    ]
    if changed:
        diffs = ", ".join(f"{k} (checkpoint: {getattr(saved_cfg, k)}, now: {getattr(cfg, k)})" for k in changed)
        raise UserError(
            f"cannot resume {path} with a different {diffs}: the checkpoint fixes them (its weights' shapes and "
            "meaning, or the optimizer state that restores lr and weight_decay); leave them out to continue the "
            "run, or start a new run in another output_dir"
        )
    # keys not given now come from the run being resumed, so `--resume latest` alone continues it
    saved = saved_cfg.to_dict()
    saved.update({k: getattr(cfg, k) for k in explicit | {"resume", "output_dir"}})
    saved["overwrite"] = cfg.overwrite
    cfg, _ = resolve_config([], base=saved)  # checked as a whole (a Muon run's rule with the new state_precision)
    if cfg.state_precision != saved_cfg.state_precision and "state_precision" in explicit:
        print_rank0(
            f"resuming {path}: its {saved_cfg.state_precision} optimizer state is converted to "
            f"{cfg.state_precision} once, as it loads ({_CONVERSION[cfg.state_precision]})"
        )
    return cfg, path, passed_over


@dataclass
class RunSetup:
    """Everything a run needs, built and checked; nothing written yet (see `start`)."""

    cfg: object
    runtime: object
    tokenizer: object
    model: object
    trainer: object
    resume_path: str | None
    n_examples: int
    passed_over: list = field(default_factory=list)  # damaged checkpoints `resume latest` skipped (messages)
    source: object = None  # the resolved --model (fused_stable.train.model.sources.ModelSource)
    threads: int = 1
    evaluating: bool = False  # held-out evaluation before and after training (eval.json)
    lock: object = None  # rank 0's outputs.FolderLock on output_dir, held from `start` until `release`
    given_system: int = 0  # examples (training and held-out) that got the run's --system, having none

    def start(self) -> None:
        """(Rank 0) lock output_dir; load the checkpoint to resume; then (rank 0) replace the previous run if
        --overwrite, claim the run's entries in its manifest and write run.yaml. The checkpoint is loaded
        first, so a start that fails leaves output_dir exactly as it was (and unlocked)."""
        from fused_stable.train.config.resolve import dump_yaml, run_dict
        from fused_stable.train.run import checkpoint, outputs
        from fused_stable.train.run.report import AlertLog, QuietReporter, Reporter

        cfg, trainer, main_rank = self.cfg, self.trainer, self.runtime.is_main
        try:
            if main_rank:  # under torchrun only rank 0 writes output_dir
                # a second run into this folder is refused from here until this one ends (or is killed)
                self.lock = outputs.FolderLock(cfg.output_dir, outputs.SFT)
                self.lock.acquire()
            if self.resume_path is not None:
                trainer.restore(self.resume_path)
            if main_rank:
                if self.resume_path is None and cfg.overwrite:
                    outputs.remove_previous_run(cfg.output_dir)  # only what its manifest names (setup_run checked)
                # what a run killed mid-save left behind (the lock says no other writer is here)
                for line in checkpoint.clear_leftovers(cfg.output_dir):
                    print_rank0(f"fused-stable sft: note: {line}")
                details = {"optimizer_state": optimizer_state(trainer)}
                split = muon_split(trainer)
                if split is not None:
                    details["muon_split"] = split
                outputs.claim(cfg.output_dir, run_entries(cfg), details=details)
                with open(os.path.join(cfg.output_dir, RUN_FILE), "w") as f:
                    f.write(dump_yaml(cfg))
        except BaseException:
            self.release()
            raise
        trainer.reporter = (
            Reporter(
                cfg.output_dir,
                trainer.total_steps,
                trainer.state.step,
                tensorboard=tensorboard_on(cfg),
                max_grad_norm=cfg.max_grad_norm,
                wandb_config=run_dict(cfg) if cfg.report_to == "wandb" else None,
            )
            if main_rank
            else QuietReporter()
        )
        if trainer.guard is not None and main_rank:
            trainer.alert_log = AlertLog(cfg.output_dir, trainer.state.step)

    def release(self) -> None:
        """Let go of output_dir's lock (the run ended, or its start failed)."""
        if self.lock is not None:
            self.lock.release()


def optimizer_state(trainer) -> dict:
    """What the run header and run_manifest.json say about the optimizer's state: its precision and size in MiB
    (`mib`: this process's share under torchrun, where FSDP2 shards the state with the params); under DeepSpeed
    from every rank's ZeRO partitions, with the per-rank bytes, the total and where it lies
    (deepspeed_run.Engine.optimizer_state): the local params are empty there at ZeRO-3."""
    opt = trainer.optimizer
    precision = {"precision": opt.defaults["state_precision"]}
    if trainer.engine is not None:
        return {**precision, **trainer.engine.optimizer_state()}
    return {**precision, "mib": round(opt.state_bytes() / 2**20, 3)}


def muon_split(trainer) -> dict | None:
    """Where a Muon run's params went and why (FusedMuon.describe(): tensors, matrices and params per side, per
    reason), for the header and run_manifest.json's `muon_split`; None for another rule."""
    describe = getattr(trainer.optimizer, "describe", None)
    return describe() if callable(describe) else None


def muon_split_text(trainer, muon_lora: bool) -> str | None:
    """`muon_split` in a line: `Muon: 14 matrices in 14 tensors, 98,304 params (hidden matrix 14) | AdamW: 7
    tensors, 4,288 params (1-D 5, embedding 1, head 1)`, the reasons counted in tensors; a LoRA run whose factors
    are on AdamW says how to put them on Muon. None for another rule."""
    split = muon_split(trainer)
    if split is None:
        return None
    muon, adamw = split["muon"], split["adamw"]

    def reasons(side: dict) -> str:
        counts = ", ".join(f"{reason} {held['tensors']}" for reason, held in side["reasons"].items())
        return f" ({counts})" if counts else ""

    text = (
        f"Muon: {muon['matrices']} matrices in {muon['tensors']} tensors, {muon['params']:,} params{reasons(muon)} | "
        f"AdamW: {adamw['tensors']} tensors, {adamw['params']:,} params{reasons(adamw)}"
    )
    if "LoRA factor" in adamw["reasons"] and not muon_lora:
        text += " | the LoRA factors are on AdamW, as LLaMA-Factory's use_muon; --muon_lora puts them on Muon"
    elif muon["matrices"]:
        schulz = split["newton_schulz"]
        text += f" | Newton-Schulz in {schulz['dtype']} ({schulz['why']})"
        if schulz["gram_blocks"]:
            text += f", its Gram products by blocks for {schulz['gram_blocks']} matrices ({schulz['blocks_why']})"
    return text


def _mib(n_bytes: int) -> str:
    """MiB for the DeepSpeed header: one decimal from 10 MiB, three significant digits below (a LoRA adapter's
    partitions are a small fraction of one MiB)."""
    return f"{n_bytes / 2**20:.1f}" if n_bytes >= 10 * 2**20 else f"{n_bytes / 2**20:#.3g}"


def optimizer_state_text(trainer) -> str:
    """The header's words for the optimizer state (`state_words` of `optimizer_state`)."""
    from fused_stable.train.run import parallel

    sharing = None
    if trainer.engine is None and parallel.world_size() > 1:
        sharing = "fsdp2" if parallel.is_fsdp(trainer.model) else "ddp"
    words = state_words(optimizer_state(trainer), sharing, parallel.world_size())
    if trainer.engine is None:  # (DeepSpeed's optimizer holds flat partitions, not the model's tensors)
        words += formats_words(trainer.optimizer)
    return words


def formats_words(optimizer) -> str:
    """Where the state's formats differ from its state_precision, how many tensors and params each holds: an 8bit
    run keeps tensors under MIN_QUANTISED_NUMEL elements in fp32 (bitsandbytes' rule), all of a LoRA adapter's on
    a small model; nothing where every tensor has the precision's format."""
    from fused_stable.state_format import FORMAT_NAMES, MIN_QUANTISED_NUMEL, format_for

    precision = optimizer.defaults["state_precision"]
    counts: dict[str, list[int]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:  # the whole param's numel (a DTensor's is global): the format on every rank
            held = counts.setdefault(FORMAT_NAMES[format_for(group["state_precision"], p.numel())], [0, 0])
            held[0], held[1] = held[0] + 1, held[1] + p.numel()
    if set(counts) <= {precision}:
        return ""
    parts = []
    for name, (tensors, params) in sorted(counts.items(), key=lambda item: item[0] != precision):
        small = f" under {MIN_QUANTISED_NUMEL:,} elements" if precision == "8bit" and name != "8bit" else ""
        parts.append(f"{name}: {tensors} tensors{small}, {params:,} params")
    return f" ({'; '.join(parts)})"


def state_words(state: dict, sharing: str | None = None, ranks: int = 1) -> str:
    """`optimizer_state`'s dict in words: `fp32 1.2 MiB`; under torchrun (`sharing` "ddp" or "fsdp2") this
    process's share, said so (`per rank (DDP replicates it)`, `on rank 0 (FSDP2 shards it over N ranks)`); under
    DeepSpeed `fp32 1.2 MiB per rank, 2.4 MiB in all (ZeRO-3 partitions)`, a range where the ranks' partitions
    differ, and `offloaded to host memory` under ZeRO-Offload."""
    if "bytes_per_rank" not in state:  # no DeepSpeed
        text = f"{state['precision']} {state['mib']:.1f} MiB"
        if sharing == "fsdp2":
            return f"{text} on rank 0 (FSDP2 shards it over {ranks} ranks)"
        return f"{text} per rank (DDP replicates it)" if sharing == "ddp" else text
    per_rank = sorted(state["bytes_per_rank"])
    low, high = _mib(per_rank[0]), _mib(per_rank[-1])
    what = "replicated on every rank" if state["zero_stage"] == 0 else "partitions"
    where = ", offloaded to host memory" if state["memory"] == "host" else ""
    return (
        f"{state['precision']} {low if low == high else f'{low}-{high}'} MiB per rank, "
        f"{_mib(sum(per_rank))} MiB in all (ZeRO-{state['zero_stage']} {what}{where})"
    )


def setup_run(argv: list[str]) -> RunSetup:
    """Parse and check the config, data and model, and build the trainer; raises UserError on bad input."""
    from fused_stable.guard import Guard
    from fused_stable.train.config.resolve import guard_config
    from fused_stable.train.model.load import load_tokenizer
    from fused_stable.train.model.sources import resolve_model
    from fused_stable.train.run import deepspeed_run, parallel
    from fused_stable.train.run.runtime import resolve_runtime, set_threads

    cfg, resume_path, passed_over = _resolve(argv)
    _check_output_folder(cfg, resume_path)
    # every check on user input happens before anything is written
    runtime = resolve_runtime(cfg.device, cfg.precision)
    threads = set_threads(cfg.threads)
    parallel.check_resume(resume_path)  # torchrun: only with the process count that wrote the checkpoint
    deepspeed_run.check_run(cfg, resume_path, runtime.precision)  # DeepSpeed: process count and precision
    source = resolve_model(cfg.model)
    examples, heldout, given_system = _examples(cfg)
    tokenizer = load_tokenizer(source, log=print_rank0)
    items = _tokenized(cfg, examples, tokenizer)
    model, groups = _model(cfg, source, tokenizer, runtime)
    guard = Guard(guard_config(cfg))
    trainer = _trainer(cfg, model, groups, items, tokenizer, runtime, guard)
    trainer.evaluator = held_out_losses(cfg, model, tokenizer, heldout, runtime, log=print_rank0)
    return RunSetup(
        cfg,
        runtime,
        tokenizer,
        model,
        trainer,
        resume_path,
        len(items),
        passed_over,
        source=source,
        threads=threads,
        evaluating=evaluating(cfg),
        given_system=given_system,
    )


def _check_output_folder(cfg, resume_path: str | None) -> None:
    """The output folder before anything heavy: writable, and new, empty or (with --overwrite) only a run's."""
    from fused_stable.train.run import checkpoint, outputs

    outputs.check_output_dir(
        cfg.output_dir,
        overwrite=cfg.overwrite,
        resume_path=resume_path,
        has_checkpoint=checkpoint.latest_checkpoint(cfg.output_dir) is not None,
    )


def _tokenized(cfg, examples: list, tokenizer) -> list:
    """The examples as token ids with their labels; one whose answer max_length cuts off entirely is skipped
    (counted in a note)."""
    from fused_stable.train.data import instructions

    items = instructions.tokenize_examples(examples, tokenizer, cfg.max_length)
    return instructions.fit_to_length(items, cfg.max_length, log=print_rank0)


def _model(cfg, source, tokenizer, runtime):
    """The base model with its adapters (or all of it trainable), wrapped for torchrun, and its param groups."""
    import torch

    from fused_stable.train.model.adapters import apply_tuner, param_groups
    from fused_stable.train.model.load import load_base_model
    from fused_stable.train.run import deepspeed_run, parallel

    torch.manual_seed(cfg.seed)
    model = load_base_model(cfg, source, tokenizer, runtime.device, runtime.compute_dtype, log=print_rank0)
    model = apply_tuner(model, cfg)
    if not deepspeed_run.wanted(cfg):  # (DeepSpeed's engine does the data parallelism itself)
        model = parallel.wrap(model, cfg.tuner)  # torchrun: DDP, or FSDP2 for full (before the optimizer is built)
    return model, param_groups(parallel.unwrap(model), cfg)


def _optimizer(cfg, model, groups, total_steps: int, guard):
    """The run's rule (optimizers.RULES[cfg.optim]: FusedAdamW, FusedLion, FusedMuon) with the run's schedule, bound
    to the guard. Clipping happens inside the fused step (one norm pass), never in a separate clip_grad_norm_ call;
    under guard=skip|rollback the same step also skips grad-norm spikes."""
    from fused_stable import schedules
    from fused_stable.train.config.resolve import warmup_asked, warmup_steps
    from fused_stable.train.run import optimizers

    warmup = warmup_steps(cfg, total_steps)
    asked = warmup_asked(cfg, total_steps)
    if warmup < asked:
        print_rank0(
            f"fused-stable sft: note: warm-up: {asked} steps asked for in a run of {total_steps}; {warmup} taken, "
            "so that the run trains at its peak lr (a warm-up's first step is at lr 0)"
        )
    schedule = {
        "cosine": lambda: schedules.warmup_cosine(total_steps, warmup),
        "linear": lambda: schedules.warmup_linear(total_steps, warmup),
        "constant": lambda: schedules.constant(warmup),
    }[cfg.scheduler]()
    options = dict(
        max_grad_norm=cfg.max_grad_norm or None,
        lr_schedule=schedule,
        clip=cfg.clip,
        state_precision=cfg.state_precision,
        **guard.config.optimizer_kwargs(),
    )
    optimizer = optimizers.build(cfg, model, groups, options)
    guard.bind(optimizer)
    return optimizer


def _trainer(cfg, model, groups, items: list, tokenizer, runtime, guard):
    """The batch order (torchrun: each rank batches its own shard of the rows), the optimizer, the loss scaler
    under fp16, the DeepSpeed engine when the run has one (the optimizer attached to it: one decision per engine
    step from the global norm), and the Trainer over them."""
    from fused_stable import GradScaler
    from fused_stable.train.config.resolve import eval_steps, run_dict
    from fused_stable.train.data import instructions
    from fused_stable.train.run import deepspeed_run, parallel
    from fused_stable.train.run.loop import Trainer

    attention, rows, collate_rows = _packed(cfg, model, items)
    batches = instructions.BatchOrder(
        parallel.shard(rows), cfg.batch_size, cfg.seed, tokenizer.pad_token_id, collate_rows
    )
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * batches.batches_per_epoch / cfg.grad_accum))
    optimizer = _optimizer(cfg, parallel.unwrap(model), groups, total_steps, guard)
    scaler = GradScaler(runtime.device.type) if runtime.precision == "fp16" else None
    engine = deepspeed_run.start(model, optimizer, cfg, runtime) if deepspeed_run.wanted(cfg) else None
    return Trainer(
        model=engine.ds if engine is not None else model,
        engine=engine,
        optimizer=optimizer,
        scaler=scaler,
        batches=batches,
        runtime=runtime,
        reporter=None,
        output_dir=cfg.output_dir,
        config=run_dict(cfg),
        total_steps=total_steps,
        grad_accum=cfg.grad_accum,
        logging_steps=cfg.logging_steps,
        save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit,
        guard=guard,
        eval_steps=eval_steps(cfg),
        attention=attention,
    )


def _packed(cfg, model, items: list):
    """packing / neat_packing (train/data/packing.py): the examples in rows of at most max_length tokens, their
    collate function and how they reach the model (neat: refused here, in one line, where the model's attention
    cannot be confined); without packing, the examples one per row."""
    from fused_stable.train.data import instructions, packing
    from fused_stable.train.run import parallel

    if not packing.packing_on(cfg):
        return None, items, instructions.collate
    attention = packing.check_attention(parallel.unwrap(model), neat=cfg.neat_packing)
    rows = packing.pack_rows(items, cfg.max_length)
    print_rank0(
        f"packing: {len(items):,} examples in {len(rows):,} rows of at most {cfg.max_length} tokens "
        + (
            "(attention confined to each example)"
            if cfg.neat_packing
            else "(attention sees the row's earlier examples)"
        )
    )
    return attention, rows, packing.collate_packed


def print_rank0(text: str) -> None:
    from fused_stable.train.run import parallel

    if parallel.launch_rank() == 0:
        print(text, flush=True)


def _examples(cfg) -> tuple[list, list, int]:
    """(training examples, held-out examples, how many of them got the run's system): the data set mixed and
    split, then the run's --system given to every example of both that has no system message of its own (the
    identity task's held-out set is its own, so this is after the split), so training, eval_loss and chat
    ask with the same prompt."""
    from fused_stable.train.data.rows import give_system
    from fused_stable.train.evaluation.held_out import held_out_split

    examples, heldout = held_out_split(cfg, _task_examples(cfg), _task_examples(cfg, held_out=True))
    examples, given = give_system(examples, cfg.system)
    heldout, given_heldout = give_system(heldout, cfg.system)
    return examples, heldout, given + given_heldout


def _task_examples(cfg, held_out: bool = False):
    """cfg.dataset's examples (`held_out`: cfg.eval_dataset's, [] without one): each dataset of the comma list
    loaded, cut and sampled, then mixed (mixing.py)."""
    from fused_stable.train.data import instructions, mixing, tasks

    def load_one(name):
        if name == "identity":
            return tasks.identity_examples(
                cfg.identity_name, cfg.identity_author, seed=cfg.seed, general=cfg.general_examples
            )
        if name == "arithmetic":
            return instructions.builtin_examples(cfg.arithmetic_examples, seed=cfg.seed)
        return instructions.load_examples(name, log=print_rank0)

    if held_out and cfg.eval_dataset is None:
        return []
    examples, line = mixing.load_mixed(cfg, load_one, held_out=held_out)
    print_rank0(line)
    return examples
