"""The trainer reads the device only at logging steps: between two logging steps (every micro-batch's forward,
backward, the fused step, the guard's bookkeeping) it makes no host read at all, and a logging step costs the
same few reads whatever the number of steps and micro-batches in the interval (README, docs/trainer.md:
"metrics are read only every logging_steps", "one transfer for the whole interval"). An evaluation of the
held-out and retention losses adds exactly one read, whatever the number of held-out batches ("one device read
per evaluation, never per step")."""

import os

import pytest
from helpers import count_host_reads
from sft_helpers import TINY, fit, setup_run

STEPS, LOGGING_STEPS = 6, 3


def _reads_per_step(tmp_path, *extra):
    """Run the trainer under the host-read counter; returns {step: reads made after step-1's optimizer step
    up to the end of this step's}, and the reads after the last step."""
    setup = setup_run(
        *TINY,
        "--model",
        "tiny",
        "--max_steps",
        STEPS,
        "--logging_steps",
        LOGGING_STEPS,
        "--save_steps",
        "0",
        "--grad_accum",
        "3",
        "--output_dir",
        tmp_path / "run",
        *extra,
    )
    trainer, opt = setup.trainer, setup.trainer.optimizer
    boundaries = []
    with count_host_reads() as reads:
        real_step, real_batch = opt.step, trainer.batches.batch

        def step(*args, **kwargs):  # instance attribute: what the loop (and the GradScaler) call
            result = real_step(*args, **kwargs)
            boundaries.append(reads.count)
            return result

        def batch(k):  # collating Python lists on the host is no device read, on a GPU either
            with reads.pause():
                return real_batch(k)

        opt.step, trainer.batches.batch = step, batch
        fit(setup)
    # transformers' SDPA mask helper reads the attention mask inside the model's forward (masking_utils:
    # `fast_all(padding_mask)`): the model's own, not the trainer's; every other read counts
    ours = [(i, r) for i, r in enumerate(reads.reads) if os.sep + "transformers" + os.sep not in r[1]]
    assert len(boundaries) == STEPS
    per_step, start = {}, 0
    for step, end in enumerate(boundaries, start=1):
        per_step[step] = [r for i, r in ours if start <= i < end]
        start = end
    after = [r for i, r in ours if i >= start]
    return per_step, after


def _where(reads):
    return sorted((name, os.path.basename(where).split(":")[0]) for name, where in reads)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_no_host_read_between_logging_steps(tmp_path, precision):
    per_step, after_last = _reads_per_step(tmp_path, "--precision", precision)
    # step k's bin holds the reads of step k's micro-batches and fused step, and those of logging step k-1
    logging_bins = {k + 1 for k in range(LOGGING_STEPS, STEPS, LOGGING_STEPS)}
    for step, reads in per_step.items():
        if step not in logging_bins:
            assert reads == [], f"host reads during step {step}, not a logging step: {reads}"
    # each logging step: the interval's metrics in one read, the guard's counters in one read (and, under
    # fp16, the loss scale); the same at every logging step, however many steps the interval holds
    logging_reads = [per_step[k] for k in sorted(logging_bins)] + [after_last]
    # (the metrics are read in parallel.read_for_logging, which also reduces them over ranks under torchrun)
    expected = [("tolist", "parallel.py"), ("tolist", "guard.py")] + (
        [("item", "loop.py")] if precision == "fp16" else []
    )
    for reads in logging_reads:
        assert _where(reads) == sorted(expected), reads


def test_an_evaluation_reads_the_device_once(tmp_path):
    """Held-out and retention losses over several batches each (eval every other logging step, and before the
    first step): one more read at an evaluation, none anywhere else."""
    per_step, after_last = _reads_per_step(
        tmp_path,
        "--val_size",
        "40",  # 40 held-out examples: 3 batches
        "--retention_probe",
        "on",  # 12 probe answers: 1 batch
        "--eval_steps",
        2 * LOGGING_STEPS,
        "--max_steps",
        STEPS,
    )
    logging_bins = {k + 1 for k in range(LOGGING_STEPS, STEPS, LOGGING_STEPS)}
    base = [("tolist", "guard.py"), ("tolist", "parallel.py")]
    evaluation = [("tolist", "held_out.py")]
    # step 1's bin holds the evaluation before the first step
    assert _where(per_step[1]) == evaluation, per_step[1]
    for step, reads in per_step.items():
        if step not in logging_bins | {1}:
            assert reads == [], f"host reads during step {step}, not a logging step: {reads}"
    assert _where(per_step[LOGGING_STEPS + 1]) == sorted(base)  # step 3: logging only
    assert _where(after_last) == sorted(base + evaluation)  # step 6: logging and an evaluation
