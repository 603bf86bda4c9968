"""Several datasets, max_samples and dataset#N (train/data/mixing.py; issues 39 and 40): LLaMA-Factory's example
config keys with its data layout (dataset_info.json, identity 91 rows, alpaca_en_demo 999 rows) and an ms-swift
command line, trained on the tiny model; the header says what each dataset contributed."""

import random

import pytest
from test_llamafactory_examples import LORA, lf_layout

from fused_stable.errors import UserError
from fused_stable.train.data import mixing


def lf_data(root):
    """LLaMA-Factory's data/ layout (tests/train/test_llamafactory_examples.py): dataset_info.json naming
    identity.json (91 rows) and alpaca_en_demo.json (999 rows), and LF's example files beside it."""
    lf_layout(root)
    return root / "data"


def test_llamafactory_lora_example_cut_by_max_samples(sft, tmp_path, monkeypatch):
    """LF's qwen3_lora_sft.yaml as it ships (its max_samples 1000 keeps both whole: the 1090 of
    test_llamafactory_examples.py); --max_samples 50 cuts each dataset to its first 50."""
    lf_data(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lf.yaml").write_text(LORA)
    code, stdout, err = sft("--config", "lf.yaml", "--model", "tiny", "--max_steps", "1", "--max_samples", "50")
    assert code == 0, err
    assert "datasets: identity 50 + alpaca_en_demo 50 = 100 examples (max_samples 50" in stdout


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
    # one dataset (an eval_dataset of one beside two training datasets): nothing to mix, the probabilities unused
    assert mixing.mix([b], "interleave_under", "0.5,0.5", 0) == b
    with pytest.raises(UserError, match="one per dataset"):
        mixing.mix([a, b], "interleave_under", "1", 0)


def test_interleave_probs_under_concat_is_refused_in_one_line(sft, tmp_path):
    """concat takes every example of each dataset once: probabilities given with it would be ignored silently
    (LLaMA-Factory's DataArguments refuses them: "`interleave_probs` is only valid for interleaved mixing")."""
    two = ("--model", "tiny", "--dataset", "arithmetic,identity", "--output_dir", tmp_path / "run")
    code, _, err = sft(*two, "--interleave_probs", "0.3,0.7")  # mix_strategy's default: concat
    assert code == 2 and err.count("\n") == 1, err
    assert "interleave_probs 0.3,0.7 applies to mix_strategy interleave_under or interleave_over" in err
    assert not (tmp_path / "run").exists()
    code, _, err = sft(*two, "--interleave_probs", "0.3,0.7", "--mix_strategy", "concat")
    assert code == 2 and "applies to mix_strategy interleave_under" in err
