"""`fused-stable sft`: parse the config, check every input before writing anything, build the model,
data and optimizer (`setup`), train, and save. User mistakes end with one line on stderr and exit code 2, with
nothing written; an existing folder is replaced only if it is a run, and only its own entries (`outputs`);
SIGINT and SIGTERM end with a checkpoint and the command that continues the run (exit code 130 / 143). On the
identity task the model is evaluated before and after training (`evaluate_run`, eval.json); during training the
held-out and retention losses are measured on the loop's evaluation schedule (`held_out_losses`).

Imports of torch and the trainer's heavier rooms are inside the functions: `--help` and a bad input end before
any of them loads.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from fused_stable.cli import offline_environment
from fused_stable.errors import UserError
from fused_stable.train.evaluation.run_evaluations import evaluate_run
from fused_stable.train.run import stop_message
from fused_stable.train.run.setup import RunSetup, muon_split_text, optimizer_state_text, print_rank0, setup_run


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
    """The run after its set-up: the evaluation before, the folder claimed, training, the final save, the
    evaluation after and the summary. Returns the exit code."""
    before = _evaluate_before(setup) if setup.evaluating else None
    setup.trainer.interrupts = interrupts
    interrupts.deferring = True  # from here on files are written: an interrupt ends with a checkpoint
    try:
        outcome = _train_and_save(setup, interrupts)
    except KeyboardInterrupt:  # a second signal: the save (or the step) under way was abandoned
        if setup.runtime.is_main:
            stop_message.report_abandoned(setup.cfg.output_dir, setup.runtime.world_size)
        return interrupts.exit_code
    if isinstance(outcome, int):  # stopped early: by an interrupt or by the guard
        return outcome
    table = eval_s = None
    if setup.evaluating:
        interrupts.deferring = False  # the run is saved: an interrupt now only skips eval.json
        try:
            table, eval_s = _evaluate_after(setup, before)
        except KeyboardInterrupt:
            if setup.runtime.is_main:
                print(
                    f"fused-stable sft: interrupted during the evaluation after training: the run is complete "
                    f"({outcome.target}), only {os.path.join(setup.cfg.output_dir, 'eval.json')} was not written",
                    file=sys.stderr,
                    flush=True,
                )
            return interrupts.exit_code
    if setup.runtime.is_main:
        _print_summary(setup, outcome, table, eval_s)
    return 0


def _evaluate_before(setup: RunSetup) -> dict:
    """The base model's before-training evaluation: before anything is written, so an interrupt here leaves
    output_dir untouched."""
    t_eval = time.perf_counter()
    before = evaluate_run(setup, base=True)
    print_rank0(
        f"evaluation before training ({time.perf_counter() - t_eval:.1f}s): "
        + ", ".join(f"{s} {before[s]['accuracy']:.2f} of {before[s]['n']}" for s in ("identity", "general"))
    )
    return before


class _Trained:
    """What a finished fit leaves for the rest of the command."""

    def __init__(self, start_step: int, state, train_s: float, target: str):
        self.start_step, self.state, self.train_s, self.target = start_step, state, train_s, target


def _train_and_save(setup: RunSetup, interrupts):
    """Claim the folder, announce the run, fit, and save the final adapter or model. Returns a `_Trained`, or
    the exit code of a run stopped early (its checkpoint saved and the command that continues it printed)."""
    import torch

    from fused_stable.train.run import parallel

    cfg, trainer, main_rank = setup.cfg, setup.trainer, setup.runtime.is_main
    parallel.agree(setup.start)
    _announce(setup, trainer.engine.numel if trainer.engine is not None else torch.numel)  # ZeRO-3: partitioned
    t0 = time.perf_counter()
    start_step = trainer.state.step
    try:
        state = trainer.fit()
    except BaseException:
        _close_outputs(trainer, cfg, main_rank, failing=True)
        raise
    _close_outputs(trainer, cfg, main_rank)
    train_s = time.perf_counter() - t0
    if trainer.stopped_by in ("interrupt", "guard"):
        return _stopped_early(setup, state, interrupts)
    if trainer.stopped_by is None and (cfg.save_steps == 0 or state.step % cfg.save_steps != 0):
        trainer.save()  # the final state is always resumable (e.g. to train further with a larger max_steps)
    # DeepSpeed: at ZeRO-3 gathered from every rank's partitions
    save_final = trainer.engine.save_final if trainer.engine is not None else parallel.save_final
    target = save_final(setup.model, setup.tokenizer, cfg, cfg.output_dir)
    return _Trained(start_step, state, train_s, target)


def _announce(setup: RunSetup, numel) -> None:
    """The run's header line (model, tuner, precision, sizes, steps, output), the checkpoints `resume latest`
    passed over, the run's system message (`--system`) and the evaluation schedule; then the held-out losses
    before the first step."""
    cfg, trainer, model = setup.cfg, setup.trainer, setup.model
    n_trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    n_total = sum(numel(p) for p in model.parameters())
    if setup.runtime.is_main:
        for reason in setup.passed_over:
            print(f"fused-stable sft: resume latest passed over a damaged checkpoint: {reason}", file=sys.stderr)
    trainer.reporter.message(
        f"fused-stable sft: model={cfg.model} tuner={cfg.tuner}"
        f"{f' quant_bits={cfg.quant_bits}' if cfg.quant_bits else ''} precision={setup.runtime.precision} "
        f"device={setup.runtime.device} threads={setup.threads} | "
        f"{n_trainable:,} trainable of {n_total:,} params | "
        f"optim={cfg.optim} ({type(trainer.optimizer).__name__}) optimizer state {optimizer_state_text(trainer)} | "
        f"{setup.n_examples:,} examples | {trainer.total_steps} steps x {cfg.grad_accum} x {cfg.batch_size} | "
        f"output {cfg.output_dir}" + (f" | resumed from {setup.resume_path}" if setup.resume_path else "")
    )
    split = muon_split_text(trainer, cfg.muon_lora)
    if split is not None:
        trainer.reporter.message(f"optim muon: {split}")
    if cfg.system is not None:
        trainer.reporter.message(
            f"system: {cfg.system!r} (given to the {setup.given_system:,} training and held-out examples without "
            "their own; stored with the run for chat)"
        )
    if trainer.evaluator is not None:
        trainer.reporter.message(
            f"evaluation every {trainer.eval_steps} steps: {trainer.evaluator.describe()}"
            if trainer.eval_steps
            else f"evaluation at checkpoints: {trainer.evaluator.describe()}"
        )
        trainer.evaluate_start()  # before the first step (a fresh run): the guard's reference


def _stopped_early(setup: RunSetup, state, interrupts) -> int:
    """An interrupt (exit 130 / 143) or the guard (exit 3) stopped the run after its checkpoint: say so, with the
    command that continues it."""
    from fused_stable.train.run import parallel

    trainer, main_rank = setup.trainer, setup.runtime.is_main
    resume = stop_message.continue_command(setup.cfg.output_dir, setup.runtime.world_size)
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
    if main_rank:
        print(f"fused-stable sft: {trainer.stop_message}\n  resume: {resume}", file=sys.stderr, flush=True)
    parallel.barrier()
    return 3


def _evaluate_after(setup: RunSetup, before: dict) -> tuple[str, float]:
    """The trained model's evaluation beside the base model's: eval.json and the curves with the table (rank 0).
    Returns the table and the evaluation's seconds."""
    from fused_stable.train.evaluation.before_after import eval_report, format_table, write_eval
    from fused_stable.train.run.report import plot_curves

    cfg = setup.cfg
    t_eval = time.perf_counter()
    after = evaluate_run(setup, base=False)
    report = eval_report(setup.source.reference, before, after)
    table = format_table(report, cfg.identity_name)
    if setup.runtime.is_main:
        write_eval(cfg.output_dir, report)
        plot_curves(cfg.output_dir, cfg.max_grad_norm, note=table, eval_start=setup.trainer.state.eval_start)
    return table, time.perf_counter() - t_eval


def _print_summary(setup: RunSetup, trained: _Trained, table: str | None, eval_s: float | None) -> None:
    """Rank 0's last lines: the steps, losses and saved files; the evaluations during training; the table."""
    from fused_stable.train.run.report import evaluation_summary, read_metrics

    cfg, trainer = setup.cfg, setup.trainer
    rows = read_metrics(cfg.output_dir)
    summary = f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} | " if rows else ""
    print(
        f"done: steps {trained.start_step}->{trained.state.step} in {trained.train_s:.1f}s of training | {summary}"
        f"saved {trained.target} and {os.path.join(cfg.output_dir, 'curves.png')}",
        flush=True,
    )
    evaluated = evaluation_summary(rows, trainer.state.eval_start)
    if evaluated:
        share = f" ({100 * trainer.eval_seconds / trained.train_s:.1f}% of it)" if trained.train_s > 0 else ""
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
