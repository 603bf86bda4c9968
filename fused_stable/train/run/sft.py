"""`fused-stable sft`: parse the config, check every input before writing anything, build the model,
data and optimizer, train, and save. User mistakes end with one line on stderr and exit code 2, with nothing
written; an existing folder is replaced only if it is a run, and only its own entries (`outputs`); SIGINT and
SIGTERM end with a checkpoint and the command that continues the run (exit code 130 / 143). On the identity
task the model is evaluated before and after training (`evaluate`, eval.json); during training the held-out and
retention losses are measured on the loop's evaluation schedule (`_held_out_losses`).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from fused_stable.cli import offline_environment
from fused_stable.errors import UserError
from fused_stable.train.evaluation.run_evaluations import evaluate_run, held_out_losses
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


def main(argv: list[str]) -> int:
    offline_environment()  # before anything imports transformers
    if any(a in ("-h", "--help") for a in argv):
        from fused_stable.train.config.keys import help_text

        if os.environ.get("RANK", "0") == "0":  # under torchrun: once, from rank 0
            print(help_text())
        return 0
    from fused_stable.train.run import parallel
    from fused_stable.train.run.runtime import quiet_third_party_noise

    quiet_third_party_noise()
    from fused_stable.train.run.loop import Interrupts

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


def _resolve(argv: list[str]):
    """The config, the checkpoint to resume from (None for a fresh run), and the damaged or incomplete
    checkpoints `resume latest` passed over (one line each)."""
    from fused_stable.train.config.keys import STATE_KEYS
    from fused_stable.train.config.resolve import resolve_config, same_state_value
    from fused_stable.train.run import checkpoint, outputs

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
    source: object = None  # the resolved --model (fused_stable.train.model.sources.ModelSource)
    threads: int = 1
    evaluating: bool = False  # held-out evaluation before and after training (eval.json)
    lock: object = None  # rank 0's outputs.FolderLock on output_dir, held from `start` until `release`

    def start(self) -> None:
        """(Rank 0) lock output_dir; load the checkpoint to resume; then (rank 0) replace the previous run if
        --overwrite, claim the run's entries in its manifest and write run.yaml. The checkpoint is loaded
        first, so a start that fails leaves output_dir exactly as it was (and unlocked)."""
        from fused_stable.train.config.resolve import dump_yaml, run_dict
        from fused_stable.train.run import checkpoint, outputs
        from fused_stable.train.run.parallel import QuietReporter
        from fused_stable.train.run.report import AlertLog, Reporter

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
                outputs.claim(cfg.output_dir, run_entries(cfg), details={"optimizer_state": optimizer_state(trainer)})
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
    """What the run header and run_manifest.json say about the optimizer's state: its precision and size (this
    process's share under torchrun: FSDP2 shards the state with the params)."""
    opt = trainer.optimizer
    return {"precision": opt.defaults["state_precision"], "mib": round(opt.state_bytes() / 2**20, 3)}


def setup_run(argv: list[str]) -> RunSetup:
    """Parse and check the config, data and model, and build the trainer; raises UserError on bad input."""
    from fused_stable.train.run import checkpoint, outputs

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
    from fused_stable.train.config.resolve import eval_steps, guard_config, run_dict, warmup_steps
    from fused_stable.train.data import instructions
    from fused_stable.train.evaluation.held_out import held_out_split
    from fused_stable.train.model.adapters import apply_tuner, param_groups
    from fused_stable.train.model.load import load_base_model, load_tokenizer
    from fused_stable.train.model.sources import resolve_model
    from fused_stable.train.run import deepspeed_run, parallel
    from fused_stable.train.run.loop import Trainer
    from fused_stable.train.run.runtime import resolve_runtime, set_threads

    # every check on user input happens before anything is written
    runtime = resolve_runtime(cfg.device, cfg.precision)
    threads = set_threads(cfg.threads)
    parallel.check_resume(resume_path)  # torchrun: only with the process count that wrote the checkpoint
    deepspeed_run.check_run(
        cfg, resume_path, runtime.precision
    )  # DeepSpeed: what needs the process count and precision
    source = resolve_model(cfg.model)
    examples, heldout = held_out_split(cfg, _task_examples(cfg))
    tokenizer = load_tokenizer(source, log=_log)
    # an example whose answer max_length cuts off entirely is skipped (counted in a note)
    items = instructions.fit_to_length(
        instructions.tokenize_examples(examples, tokenizer, cfg.max_length), cfg.max_length, log=_log
    )

    torch.manual_seed(cfg.seed)
    model = load_base_model(cfg, source, tokenizer, runtime.device, runtime.compute_dtype, log=_log)
    model = apply_tuner(model, cfg)
    if not deepspeed_run.wanted(cfg):  # (DeepSpeed's engine does the data parallelism itself)
        model = parallel.wrap(model, cfg.tuner)  # torchrun: DDP, or FSDP2 for full (before the optimizer is built)
    groups = param_groups(parallel.unwrap(model), cfg)
    # torchrun: each rank batches its own shard of the rows
    batches = instructions.BatchOrder(parallel.shard(items), cfg.batch_size, cfg.seed, tokenizer.pad_token_id)
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
        state_precision=cfg.state_precision,
        **guard.config.optimizer_kwargs(),
    )
    optimizer.param_names = groups.names
    guard.bind(optimizer)
    scaler = GradScaler(runtime.device.type) if runtime.precision == "fp16" else None
    # DeepSpeed: FusedAdamW attached to the engine (one decision per engine step from the global norm)
    engine = deepspeed_run.start(model, optimizer, cfg, runtime) if deepspeed_run.wanted(cfg) else None
    trainer = Trainer(
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
    )
    trainer.evaluator = held_out_losses(cfg, model, tokenizer, heldout, runtime, log=_log)
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
    from fused_stable.train.run import parallel

    if parallel.launch_rank() == 0:
        print(text, flush=True)


def _task_examples(cfg):
    from fused_stable.train.data import instructions, tasks

    if cfg.dataset == "identity":
        return tasks.identity_examples(
            cfg.identity_name, cfg.identity_author, seed=cfg.seed, general=cfg.general_examples
        )
    if cfg.dataset == "arithmetic":
        return instructions.builtin_examples(cfg.arithmetic_examples, seed=cfg.seed)
    return instructions.load_examples(cfg.dataset, log=_log)


def run(argv: list[str], interrupts=None) -> int:
    from fused_stable.train.run import parallel
    from fused_stable.train.run.loop import Interrupts

    interrupts = interrupts if interrupts is not None else Interrupts(announce=False)
    # torchrun: a bad input seen by any rank stops every rank, before anything is written
    setup = parallel.agree(setup_run, argv)
    try:
        return _train(setup, interrupts)
    except OSError as exc:
        if exc.errno not in stop_message.NO_SPACE:
            raise
        why = f"{stop_message.NO_SPACE[exc.errno]}: {stop_message.what_failed(exc, setup.cfg.output_dir)}"
        stop_message.report_failure(setup, why, "free space, then ")
        return stop_message.FAILED
    except Exception as exc:
        if not parallel.lost_another_rank(exc, interrupts.signum):
            raise
        stop_message.report_failure(
            setup, f"rank {parallel.rank()}: {parallel.describe_lost_rank(exc)}", every_rank=True
        )
        return stop_message.FAILED
    finally:
        setup.release()  # the folder's lock: another run may write it now


def _train(setup: RunSetup, interrupts) -> int:
    import torch

    from fused_stable.train.run import parallel
    from fused_stable.train.run.report import evaluation_summary, plot_curves, read_metrics

    cfg, trainer, model = setup.cfg, setup.trainer, setup.model
    main_rank = setup.runtime.is_main
    before = None
    if setup.evaluating:  # before anything is written: an interrupt here leaves output_dir untouched
        t_eval = time.perf_counter()
        before = evaluate_run(setup, base=True)
        _log(
            f"evaluation before training ({time.perf_counter() - t_eval:.1f}s): "
            + ", ".join(f"{s} {before[s]['accuracy']:.2f} of {before[s]['n']}" for s in ("identity", "general"))
        )
    trainer.interrupts = interrupts
    interrupts.deferring = True  # from here on files are written: an interrupt ends with a checkpoint
    try:
        parallel.agree(setup.start)
        numel = trainer.engine.numel if trainer.engine is not None else torch.numel  # ZeRO-3: partitioned
        n_trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
        n_total = sum(numel(p) for p in model.parameters())
        if main_rank:
            for reason in setup.passed_over:
                print(f"fused-stable sft: resume latest passed over a damaged checkpoint: {reason}", file=sys.stderr)
        trainer.reporter.message(
            f"fused-stable sft: model={cfg.model} tuner={cfg.tuner}"
            f"{f' quant_bits={cfg.quant_bits}' if cfg.quant_bits else ''} precision={setup.runtime.precision} "
            f"device={setup.runtime.device} threads={setup.threads} | "
            f"{n_trainable:,} trainable of {n_total:,} params | "
            f"optimizer state {cfg.state_precision} {optimizer_state(trainer)['mib']:.1f} MiB | "
            f"{setup.n_examples:,} examples | {trainer.total_steps} steps x {cfg.grad_accum} x {cfg.batch_size} | "
            f"output {cfg.output_dir}" + (f" | resumed from {setup.resume_path}" if setup.resume_path else "")
        )
        if trainer.evaluator is not None:
            trainer.reporter.message(
                f"evaluation every {trainer.eval_steps} steps: {trainer.evaluator.describe()}"
                if trainer.eval_steps
                else f"evaluation at checkpoints: {trainer.evaluator.describe()}"
            )
            trainer.evaluate_start()  # before the first step (a fresh run): the guard's reference
        t0 = time.perf_counter()
        start_step = trainer.state.step
        try:
            state = trainer.fit()
        except BaseException:
            _close_outputs(trainer, cfg, main_rank, failing=True)
            raise
        _close_outputs(trainer, cfg, main_rank)
        train_s = time.perf_counter() - t0
        resume = stop_message.continue_command(cfg.output_dir, setup.runtime.world_size)
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
        # DeepSpeed: at ZeRO-3 gathered from every rank's partitions
        save_final = trainer.engine.save_final if trainer.engine is not None else parallel.save_final
        target = save_final(model, setup.tokenizer, cfg, cfg.output_dir)
    except KeyboardInterrupt:  # a second signal: the save (or the step) under way was abandoned
        if main_rank:
            stop_message.report_abandoned(cfg.output_dir, setup.runtime.world_size)
        return interrupts.exit_code
    table = None
    if setup.evaluating:
        from fused_stable.train.evaluation.before_after import eval_report, format_table, write_eval

        interrupts.deferring = False  # the run is saved: an interrupt now only skips eval.json
        try:
            t_eval = time.perf_counter()
            after = evaluate_run(setup, base=False)
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
            plot_curves(cfg.output_dir, cfg.max_grad_norm, note=table, eval_start=trainer.state.eval_start)
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
    evaluated = evaluation_summary(rows, trainer.state.eval_start)
    if evaluated:
        share = f" ({100 * trainer.eval_seconds / train_s:.1f}% of it)" if train_s > 0 else ""
        print(
            f"{evaluated}\n(evaluations during training: {trainer.evaluations} in {trainer.eval_seconds:.1f}s{share})",
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
    from fused_stable.train.run.report import plot_curves

    try:
        trainer.reporter.close()
        if main_rank:
            plot_curves(cfg.output_dir, cfg.max_grad_norm, eval_start=trainer.state.eval_start)
    except OSError as exc:
        if not failing:
            print(f"fused-stable sft: note: could not finish the run's curves and metrics ({exc})", file=sys.stderr)
