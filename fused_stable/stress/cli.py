"""`fused-stable stress`: reproducible failure scenarios, each trained twice, on the embedded tiny Llama (the fast
default) or, with `--model smollm2-135m` (any `--model` that `sft` takes), on a pretrained model with LoRA.

The command checks its options, builds the workload once, runs every scenario (and `clean`, the reference) with
both recipes (`run_suite`), and writes the table on stdout, stress.json (after every run, so a suite cut short
keeps what it measured) and stress.png in --output-dir. That folder follows sft's and export's rules
(`fused_stable.train.run.outputs`): new or empty, or earlier stress results replaced only with `--overwrite` (only
the files an earlier `fused-stable stress` wrote there, named in its run_manifest.json), and locked while the
suite writes it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch

from fused_stable.argcheck import OneLineParser, number, parse_command, suggestion
from fused_stable.cli import offline_environment
from fused_stable.errors import UserError
from fused_stable.stress.report import format_table, judge, plot, write_json
from fused_stable.stress.runs import RECIPES, RULES, RunResult, Workload, build_workload, run_one
from fused_stable.stress.scenarios import REAL_MODEL_DEFAULTS, TINY_MIN_LENGTH, StressConfig, is_real, scenarios
from fused_stable.train.run import outputs

JSON_FILE, PNG_FILE = "stress.json", "stress.png"  # what a stress run creates in --output-dir (its manifest)


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
            if r.retention_loss_after is not None:
                knows += f"  eval loss {r.eval_loss_after:.3f}  retention loss {r.retention_loss_after:.3f}"
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
    "eval_rise": "the guarded recipe alerts when eval_loss or retention_loss exceeds this x its best so far (0: off)",
    "seed": "data order, the adapters' init and the tiny base model's training",
    "threads": "torch CPU threads (1 is fastest and steadiest on a shared 2-core machine)",
}
_RANGES.update(
    lr_multiplier=dict(low=1, high=1e6),
    poison_weight=dict(low=1, high=1e12),
    zscore_warmup=dict(low=1, high=100_000, integer=True),
    eval_rise=dict(low=0, high=1e6),
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
            "--state_precision": "--state-precision",
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
        "--optim",
        default="adamw",
        choices=list(RULES),
        help="the update rule of both recipes, as `fused-stable sft --optim`: adamw (usual: torch AdamW; guarded: "
        "FusedAdamW) | lion (lion-pytorch's Lion; FusedLion) | muon (torch Muon on the hidden matrices, a pretrained "
        "model's LoRA factors as --muon_lora, + torch AdamW on the rest; FusedMuon) | sgd (torch SGD, momentum "
        "0.9; FusedSGD, the same) | adafactor "
        "(torch Adafactor; FusedAdafactor) (default: adamw)",
    )
    p.add_argument(
        "--state-precision",
        default="fp32",
        choices=["fp32", "bf16", "8bit"],
        help="how the guarded recipe's optimizer stores its state, as `fused-stable sft --state_precision` "
        "(default: fp32)",
    )
    p.add_argument(
        "--scenarios", default="all", help=f"comma-separated subset of {', '.join(scenarios(tiny))} (default: all)"
    )
    p.add_argument(
        "--output-dir",
        default="runs/stress",
        help="where stress.json and stress.png go: a new or empty folder (default: runs/stress)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the stress results already in --output-dir (only the files fused-stable stress wrote there)",
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
    return StressConfig(model=args.model, optim=args.optim, state_precision=args.state_precision, **{**base, **given})


def main(argv: list[str]) -> int:
    """`fused-stable stress`; a bad option is one line on stderr and exit code 2, before anything is written."""
    offline_environment()  # before anything imports transformers
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
        if cfg.eval_rise and not cfg.eval_rise > 1:
            raise UserError(f"--eval-rise must be above 1 (or 0 to turn the alerts off), got {cfg.eval_rise:g}")
        _check_rule(cfg)
        if cfg.steps < 2 * cfg.log_every:
            raise UserError(f"--steps must be at least 2 x --log-every ({2 * cfg.log_every}), got {cfg.steps}")
        if is_real(cfg):
            from fused_stable.train.model.sources import resolve_model

            resolve_model(cfg.model)  # a model that cannot be found: one line, before anything is written
        # earlier results are replaced only with --overwrite; anything else in the folder is never touched
        outputs.check_output_dir(
            args.output_dir, overwrite=args.overwrite, command=outputs.STRESS, option="--output-dir"
        )
        lock = outputs.FolderLock(args.output_dir, outputs.STRESS)
        lock.acquire()  # FolderBusy if another command is writing the folder right now
    except UserError as exc:
        print(f"fused-stable stress: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.overwrite:
            outputs.remove_previous_run(args.output_dir)  # only what its manifest names (checked above)
        # stress.json.tmp too: a suite killed while writing stress.json leaves it, and --overwrite must remove it
        outputs.claim(args.output_dir, [JSON_FILE, JSON_FILE + ".tmp", PNG_FILE], command=outputs.STRESS)
        return _run(cfg, names, known, args.output_dir)
    finally:
        lock.release()


def _check_rule(cfg: StressConfig) -> None:
    """The rule with the suite's model and state, checked where sft checks it (`optimizers.RULES`, one place):
    the tiny model is a full fine-tune, a pretrained one LoRA."""
    from fused_stable.train.config.keys import TrainConfig
    from fused_stable.train.run import optimizers

    tuner = "lora" if is_real(cfg) else "full"
    muon_lora = cfg.optim == "muon" and tuner == "lora"  # a pretrained model's LoRA factors on Muon (runs.py)
    train = TrainConfig(optim=cfg.optim, tuner=tuner, state_precision=cfg.state_precision, muon_lora=muon_lora)
    optimizers.check_available(train, deepspeed=False)
    # what the rule's class refuses (e.g. Adafactor's factored moments in bf16), before anything is written: the
    # guarded optimizer built once over a stand-in of the suite's layers (an embedding, hidden matrices, a norm)
    stand_in = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    try:
        RULES[cfg.optim].fused(stand_in, cfg.lr, state_precision=cfg.state_precision)
    except ValueError as error:
        raise UserError(f"--optim {cfg.optim} --state-precision {cfg.state_precision}: {error}") from None


def _run(cfg: StressConfig, names: list[str], known: dict, output_dir: str) -> int:
    torch.set_num_threads(cfg.threads)
    what = (
        f"{cfg.model} with LoRA (r 8, all linear layers) on the identity task"
        if is_real(cfg)
        else "the embedded tiny Llama (full fine-tuning)"
    )
    rule = RULES[cfg.optim]
    print(
        f"fused-stable stress: {len(names)} scenario(s) x {RECIPES} ({rule.usual_name} | {rule.fused_name}) on "
        f"{what}, {cfg.steps} steps each, {cfg.threads} thread(s)",
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
    if work.start_losses is not None:
        shown = "  ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in work.start_losses.items())
        print(f"  start: {shown}  (held-out losses: {work.losses.describe()})", flush=True)
    json_path = os.path.join(output_dir, JSON_FILE)
    png_path = os.path.join(output_dir, PNG_FILE)

    def write(results: list[RunResult], finished: bool) -> None:
        write_json(json_path, cfg, known, results, work, time.perf_counter() - t0, finished)

    results = run_suite(
        cfg,
        names,
        progress=lambda line: print(line, flush=True),
        work=work,
        on_result=lambda so_far: write(so_far, finished=False),
    )
    write(results, finished=True)
    print()
    print(format_table(results, work.before, work.start_losses))
    plot(results, png_path, usual=rule.usual_name, guarded=rule.fused_name)
    print(f"\nwrote {json_path} and {png_path} in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0
