"""`fused-stable sft`: parse the config, check every input before writing anything, build the model,
data and optimizer, train, and save. User mistakes end with one line on stderr and exit code 2, with nothing
written; an existing folder is replaced only if it is a run, and only its own entries (`outputs`); SIGINT and
SIGTERM end with a checkpoint and the command that continues the run (exit code 130 / 143). On the identity
task the model is evaluated before and after training (`evaluate`, eval.json).
"""

from __future__ import annotations

import errno
import math
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field

from fused_stable.cli import offline_environment
from fused_stable.errors import UserError

RUN_FILE = "run.yaml"


def evaluating(cfg) -> bool:
    """Whether the run evaluates its model before and after training (eval.json)."""
    return cfg.evaluation == "on" or (cfg.evaluation == "auto" and cfg.dataset == "identity")


def run_entries(cfg) -> list[str]:
    """The top-level entries of output_dir that a run with this config creates: claimed in its manifest
    (outputs.claim) before they are created, and exactly what a later --overwrite removes."""
    from fused_stable.train.evaluate import EVAL_FILE

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
    offline_environment()  # before anything imports transformers
    if any(a in ("-h", "--help") for a in argv):
        from fused_stable.train.keys import help_text

        if os.environ.get("RANK", "0") == "0":  # under torchrun: once, from rank 0
            print(help_text())
        return 0
    _quiet_third_party_noise()
    from fused_stable.train import parallel
    from fused_stable.train.loop import Interrupts

    # SIGINT / SIGTERM: at once while nothing is written; once training, after a checkpoint (see Interrupts)
    code = None
    with Interrupts(announce=parallel.launch_rank() == 0) as interrupts:
        try:
            with parallel.process_group():  # under torchrun: join the other ranks; nothing in a single process
                try:
                    code = run(argv, interrupts)
                except UserError as exc:
                    parallel.report_error(f"fused-stable sft: error: {exc}")  # rank 0 prints; every rank exits 2
                    code = 2
        except UserError as exc:  # torchrun's environment is incomplete: there is no process group to join
            if parallel.launch_rank() == 0:
                print(f"fused-stable sft: error: {exc}", file=sys.stderr)
            code = 2
        except KeyboardInterrupt:
            if code is None:  # before the run started writing (after that, `run` reports it): nothing written
                if parallel.launch_rank() == 0:
                    print("fused-stable sft: interrupted before training started; nothing was written", file=sys.stderr)
                code = interrupts.exit_code
    return code


def continue_command(output_dir: str, world_size: int) -> str:
    """The exact command that continues the run in output_dir."""
    launcher = (
        f"torchrun --standalone --nproc-per-node {world_size} -m fused_stable sft"
        if world_size > 1
        else "fused-stable sft"
    )
    return f"{launcher} --output_dir {shlex.quote(output_dir)} --resume latest"


def _no_usable_checkpoint(problem: str, output_dir: str) -> str:
    """What `--resume latest` found when no checkpoint verifies, and what to do, without deleting any."""
    from fused_stable.train import checkpoint

    found = checkpoint.list_checkpoints(output_dir, include_incomplete=True)
    if not found:
        return f"{problem}; the run never saved one: start it again with --overwrite (without --resume)"
    names = ", ".join(os.path.basename(path) for _, path in found[-4:])
    return (
        f"{problem}; the run saved {len(found)} ({names}) and none verifies: to keep them, start the run again in "
        "another output_dir (--overwrite here would delete them)"
    )


def _resolve(argv: list[str]):
    """The config, the checkpoint to resume from (None for a fresh run), and the damaged or incomplete
    checkpoints `resume latest` passed over (one line each)."""
    from fused_stable.train import checkpoint, outputs
    from fused_stable.train.config import resolve_config, same_state_value
    from fused_stable.train.keys import STATE_KEYS

    cfg, explicit = resolve_config(argv, log=_log)
    if cfg.resume is None:
        return cfg, None, []
    if cfg.resume != "latest" and "output_dir" not in explicit:
        # a checkpoint path names its run: output_dir/checkpoints/step-N
        cfg.output_dir = os.path.dirname(os.path.dirname(os.path.abspath(cfg.resume)))
    try:
        path, passed_over = checkpoint.resolve_resume(cfg.output_dir, cfg.resume)
    except UserError as exc:
        if cfg.resume == "latest" and outputs.read_manifest(cfg.output_dir) is not None:
            raise UserError(_no_usable_checkpoint(str(exc), cfg.output_dir)) from None
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
    cfg, _ = resolve_config([], base=saved)
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
    source: object = None  # the resolved --model (fused_stable.train.sources.ModelSource)
    threads: int = 1
    evaluating: bool = False  # held-out evaluation before and after training (eval.json)
    lock: object = None  # rank 0's outputs.FolderLock on output_dir, held from `start` until `release`

    def start(self) -> None:
        """(Rank 0) lock output_dir; load the checkpoint to resume; then (rank 0) replace the previous run if
        --overwrite, claim the run's entries in its manifest and write run.yaml. The checkpoint is loaded
        first, so a start that fails leaves output_dir exactly as it was (and unlocked)."""
        from fused_stable.train import checkpoint, outputs
        from fused_stable.train.config import dump_yaml, run_dict
        from fused_stable.train.parallel import QuietReporter
        from fused_stable.train.report import AlertLog, Reporter

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
                    _log(f"fused-stable sft: note: {line}")
                outputs.claim(cfg.output_dir, run_entries(cfg))
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


def setup_run(argv: list[str]) -> RunSetup:
    """Parse and check the config, data and model, and build the trainer; raises UserError on bad input."""
    from fused_stable.train import checkpoint, outputs

    cfg, resume_path, passed_over = _resolve(argv)
    # the output folder before anything heavy: writable, and new, empty or (with --overwrite) only a run's
    outputs.check_output_dir(
        cfg.output_dir,
        overwrite=cfg.overwrite,
        resume_path=resume_path,
        has_checkpoint=checkpoint.latest_checkpoint(cfg.output_dir) is not None,
    )

    import torch

    from fused_stable import FusedAdamW, GradScaler, schedules
    from fused_stable.guard import Guard
    from fused_stable.train import data, parallel
    from fused_stable.train.config import guard_config, run_dict, warmup_steps
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
    tokenizer = load_tokenizer(source, log=_log)
    # an example whose answer max_length cuts off entirely is skipped (counted in a note)
    items = data.fit_to_length(data.tokenize_examples(examples, tokenizer, cfg.max_length), cfg.max_length, log=_log)

    torch.manual_seed(cfg.seed)
    model = load_base_model(cfg, source, tokenizer, runtime.device, runtime.compute_dtype, log=_log)
    model = apply_tuner(model, cfg)
    model = parallel.wrap(model, cfg.tuner)  # torchrun: DDP, or FSDP2 for full (before the optimizer is built)
    groups = param_groups(parallel.unwrap(model), cfg)
    # torchrun: each rank batches its own shard of the rows
    batches = data.BatchOrder(parallel.shard(items), cfg.batch_size, cfg.seed, tokenizer.pad_token_id)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * batches.batches_per_epoch / cfg.grad_accum))
    warmup = warmup_steps(cfg, total_steps)
    schedule = {
        "cosine": lambda: schedules.warmup_cosine(total_steps, warmup),
        "linear": lambda: schedules.warmup_linear(total_steps, warmup),
        "constant": lambda: schedules.constant(warmup),
    }[cfg.scheduler]()
    guard = Guard(guard_config(cfg))
    # clipping happens inside the fused step (one norm pass), never in a separate clip_grad_norm_ call; under
    # guard=skip|rollback the same step also skips grad-norm spikes
    optimizer = FusedAdamW(
        groups.groups,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm or None,
        lr_schedule=schedule,
        clip=cfg.clip,
        **guard.config.optimizer_kwargs(),
    )
    optimizer.param_names = groups.names
    guard.bind(optimizer)
    scaler = GradScaler(runtime.device.type) if runtime.precision == "fp16" else None
    trainer = Trainer(
        model=model,
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
    )
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
    )


def _log(text: str) -> None:
    from fused_stable.train import parallel

    if parallel.launch_rank() == 0:
        print(text, flush=True)


def _task_examples(cfg):
    from fused_stable.train import data, tasks

    if cfg.dataset == "identity":
        return tasks.identity_examples(
            cfg.identity_name, cfg.identity_author, seed=cfg.seed, general=cfg.general_examples
        )
    if cfg.dataset == "arithmetic":
        return data.builtin_examples(cfg.arithmetic_examples, seed=cfg.seed)
    return data.load_examples(cfg.dataset, log=_log)


def _evaluate(setup: RunSetup, base: bool) -> dict:
    """The held-out evaluation of the model being trained, or (base=True) of its base. The base is evaluated
    before `start` restores a checkpoint: a full fine-tune's model is then still the base, and adapters are
    switched off (also on a resumed run; a QLoRA base stays quantised as in training)."""
    import contextlib

    from fused_stable.train import parallel
    from fused_stable.train.evaluate import evaluate

    cfg, model = setup.cfg, parallel.unwrap(setup.model)
    context = model.disable_adapter() if base and cfg.tuner != "full" else contextlib.nullcontext()
    with context:
        return evaluate(model, setup.tokenizer, name=cfg.identity_name, autocast=setup.runtime.autocast())


def run(argv: list[str], interrupts=None) -> int:
    from fused_stable.train import parallel
    from fused_stable.train.loop import Interrupts

    interrupts = interrupts if interrupts is not None else Interrupts(announce=False)
    # torchrun: a bad input seen by any rank stops every rank, before anything is written
    setup = parallel.agree(setup_run, argv)
    try:
        return _train(setup, interrupts)
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        _report_failure(setup, f"{NO_SPACE[exc.errno]}: {_what_failed(exc, setup.cfg.output_dir)}", "free space, then ")
        return FAILED
    except Exception as exc:
        if not parallel.lost_another_rank(exc, interrupts.signum):
            raise
        _report_failure(setup, f"rank {parallel.rank()}: {parallel.describe_lost_rank(exc)}", every_rank=True)
        return FAILED
    finally:
        setup.release()  # the folder's lock: another run may write it now


# the run could not go on for a reason outside it (exit code 1): the disk or quota filled up, or under torchrun
# another rank died; the newest complete checkpoint is intact and the message says how to continue
FAILED = 1
NO_SPACE = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file-size limit was reached",
}


def _what_failed(exc: OSError, output_dir: str) -> str:
    from fused_stable.train.checkpoint import SaveFailed

    if isinstance(exc, SaveFailed):
        return f"saving {exc.checkpoint} failed ({exc.strerror}) and left nothing behind"
    where = exc.filename or f"the files of {output_dir}"
    return f"writing {where} failed ({exc.strerror})"


def _report_failure(setup: RunSetup, why: str, before_continuing: str = "", every_rank: bool = False) -> None:
    """One line: why the run stopped, the newest complete checkpoint (read back, not assumed) and how to continue."""
    from fused_stable.train import checkpoint

    if not (every_rank or setup.runtime.is_main):
        return
    newest, _ = checkpoint.latest_verified_checkpoint(setup.cfg.output_dir)
    where = (
        f"the newest complete checkpoint, {newest}, is intact; {before_continuing}continue: "
        f"{continue_command(setup.cfg.output_dir, setup.runtime.world_size)}"
        if newest
        else "the run has no complete checkpoint (start it again with --overwrite)"
    )
    print(f"fused-stable sft: error: {why}; {where}", file=sys.stderr, flush=True)


def _train(setup: RunSetup, interrupts) -> int:
    from fused_stable.train import parallel
    from fused_stable.train.report import plot_curves, read_metrics

    cfg, trainer, model = setup.cfg, setup.trainer, setup.model
    main_rank = setup.runtime.is_main
    before = None
    if setup.evaluating:  # before anything is written: an interrupt here leaves output_dir untouched
        t_eval = time.perf_counter()
        before = _evaluate(setup, base=True)
        _log(
            f"evaluation before training ({time.perf_counter() - t_eval:.1f}s): "
            + ", ".join(f"{s} {before[s]['accuracy']:.2f} of {before[s]['n']}" for s in ("identity", "general"))
        )
    trainer.interrupts = interrupts
    interrupts.deferring = True  # from here on files are written: an interrupt ends with a checkpoint
    try:
        parallel.agree(setup.start)
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_total = sum(p.numel() for p in model.parameters())
        if main_rank:
            for reason in setup.passed_over:
                print(f"fused-stable sft: resume latest passed over a damaged checkpoint: {reason}", file=sys.stderr)
        trainer.reporter.message(
            f"fused-stable sft: model={cfg.model} tuner={cfg.tuner}"
            f"{f' quant_bits={cfg.quant_bits}' if cfg.quant_bits else ''} precision={setup.runtime.precision} "
            f"device={setup.runtime.device} threads={setup.threads} | "
            f"{n_trainable:,} trainable of {n_total:,} params | "
            f"{setup.n_examples:,} examples | {trainer.total_steps} steps x {cfg.grad_accum} x {cfg.batch_size} | "
            f"output {cfg.output_dir}" + (f" | resumed from {setup.resume_path}" if setup.resume_path else "")
        )
        t0 = time.perf_counter()
        start_step = trainer.state.step
        try:
            state = trainer.fit()
        except BaseException:
            _close_outputs(trainer, cfg, main_rank, failing=True)
            raise
        _close_outputs(trainer, cfg, main_rank)
        train_s = time.perf_counter() - t0
        resume = continue_command(cfg.output_dir, setup.runtime.world_size)
        if trainer.stopped_by == "interrupt":
            if main_rank:
                name = signal.Signals(interrupts.signum).name
                print(
                    f"fused-stable sft: interrupted by {name} after step {state.step} of {trainer.total_steps}; "
                    f"checkpoint saved: {trainer.last_checkpoint}\n  continue: {resume}",
                    file=sys.stderr,
                    flush=True,
                )
            parallel.barrier()  # torchrun ends the other ranks as soon as one exits: let rank 0 finish first
            return interrupts.exit_code
        if trainer.stopped_by == "guard":
            if main_rank:
                print(f"fused-stable sft: {trainer.stop_message}\n  resume: {resume}", file=sys.stderr, flush=True)
            parallel.barrier()
            return 3
        if trainer.stopped_by is None and (cfg.save_steps == 0 or state.step % cfg.save_steps != 0):
            trainer.save()  # the final state is always resumable (e.g. to train further with a larger max_steps)
        target = parallel.save_final(model, setup.tokenizer, cfg, cfg.output_dir)
    except KeyboardInterrupt:  # a second signal: the save (or the step) under way was abandoned
        if main_rank:
            _report_abandoned(cfg.output_dir, setup.runtime.world_size)
        return interrupts.exit_code
    table = None
    if setup.evaluating:
        from fused_stable.train.evaluate import eval_report, format_table, write_eval

        interrupts.deferring = False  # the run is saved: an interrupt now only skips eval.json
        try:
            t_eval = time.perf_counter()
            after = _evaluate(setup, base=False)
        except KeyboardInterrupt:
            if main_rank:
                print(
                    f"fused-stable sft: interrupted during the evaluation after training: the run is complete "
                    f"({target}), only {os.path.join(cfg.output_dir, 'eval.json')} was not written",
                    file=sys.stderr,
                    flush=True,
                )
            return interrupts.exit_code
        report = eval_report(setup.source.reference, before, after)
        table = format_table(report, cfg.identity_name)
        if main_rank:
            write_eval(cfg.output_dir, report)
            plot_curves(cfg.output_dir, cfg.max_grad_norm, note=table)
        eval_s = time.perf_counter() - t_eval
    if not main_rank:
        return 0
    rows = read_metrics(cfg.output_dir)
    summary = f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} | " if rows else ""
    print(
        f"done: steps {start_step}->{state.step} in {train_s:.1f}s of training | {summary}"
        f"saved {target} and {os.path.join(cfg.output_dir, 'curves.png')}",
        flush=True,
    )
    if table is not None:
        print(
            f"\n{table}\n(evaluation after training {eval_s:.1f}s; answers in "
            f"{os.path.join(cfg.output_dir, 'eval.json')})",
            flush=True,
        )
        print(f"talk to it: fused-stable chat --adapter {cfg.output_dir}", flush=True)
    return 0


def _close_outputs(trainer, cfg, main_rank: bool, failing: bool = False) -> None:
    """Flush metrics.jsonl and draw curves.png, also when the run is `failing`: a write that fails then (a full
    disk) must not replace the error under way, which is reported in its place; otherwise it is a note."""
    from fused_stable.train.report import plot_curves

    try:
        trainer.reporter.close()
        if main_rank:
            plot_curves(cfg.output_dir, cfg.max_grad_norm)
    except OSError as exc:
        if not failing:
            print(f"fused-stable sft: note: could not finish the run's curves and metrics ({exc})", file=sys.stderr)


def _report_abandoned(output_dir: str, world_size: int) -> None:
    """After a second interrupt: what is on disk now (read back, not assumed)."""
    from fused_stable.train import checkpoint

    newest, _ = checkpoint.latest_verified_checkpoint(output_dir)
    if newest is None:
        print(
            "fused-stable sft: interrupted again: stopped at once; the run has no complete checkpoint "
            "(start it again with --overwrite)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"fused-stable sft: interrupted again: stopped at once; the newest complete checkpoint is "
            f"{newest}\n  continue: {continue_command(output_dir, world_size)}",
            file=sys.stderr,
            flush=True,
        )
