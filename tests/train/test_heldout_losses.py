"""Held-out and retention losses during training (docs/trainer.md, "Evaluation during training"): `--val_size`
splits the data set, `eval_loss` is the training loss's own definition on the held-out examples, measured
before the first step and every `--eval_steps` steps (an evaluation step is a logging step; under rollback also
every checkpoint step), written on the metrics row of that step, to TensorBoard (`eval/loss`), curves.png and
the final summary; the retention probe's `retention_loss` is the loss on the base model's own greedy answers.
The tiny model keeps it fast."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import count_host_reads
from sft_helpers import TINY, fit, read_metrics, setup_run

from fused_stable.errors import UserError
from fused_stable.train.config.keys import EVAL_EVERY_LOGS
from fused_stable.train.data import instructions, tasks
from fused_stable.train.evaluation.held_out import HeldOutLosses, retention_items, split_examples
from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model

# the tiny run with 16 of its 64 examples held out, evaluated every 4 steps (logging every 2)
HELD_OUT = [*TINY, "--val_size", "16", "--eval_steps", "4", "--max_steps", "8", "--save_steps", "0"]


def _run(tmp_path, *extra, name="run"):
    setup = setup_run(*HELD_OUT, "--output_dir", tmp_path / name, *extra)
    fit(setup)
    return setup, read_metrics(tmp_path / name)


@pytest.mark.parametrize("val_size, held", [(0.25, 16), (0.26, 17), (10, 10), (1, 1)])
def test_val_size_is_a_fraction_rounded_up_or_a_count(val_size, held):
    examples = list(range(64))
    train, heldout = split_examples(examples, val_size, seed=3)
    assert len(heldout) == held and len(train) == 64 - held
    assert sorted(train + heldout) == examples  # a split: nothing lost, nothing in both
    assert train == sorted(train)  # the rest keeps its order (the batch order shuffles it)
    assert split_examples(examples, val_size, seed=3) == (train, heldout)  # seeded


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--val_size", "1.5"], "val_size must be a fraction below 1 or a whole count"),
        (["--val_size", "-0.1"], "val_size must be"),
        (["--val_size", "64"], "holds out 64 of the data set's 64 examples: nothing is left to train on"),
        (["--val_size", "0.1", "--dataset", "identity"], "val_size does not apply to dataset=identity"),
        (["--eval_steps", "-1"], "eval_steps"),
        (["--retention_probe", "maybe"], "retention_probe must be one of auto | on | off"),
        (["--guard_eval_rise", "1"], "guard_eval_rise must be > 1 (or 0 to disable)"),
    ],
)
def test_bad_evaluation_keys_are_one_line_errors(sft, tmp_path, argv, message):
    code, _, err = sft(*TINY, "--output_dir", tmp_path / "run", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def _training_loss(model, items, pad_id):
    """The loop's loss definition, written out: summed cross-entropy over every label token / their count."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for item in items:
            b = instructions.collate([item], pad_id)
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            labels = b.labels[:, 1:].reshape(-1)
            total += F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels, reduction="sum").item()
            tokens += int((labels != instructions.IGNORE_INDEX).sum())
    return total / tokens


@pytest.mark.parametrize("keep_logits", [True, False])
def test_eval_loss_is_the_training_loss_on_the_held_out_set_read_once(keep_logits):
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(tokenizer).train()
    items = instructions.tokenize_examples(instructions.builtin_examples(20, seed=5), tokenizer, 96)
    losses = HeldOutLosses(
        {"eval_loss": items[:12], "retention_loss": items[12:]},
        pad_id=tokenizer.pad_token_id,
        device="cpu",
        keep_logits=keep_logits,
        batch_size=5,  # several batches of different widths
    )
    with count_host_reads() as reads:
        values = losses.measure(model)
    # summed on the device, one read (transformers' own mask helper reads the padding mask inside the model's
    # forward, as in training: tests/train/test_loop_host_reads.py)
    ours = [(name, where) for name, where in reads.reads if os.sep + "transformers" + os.sep not in where]
    assert [(name, os.path.basename(where).split(":")[0]) for name, where in ours] == [("tolist", "held_out.py")]
    assert model.training  # measured in eval mode (no dropout), handed back in training mode
    model.eval()
    assert values["eval_loss"] == pytest.approx(_training_loss(model, items[:12], tokenizer.pad_token_id), rel=1e-5)
    assert values["retention_loss"] == pytest.approx(
        _training_loss(model, items[12:], tokenizer.pad_token_id), rel=1e-5
    )
    assert losses.tokens["eval_loss"] == sum(
        sum(lab != instructions.IGNORE_INDEX for lab in it.labels[1:]) for it in items[:12]
    )


def test_sft_measures_eval_loss_on_its_schedule(tmp_path):
    setup, rows = _run(tmp_path, "--tensorboard", "true", "--save_steps", "8")
    trainer = setup.trainer
    assert trainer.eval_steps == 4 and trainer.evaluator.names == ["eval_loss"]  # tiny: no retention probe (auto)
    assert [r["step"] for r in rows if "eval_loss" in r] == [4, 8]
    assert all("retention_loss" not in r for r in rows)
    # the last row's value is the final model's held-out loss (the model has not changed since)
    assert rows[-1]["eval_loss"] == pytest.approx(trainer.evaluator.measure(setup.model)["eval_loss"], rel=1e-6)
    assert trainer.evaluations == 2 and trainer.eval_seconds > 0
    # before the first step: the guard's reference, kept in the checkpoints
    start = trainer.state.eval_start["eval_loss"]
    assert math.isfinite(start) and trainer.guard.best_eval["eval_loss"] == min(
        start, rows[3]["eval_loss"], rows[7]["eval_loss"]
    )
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-8" / "trainer_state.json").read_text())
    assert state["eval_start"] == {"eval_loss": start} and state["guard"]["best_eval"] == trainer.guard.best_eval
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("eval/loss")] == [
        (0, round(start, 5)),
        (4, round(rows[3]["eval_loss"], 5)),
        (8, round(rows[7]["eval_loss"], 5)),
    ]


def test_the_held_out_examples_are_not_trained_on(tmp_path):
    setup = setup_run(*HELD_OUT, "--output_dir", tmp_path / "run")
    trained = [item.input_ids for item in setup.trainer.batches.items]
    train, heldout = split_examples(instructions.builtin_examples(64, seed=42), 16, seed=42)
    assert trained == [i.input_ids for i in instructions.tokenize_examples(train, setup.tokenizer, 96)]
    assert len(trained) == 48 and setup.trainer.evaluator.examples["eval_loss"] == 16
    measured = [
        tuple(ids[: int(mask.sum())].tolist())  # right-padded: the row's own tokens first
        for b in setup.trainer.evaluator.batches["eval_loss"]
        for ids, mask in zip(b.input_ids, b.attention_mask)
    ]
    heldout_ids = [tuple(i.input_ids) for i in instructions.tokenize_examples(heldout, setup.tokenizer, 96)]
    assert sorted(measured) == sorted(heldout_ids)  # what eval_loss measures is exactly the held-out set


def test_the_command_prints_the_evaluations_and_draws_them(sft, tmp_path):
    code, out, err = sft(*HELD_OUT, "--output_dir", tmp_path / "run")
    assert code == 0, err
    assert "evaluation every 4 steps: eval_loss on 16 held-out examples" in out
    assert "evaluation at step 0 (" in out and "evaluation at step 8 (" in out
    rows = read_metrics(tmp_path / "run")
    summary = next(line for line in out.splitlines() if line.startswith("eval_loss "))
    assert f"-> {rows[-1]['eval_loss']:.4f} (step 8)" in summary and "3 evaluations" in summary
    assert "evaluations during training: 2 in" in out
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0


def test_eval_steps_default_and_off(tmp_path):
    base = [*TINY, "--val_size", "16", "--output_dir", tmp_path / "run"]
    assert setup_run(*base, "--logging_steps", "3").trainer.eval_steps == EVAL_EVERY_LOGS * 3
    assert setup_run(*base, "--eval_steps", "0").trainer.evaluator is None
    assert setup_run(*TINY, "--output_dir", tmp_path / "run").trainer.evaluator is None  # nothing held out


def test_an_evaluation_step_is_a_logging_step_and_rollback_evaluates_every_checkpoint(tmp_path):
    _, rows = _run(tmp_path, "--eval_steps", "3", "--logging_steps", "4", name="odd")
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    # under rollback every checkpoint is a rollback target: written after its evaluation passed
    _, rows = _run(tmp_path, "--eval_steps", "4", "--save_steps", "3", "--guard", "rollback", name="rollback")
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 4, 6, 8]
    _, rows = _run(tmp_path, "--eval_steps", "4", "--save_steps", "3", "--guard", "warn", name="warn")
    assert [r["step"] for r in rows if "eval_loss" in r] == [4, 8]


def test_retention_loss_is_the_loss_on_the_base_models_own_answers(tmp_path):
    setup = setup_run(
        *TINY,
        "--dataset",
        "identity",
        "--retention_probe",
        "on",
        "--eval_steps",
        "2",
        "--max_steps",
        "2",
        "--output_dir",
        tmp_path / "run",
    )
    assert setup.trainer.evaluator.names == ["eval_loss", "retention_loss"]
    fit(setup)
    # independently: the untouched tiny Llama's greedy answers to the probe's prompts, and its loss on them
    tokenizer = build_byte_tokenizer()
    base = build_tiny_model(tokenizer)
    probe = retention_items(base, tokenizer, tasks.retention_prompts(), max_length=96)
    assert len(probe) == len(tasks.retention_prompts())
    expected = _training_loss(base.eval(), probe, tokenizer.pad_token_id)
    assert setup.trainer.state.eval_start["retention_loss"] == pytest.approx(expected, rel=1e-5)
    # the identity task's own held-out set: its evaluation paraphrases
    assert setup.trainer.evaluator.examples == {"eval_loss": 12, "retention_loss": len(probe)}
    assert "retention_loss" in read_metrics(tmp_path / "run")[-1]


def test_the_probe_follows_its_key(tmp_path):
    identity = [*TINY, "--dataset", "identity", "--output_dir", tmp_path / "run"]
    assert setup_run(*identity).trainer.evaluator.names == ["eval_loss"]  # auto: off for the scratch tiny model
    assert setup_run(*identity, "--retention_probe", "off").trainer.evaluator.names == ["eval_loss"]
    with_probe = setup_run(*TINY, "--retention_probe", "on", "--output_dir", tmp_path / "run").trainer.evaluator
    assert with_probe.names == ["retention_loss"]  # any data set: it needs nothing from the user


def test_a_resumed_run_keeps_its_reference_and_bests(sft, tmp_path):
    out = tmp_path / "run"
    assert sft(*HELD_OUT, "--save_steps", "4", "--output_dir", out)[0] == 0
    first = read_metrics(out)
    start = json.loads((out / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    code, stdout, err = sft("--output_dir", out, "--resume", str(out / "checkpoints" / "step-4"))
    assert code == 0, err
    assert "evaluation at step 0" not in stdout  # the reference comes from the checkpoint
    again = read_metrics(out)
    assert [r.get("eval_loss") for r in again] == [r.get("eval_loss") for r in first]  # bit for bit on CPU
    end = json.loads((out / "checkpoints" / "step-8" / "trainer_state.json").read_text())
    assert end["eval_start"] == start["eval_start"]


def test_a_set_whose_answers_are_all_cut_off_is_not_measured():
    tokenizer = build_byte_tokenizer()
    item = instructions.TokenizedExample([1, 2, 3], [instructions.IGNORE_INDEX] * 3)
    losses = HeldOutLosses({"eval_loss": [item]}, pad_id=tokenizer.pad_token_id, device="cpu")
    assert losses.names == []
    with pytest.raises(UserError):
        split_examples([1, 2], 2, seed=0)
