"""Bad input: one line on stderr, exit code 2, no traceback, and nothing written."""
import os
import subprocess
import sys

import pytest

from sft_helpers import REPO_ROOT, TINY


def _assert_user_error(code, out, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fused-stable sft: error: ")
    assert "Traceback" not in err + out
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_model_path(sft, tmp_path):
    out = tmp_path / "out"
    _assert_user_error(*sft("--model", tmp_path / "no-such-model", "--output_dir", out), "no-such-model", "offline")
    assert not out.exists()


def test_malformed_dataset_line_names_file_and_line(sft, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": "d"}\n{"instruction": "e", "output": \n')
    out = tmp_path / "out"
    _assert_user_error(*sft("--model", "tiny", "--dataset", data, "--output_dir", out), f"{data}:3:", "invalid JSON")
    assert not out.exists()


def test_dataset_record_with_wrong_schema(sft, tmp_path):
    data = tmp_path / "data.json"
    data.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"question": "c"}\n]\n')
    _assert_user_error(*sft("--model", "tiny", "--dataset", data, "--output_dir", tmp_path / "out"), f"{data}:3:",
                       "alpaca")


def test_unknown_yaml_key_suggests_closest(sft, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lora_rank: 16\nlr: 1e-4\n")
    _assert_user_error(*sft("--config", config, "--output_dir", tmp_path / "out"), "lora_rank", "did you mean 'lora_r'")
    assert not (tmp_path / "out").exists()


def test_unknown_flag_suggests_closest(sft, tmp_path):
    _assert_user_error(*sft("--learning_rate", "1e-4"), "learning_rate")
    _assert_user_error(*sft("--grad_acum", "4"), "did you mean 'grad_accum'")


def test_output_dir_with_another_run_is_refused(sft, tmp_path):
    out = tmp_path / "out"
    assert sft(*TINY, "--max_steps", "1", "--output_dir", out)[0] == 0
    before = sorted(os.listdir(out))
    metrics = (out / "metrics.jsonl").read_text()
    _assert_user_error(*sft(*TINY, "--max_steps", "2", "--lr", "1e-3", "--output_dir", out), "already holds a run",
                       "--overwrite", "--resume")
    assert sorted(os.listdir(out)) == before and (out / "metrics.jsonl").read_text() == metrics
    code, _, err = sft(*TINY, "--max_steps", "2", "--output_dir", out, "--overwrite")
    assert code == 0, err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_quant_bits_with_full_finetuning(sft, tmp_path):
    _assert_user_error(*sft("--tuner", "full", "--quant_bits", "4", "--output_dir", tmp_path / "o"), "quant_bits", "full")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag,value,needle", [
    ("--lr", "-1e-4", "lr must be positive"),
    ("--precision", "fp8", "precision must be one of"),
    ("--batch_size", "two", "batch_size"),
    ("--warmup_ratio", "1.5", "warmup_ratio"),
    ("--resume", "latest", "no complete checkpoint"),
])
def test_bad_values(sft, tmp_path, flag, value, needle):
    out = tmp_path / "o"
    _assert_user_error(*sft(flag, value, "--output_dir", out), needle)
    assert not out.exists()


def test_real_process_exit_code_and_stderr(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fused_stable", "sft", "--lr", "-1", "--output_dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["fused-stable sft: error: lr must be positive, got -1.0"]


def test_help_lists_every_key_with_default(sft):
    from fused_stable.train.config import FIELDS

    code, out, _ = sft("--help")
    assert code == 0
    for name in FIELDS:
        assert f"--{name} " in out, name
    assert "(default: 0.001)" in out and "(default: all-linear)" in out and "(default: smollm2-135m)" in out
