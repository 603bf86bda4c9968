"""`--state_precision` in sft: the optimizer stores its moments in that format, the run header and
run_manifest.json say how large the state is, and checkpoints hold the compact state and resume bit for bit."""

import os

import pytest
import torch
from sft_helpers import TINY, Crash, crash_at, fit, read_metrics, setup_run

from fused_stable.train.run import checkpoint, outputs

# full fine-tuning of the tiny model: its matrices are >= 4096 elements, so 8-bit codes are on the path
RUN = ["--model", "tiny", *TINY, "--tuner", "full", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1"]


@pytest.mark.slow  # two short runs of the tiny model
def test_8bit_state_is_reported_checkpointed_compact_and_resumes_bit_for_bit(sft, tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    code, out, err = sft(*RUN, "--state_precision", "8bit", "--output_dir", straight)
    assert code == 0, err
    setup = setup_run(*RUN, "--state_precision", "8bit", "--output_dir", tmp_path / "probe")
    opt = setup.trainer.optimizer
    assert all(group["state_precision"] == "8bit" for group in opt.param_groups)
    mib = round(opt.state_bytes() / 2**20, 3)
    assert f"optimizer state 8bit {mib:.1f} MiB" in out
    assert outputs.read_manifest(str(straight))["optimizer_state"] == {"precision": "8bit", "mib": mib}
    saved = torch.load(straight / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    codes = [e for e in saved["state"].values() if e["exp_avg"].dtype == torch.int8]
    assert codes and all(e["exp_avg_sq"].dtype == torch.uint8 and "exp_avg_sq_scale" in e for e in codes)

    setup = setup_run(*RUN, "--state_precision", "8bit", "--output_dir", broken)
    setup.trainer.callbacks.append(crash_at(3))  # after the step-2 checkpoint
    with pytest.raises(Crash):
        fit(setup)
    assert checkpoint.latest_checkpoint(broken).endswith("step-2")
    code, _, err = sft("--output_dir", broken, "--resume", "latest")
    assert code == 0, err
    a, b = read_metrics(straight), read_metrics(broken)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # exact floats
    oa = torch.load(straight / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    ob = torch.load(broken / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    for key, state in oa["state"].items():
        for k, v in state.items():
            assert torch.equal(v, ob["state"][key][k]), (key, k)
    assert os.path.isdir(broken / "checkpoints" / "step-4")


def test_state_precision_is_a_checked_key(sft, tmp_path):
    code, _, err = sft(*RUN, "--state_precision", "int4", "--output_dir", tmp_path / "run")
    assert code == 2 and "state_precision" in err and "8bit" in err


@pytest.mark.slow  # two short runs of the tiny model
@pytest.mark.parametrize(
    ("saved", "resumed", "moment_dtype"), [("fp32", "8bit", torch.int8), ("8bit", "fp32", torch.float32)]
)
def test_a_run_resumes_in_another_state_precision(sft, tmp_path, saved, resumed, moment_dtype):
    """A checkpoint saved with one state_precision resumes with another (issue 36 item 5): the header says the
    state is converted once as it loads, the run continues from the checkpoint's weights (the first loss after
    the resume is the uninterrupted run's, exactly), and its next checkpoint holds the new format. The
    conversion itself is FusedAdamW.load_state_dict's (tests/core/test_lowbit.py)."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    code, _, err = sft(*RUN, "--state_precision", saved, "--output_dir", straight)
    assert code == 0, err
    setup = setup_run(*RUN, "--state_precision", saved, "--output_dir", broken)
    setup.trainer.callbacks.append(crash_at(3))  # after the step-2 checkpoint
    with pytest.raises(Crash):
        fit(setup)
    code, out, err = sft("--output_dir", broken, "--resume", "latest", "--state_precision", resumed)
    assert code == 0, err
    assert f"its {saved} optimizer state is converted to {resumed} once, as it loads" in out
    assert f"optimizer state {resumed} " in out
    a, b = read_metrics(straight), read_metrics(broken)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a[:3]] == [r["loss"] for r in b[:3]]  # step 3's loss: the step-2 weights
    if saved == "8bit":  # decoding is exact: step 3's update is the one the 8-bit run computed up to the params'
        # last bit (the compiled 8-bit op takes the exact reference's step scalars, the fp32 op its own fp64 ones:
        # ~3% of the params an ulp apart after one step, in code format v1 as in v2), so step 4's loss too, up to
        # its last bits (measured: equal in v1, 8e-8 relative in v2)
        assert abs(b[3]["loss"] - a[3]["loss"]) <= 1e-6 * abs(a[3]["loss"])
    else:  # quantised once: measured 2.2e-6 relative at step 4 (the fp32 -> 8-bit rounding of two moments)
        assert b[3]["loss"] != a[3]["loss"] and abs(b[3]["loss"] - a[3]["loss"]) <= 1e-5 * abs(a[3]["loss"])
    state = torch.load(broken / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    assert {g["state_precision"] for g in state["param_groups"]} == {resumed}
    moments = [e["exp_avg"].dtype for e in state["state"].values() if e["exp_avg"].numel() >= 4096]
    assert moments and set(moments) == {moment_dtype}


@pytest.mark.parametrize("tuner", ["lora", "full"])
def test_the_header_says_how_many_tensors_and_params_each_state_format_holds(sft, tmp_path, tuner):
    """state_precision 8bit keeps tensors under 4096 elements in fp32 (bitsandbytes' rule): every tensor of the
    tiny model's LoRA adapter, the norms of its full model. The header counts them from the model's own
    trainable tensors; a run whose tensors all have the precision's format says nothing more."""
    plain = [*TINY, "--tuner", tuner, "--max_steps", "1"]
    argv = [*plain, "--state_precision", "8bit"]
    trainable = [
        p.numel() for p in setup_run(*argv, "--output_dir", tmp_path / "probe").model.parameters() if p.requires_grad
    ]
    small, large = [n for n in trainable if n < 4096], [n for n in trainable if n >= 4096]
    code, out, err = sft(*argv, "--output_dir", tmp_path / "run")
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("fused-stable sft: model=tiny"))
    fp32 = f"fp32: {len(small)} tensors under 4,096 elements, {sum(small):,} params"
    if tuner == "lora":
        assert not large and f" MiB ({fp32}) |" in header
    else:
        assert small and large and f" MiB (8bit: {len(large)} tensors, {sum(large):,} params; {fp32}) |" in header
    code, out, err = sft(*plain, "--output_dir", tmp_path / "fp32")
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("fused-stable sft: model=tiny"))
    assert "optimizer state fp32 " in header and "tensors" not in header
