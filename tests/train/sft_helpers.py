"""Helpers for the trainer tests: tiny, fast CLI arguments, metrics reading, in-process runs."""

import os
import time

import pytest

from fused_stable.train.run import sft

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a few optimizer steps of the tiny scratch Llama on a small slice of the arithmetic task (the default model
# is the pretrained smollm2-135m: these keep the suite fast), with the recipe these tests were written for
TINY = [
    "--model",
    "tiny",
    "--dataset",
    "arithmetic",
    "--arithmetic_examples",
    "64",
    "--lr",
    "2e-4",
    "--target_modules",
    "q_proj,v_proj",
    "--lora_dropout",
    "0.05",
    "--batch_size",
    "4",
    "--grad_accum",
    "2",
    "--max_steps",
    "4",
    "--logging_steps",
    "2",
    "--save_steps",
    "2",
    "--tensorboard",
    "false",
    "--max_length",
    "96",
]


def read_metrics(output_dir):
    """metrics.jsonl as the package reads it back (non-finite numbers as floats)."""
    from fused_stable.train.run.report import read_metrics as read

    return read(str(output_dir))


def setup_run(*argv):
    """Build a run in-process (config, model, trainer) without starting it, for tests that look inside."""
    return sft.setup_run([str(a) for a in argv])


def fit(setup):
    """Start and train an in-process run; then let go of its folder's lock, as the command does at its end (or
    the kernel, when a process dies), so that a later run in the same folder is not refused as a second writer."""
    setup.start()
    try:
        return setup.trainer.fit()
    finally:
        setup.trainer.reporter.close()
        setup.release()


def wait_for(condition, proc, what, timeout=240):
    """Poll `condition` until it holds while `proc` (a Popen) runs; fail with its output if it ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended (code {proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


class Crash(Exception):
    """A simulated crash inside a run (raised by a `crash_at` trainer callback)."""


def crash_at(step_to_crash):
    """A trainer callback that raises Crash after optimizer step `step_to_crash`."""

    def callback(step, optimizer, metrics):
        if step == step_to_crash:
            raise Crash(f"simulated crash at step {step}")

    return callback


def optimizer_state_difference(a, b, where: str = "state") -> str | None:
    """Where two saved optimizer states (optimizer.pt, loaded) first differ, or None when they hold the same: every
    tensor equal in dtype, shape and bits (8-bit codes and their scales included), every other value equal."""
    import torch

    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if same else where
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{where}: keys"
        return next((d for k in a if (d := optimizer_state_difference(a[k], b[k], f"{where}[{k!r}]"))), None)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return f"{where}: length"
        pairs = enumerate(zip(a, b))
        return next((d for i, (x, y) in pairs if (d := optimizer_state_difference(x, y, f"{where}[{i}]"))), None)
    return None if a == b else where
