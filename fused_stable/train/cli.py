"""`fused-stable sft`: parse the config, check every input before writing anything, build the model,
data and optimizer, train, and save. User mistakes end with one line on stderr and exit code 2.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import dataclass

# offline by construction: nothing below may try a model hub (set before transformers is imported)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fused_stable.train.errors import UserError  # noqa: E402

RUN_FILE = "run.yaml"
# what a previous run leaves in output_dir; --overwrite removes exactly these
RUN_ARTIFACTS = (RUN_FILE, "metrics.jsonl", "alerts.jsonl", "curves.png", "eval.json", "tensorboard", "checkpoints",
                 "adapter", "model")


def _quiet_third_party_noise() -> None:
    """Two messages every run would print that say nothing about the run: bitsandbytes' note that an optional
    hub-downloaded CPU kernel is missing (we are offline by design), and a transformers deprecation that peft
    triggers."""
    import logging
    import warnings

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars on every load: the run prints its own progress
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        from fused_stable.train.config import help_text

        if os.environ.get("RANK", "0") == "0":  # under torchrun: once, from rank 0
            print(help_text())
        return 0
    _quiet_third_party_noise()
    from fused_stable.train import parallel

    try:
        with parallel.process_group():  # under torchrun: join the other ranks; nothing in a single process
            try:
                return run(argv)
            except UserError as exc:
                parallel.report_error(f"fused-stable sft: error: {exc}")  # rank 0 prints; every rank exits 2
                return 2
    except UserError as exc:  # torchrun's environment is incomplete: there is no process group to join
        if parallel.launch_rank() == 0:
            print(f"fused-stable sft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if parallel.launch_rank() == 0:
            print("fused-stable sft: interrupted (resume with --resume latest)", file=sys.stderr)
        return 130


def _existing_artifacts(output_dir: str) -> list[str]:
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UserError(f"output_dir {output_dir!r} exists and is not a directory")
    return [name for name in RUN_ARTIFACTS if os.path.exists(os.path.join(output_dir, name))]


def _refuse_existing_run(output_dir: str) -> None:
    existing = _existing_artifacts(output_dir)
    if existing:
        raise UserError(
            f"output_dir {output_dir!r} already holds a run ({', '.join(existing)}); "
            "pass --resume latest to continue it or --overwrite to replace it"
        )


def _prepare_output_dir(output_dir: str, overwrite: bool, resuming: bool) -> None:
    existing = _existing_artifacts(output_dir)
    if existing and not resuming and not overwrite:
        _refuse_existing_run(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    if existing and overwrite and not resuming:
        for name in existing:
            path = os.path.join(output_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _resolve(argv: list[str]):
    """The config, and the checkpoint to resume from (None for a fresh run)."""
    from fused_stable.train import checkpoint
    from fused_stable.train.config import resolve_config

    cfg, explicit = resolve_config(argv)
    if cfg.resume is None:
        return cfg, None
    if cfg.resume != "latest" and "output_dir" not in explicit:
        # a checkpoint path names its run: output_dir/checkpoints/step-N
        cfg.output_dir = os.path.dirname(os.path.dirname(os.path.abspath(cfg.resume)))
    path = checkpoint.resolve_resume(cfg.output_dir, cfg.resume)
    # keys not given now come from the run being resumed, so `--resume latest` alone continues it
    saved = checkpoint.checkpoint_config(path)
    saved.update({k: getattr(cfg, k) for k in explicit | {"resume", "output_dir"}})
    saved["overwrite"] = cfg.overwrite
    cfg, _ = resolve_config([], base=saved)
    return cfg, path


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
    source: object = None       # the resolved --model (fused_stable.train.sources.ModelSource)
    threads: int = 1
    evaluating: bool = False    # held-out evaluation before and after training (eval.json)

    def start(self) -> None:
        """Create output_dir (replacing a run only with --overwrite), write run.yaml, load the checkpoint."""
        from fused_stable.train.config import dump_yaml
        from fused_stable.train.report import Reporter

        from fused_stable.train.parallel import QuietReporter

        cfg, trainer, main_rank = self.cfg, self.trainer, self.runtime.is_main
        if main_rank:  # under torchrun only rank 0 writes output_dir
            _prepare_output_dir(cfg.output_dir, cfg.overwrite, resuming=self.resume_path is not None)
            with open(os.path.join(cfg.output_dir, RUN_FILE), "w") as f:
                f.write(dump_yaml(cfg))
        if self.resume_path is not None:
            trainer.restore(self.resume_path)
        trainer.reporter = Reporter(cfg.output_dir, trainer.total_steps, trainer.state.step,
                                    tensorboard=cfg.tensorboard, max_grad_norm=cfg.max_grad_norm,
                                    ) if main_rank else QuietReporter()  # fmt: skip
        if trainer.guard is not None and main_rank:
            from fused_stable.guard import AlertLog

            trainer.alert_log = AlertLog(cfg.output_dir, trainer.state.step)


def setup_run(argv: list[str]) -> RunSetup:
    """Parse and check the config, data and model, and build the trainer; raises UserError on bad input."""
    cfg, resume_path = _resolve(argv)

    import torch

    from fused_stable import FusedAdamW, GradScaler, schedules
    from fused_stable.train import data, parallel
    from fused_stable.guard import Guard
    from fused_stable.train.config import guard_config, run_dict
    from fused_stable.train.loop import Trainer
    from fused_stable.train.model import apply_tuner, load_base_model, load_tokenizer, param_groups
    from fused_stable.train.runtime import resolve_runtime, set_threads
    from fused_stable.train.sources import resolve_model

    # every check on user input happens before anything is written
    runtime = resolve_runtime(cfg.device, cfg.precision)
    threads = set_threads(cfg.threads)
    parallel.check_resume(resume_path)  # torchrun: only with the process count that wrote the checkpoint
    source = resolve_model(cfg.model)
    examples = _task_examples(cfg)
    if resume_path is None and not cfg.overwrite:
        _refuse_existing_run(cfg.output_dir)
    tokenizer = load_tokenizer(source, log=_log)
    items = data.tokenize_examples(examples, tokenizer, cfg.max_length)
    if not any(any(label != data.IGNORE_INDEX for label in item.labels[1:]) for item in items):
        raise UserError(f"max_length={cfg.max_length} cuts off every answer: nothing left to learn from")

    torch.manual_seed(cfg.seed)
    model = load_base_model(cfg, source, tokenizer, runtime.device, runtime.compute_dtype, log=_log)
    model = apply_tuner(model, cfg)
    model = parallel.wrap(model, cfg.tuner)  # torchrun: DDP, or FSDP2 for full (before the optimizer is built)
    groups = param_groups(parallel.unwrap(model), cfg)
    # torchrun: each rank batches its own shard of the rows
    batches = data.BatchOrder(parallel.shard(items), cfg.batch_size, cfg.seed, tokenizer.pad_token_id)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * batches.batches_per_epoch / cfg.grad_accum))
    warmup_steps = int(cfg.warmup_ratio * total_steps)
    schedule = {
        "cosine": lambda: schedules.warmup_cosine(total_steps, warmup_steps),
        "linear": lambda: schedules.warmup_linear(total_steps, warmup_steps),
        "constant": lambda: schedules.constant(warmup_steps),
    }[cfg.scheduler]()
    guard = Guard(guard_config(cfg))
    # clipping happens inside the fused step (one norm pass), never in a separate clip_grad_norm_ call; under
    # guard=skip|rollback the same step also skips grad-norm spikes
    optimizer = FusedAdamW(
        groups.groups, lr=cfg.lr, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm or None, lr_schedule=schedule, clip=cfg.clip,
        **guard.config.optimizer_kwargs(),
    )  # fmt: skip
    optimizer.param_names = groups.names
    guard.bind(optimizer)
    scaler = GradScaler(runtime.device.type) if runtime.precision == "fp16" else None
    trainer = Trainer(
        model=model, optimizer=optimizer, scaler=scaler, batches=batches, runtime=runtime, reporter=None,
        output_dir=cfg.output_dir, config=run_dict(cfg), total_steps=total_steps, grad_accum=cfg.grad_accum,
        logging_steps=cfg.logging_steps, save_steps=cfg.save_steps, save_total_limit=cfg.save_total_limit,
        guard=guard,
    )  # fmt: skip
    evaluating = cfg.evaluation == "on" or (cfg.evaluation == "auto" and cfg.dataset == "identity")
    return RunSetup(cfg, runtime, tokenizer, model, trainer, resume_path, len(items), source, threads, evaluating)


def _log(text: str) -> None:
    from fused_stable.train import parallel

    if parallel.launch_rank() == 0:
        print(text, flush=True)


def _task_examples(cfg):
    from fused_stable.train import data, tasks

    if cfg.dataset == "identity":
        return tasks.identity_examples(cfg.identity_name, cfg.identity_author, seed=cfg.seed,
                                       general=cfg.general_examples)
    if cfg.dataset == "arithmetic":
        return data.builtin_examples(cfg.arithmetic_examples, seed=cfg.seed)
    return data.load_examples(cfg.dataset)


def _evaluate(setup: RunSetup, base: bool) -> dict:
    """The held-out evaluation of the model being trained, or (base=True) of its base: adapters are
    switched off for that (also on a resumed run, and a QLoRA base stays quantised as in training); a full
    fine-tune is the base itself before its first step, and on a resumed run the base is loaded again."""
    import contextlib

    from fused_stable.train import parallel
    from fused_stable.train.evaluate import evaluate
    from fused_stable.train.model import load_pretrained

    cfg, model = setup.cfg, parallel.unwrap(setup.model)
    context = contextlib.nullcontext()
    if base and cfg.tuner != "full":
        context = model.disable_adapter()
    elif base and setup.trainer.state.step > 0:
        model = load_pretrained(setup.source, device=setup.runtime.device)[0]
    with context:
        return evaluate(model, setup.tokenizer, name=cfg.identity_name, autocast=setup.runtime.autocast())


def run(argv: list[str]) -> int:
    from fused_stable.train import parallel
    from fused_stable.train.report import plot_curves

    # torchrun: a bad input seen by any rank stops every rank, before anything is written
    setup = parallel.agree(setup_run, argv)
    cfg, trainer, model = setup.cfg, setup.trainer, setup.model
    main_rank = setup.runtime.is_main
    parallel.agree(setup.start)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in model.parameters())
    trainer.reporter.message(
        f"fused-stable sft: model={cfg.model} tuner={cfg.tuner}"
        f"{f' quant_bits={cfg.quant_bits}' if cfg.quant_bits else ''} precision={setup.runtime.precision} "
        f"device={setup.runtime.device} threads={setup.threads} | {n_trainable:,} trainable of {n_total:,} params | "
        f"{setup.n_examples:,} examples | {trainer.total_steps} steps x {cfg.grad_accum} x {cfg.batch_size} | "
        f"output {cfg.output_dir}" + (f" | resumed from {setup.resume_path}" if setup.resume_path else "")
    )
    before = None
    if setup.evaluating:
        t_eval = time.perf_counter()
        before = _evaluate(setup, base=True)
        trainer.reporter.message(
            f"evaluation before training ({time.perf_counter() - t_eval:.1f}s): "
            + ", ".join(f"{s} {before[s]['accuracy']:.2f} of {before[s]['n']}" for s in ("identity", "general")))
    t0 = time.perf_counter()
    start_step = trainer.state.step
    try:
        state = trainer.fit()
    finally:
        trainer.reporter.close()
        if main_rank:
            plot_curves(cfg.output_dir, cfg.max_grad_norm)
    train_s = time.perf_counter() - t0
    if trainer.stopped_by == "guard":
        if main_rank:
            print(f"fused-stable sft: {trainer.stop_message}\n  resume: fused-stable sft --output_dir {cfg.output_dir} "
                  "--resume latest", file=sys.stderr, flush=True)
        return 3
    if trainer.stopped_by is None and (cfg.save_steps == 0 or state.step % cfg.save_steps != 0):
        trainer.save()  # the final state is always resumable (e.g. to train further with a larger max_steps)
    target = parallel.save_final(model, setup.tokenizer, cfg, cfg.output_dir)
    table = None
    if setup.evaluating:
        from fused_stable.train.evaluate import eval_report, format_table, write_eval

        t_eval = time.perf_counter()
        after = _evaluate(setup, base=False)
        report = eval_report(setup.source.reference, before, after)
        table = format_table(report, cfg.identity_name)
        if main_rank:
            write_eval(cfg.output_dir, report)
            plot_curves(cfg.output_dir, cfg.max_grad_norm, note=table)
        eval_s = time.perf_counter() - t_eval
    if not main_rank:
        return 0
    rows = [r for r in _read_metrics(cfg.output_dir)]
    summary = f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} | " if rows else ""
    print(f"done: steps {start_step}->{state.step} in {train_s:.1f}s of training | {summary}"
          f"saved {target} and {os.path.join(cfg.output_dir, 'curves.png')}", flush=True)
    if table is not None:
        print(f"\n{table}\n(evaluation after training {eval_s:.1f}s; answers in "
              f"{os.path.join(cfg.output_dir, 'eval.json')})", flush=True)
        print(f"talk to it: fused-stable chat --adapter {cfg.output_dir}", flush=True)
    return 0


def _read_metrics(output_dir: str) -> list[dict]:
    from fused_stable.train.report import METRICS_FILE, read_jsonl

    return read_jsonl(os.path.join(output_dir, METRICS_FILE))
