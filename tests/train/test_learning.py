"""The loss falls on the embedded task (tiny Llama + byte tokenizer + built-in instructions)."""

import pytest
from sft_helpers import read_metrics


@pytest.mark.slow  # ~45 s on a loaded 2-core machine, ~15-25 s on a quiet one
def test_loss_decreases_on_builtin_task(sft, tmp_path):
    out = tmp_path / "learn"
    # a shorter schedule than the default run's 400 steps, so a higher lr (LoRA+ on the B matrices)
    code, _, err = sft(
        "--output_dir",
        out,
        "--model",
        "tiny",
        "--dataset",
        "arithmetic",
        "--arithmetic_examples",
        "2000",
        "--max_steps",
        "60",
        "--grad_accum",
        "2",
        "--lr",
        "1e-3",
        "--loraplus_lr_ratio",
        "4",
        "--logging_steps",
        "20",
        "--save_steps",
        "0",
        "--tensorboard",
        "false",
    )
    assert code == 0, err
    losses = [r["loss"] for r in read_metrics(out)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert not any(r["skipped"] for r in read_metrics(out))
