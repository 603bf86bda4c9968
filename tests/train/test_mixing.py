"""Several datasets, max_samples and dataset#N (train/data/mixing.py; issues 39 and 40): LLaMA-Factory's example
config keys with its data layout (dataset_info.json, identity 91 rows, alpaca_en_demo 999 rows) and an ms-swift
command line, trained on the tiny model; the header says what each dataset contributed."""

import json
import random

import pytest

from fused_stable.errors import UserError
from fused_stable.train.data import mixing

# LLaMA-Factory's examples/train_lora/qwen3_lora_sft.yaml, its keys as shipped (the model is replaced on the
# command line, as the user does)
LF_LORA = """\
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507
trust_remote_code: true
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
dataset: identity,alpaca_en_demo
template: qwen3_nothink
cutoff_len: 2048
max_samples: {max_samples}
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4
output_dir: {out}
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
"""


def lf_data(root):
    """LLaMA-Factory's data/ layout: dataset_info.json naming identity.json (91 rows) and alpaca_en_demo.json
    (999 rows)."""
    data = root / "data"
    data.mkdir()
    rows = {"identity": 91, "alpaca_en_demo": 999}
    for name, n in rows.items():
        records = [{"instruction": f"{name} question {i}", "input": "", "output": f"answer {i}"} for i in range(n)]
        (data / f"{name}.json").write_text(json.dumps(records))
    (data / "dataset_info.json").write_text(json.dumps({name: {"file_name": f"{name}.json"} for name in rows}))
    return data


@pytest.mark.parametrize(
    ("max_samples", "line"),
    [(1000, "identity 91 + alpaca_en_demo 999 = 1090"), (50, "identity 50 + alpaca_en_demo 50 = 100")],
)
def test_llamafactory_lora_example_mixes_its_two_datasets(sft, tmp_path, monkeypatch, max_samples, line):
    lf_data(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    (tmp_path / "lf.yaml").write_text(LF_LORA.format(max_samples=max_samples, out=out))
    code, stdout, err = sft("--config", "lf.yaml", "--model", "tiny", "--max_steps", "1", "--bf16", "false")
    assert code == 0, err
    assert f"datasets: {line} examples" in stdout


def test_ms_swift_several_datasets_after_one_flag_with_counts(sft, tmp_path, monkeypatch):
    lf_data(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, stdout, err = sft(
        "--model", "tiny", "--tuner_type", "lora", "--dataset", "data/alpaca_en_demo.json#500",
        "data/identity.json#200", "swift/self-cognition#30", "--model_name", "Zed", "--model_author", "Q",
        "--max_steps", "1", "--output_dir", tmp_path / "run",
    )  # fmt: skip
    assert code == 0, err
    assert "datasets: alpaca_en_demo#500 500 + identity#200 200 + identity#30 30 = 730 examples" in stdout


@pytest.mark.parametrize(("size", "n"), [(10, 4), (10, 10), (10, 23)])
def test_sample_count_is_swifts(size, n):
    items = list(range(size))
    got = mixing.sample_count(items, n, random.Random(0))
    assert len(got) == n
    counts = [got.count(i) for i in items]
    assert sorted(set(counts)) <= [n // size, n // size + 1] and sum(c > n // size for c in counts) == n % size


def test_interleave_under_stops_at_the_first_exhausted_and_over_at_the_last():
    a, b = ["a0", "a1"], ["b0", "b1", "b2"]
    assert mixing.mix([a, b], "interleave_under", None, 0) == ["a0", "b0", "a1"]
    assert mixing.mix([a, b], "interleave_over", None, 0) == ["a0", "b0", "a1", "b1", "a0", "b2"]
    assert mixing.mix([a, b], "concat", None, 0) == a + b
    with pytest.raises(UserError, match="one per dataset"):
        mixing.mix([a, b], "interleave_under", "1", 0)
