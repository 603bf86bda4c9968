"""Bad input: one line on stderr, exit code 2, no traceback, and nothing written (every option's bad values
are driven by tests/tools/test_cli_fuzz.py; these are the cases with a message worth pinning down)."""

import os
import shlex
import shutil
import subprocess
import sys

import pytest
from sft_helpers import REPO_ROOT, TINY

RUN = ["--model", "tiny", *TINY]


def _assert_user_error(code, out, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fused-stable sft: error: ")
    assert "Traceback" not in err + out
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_missing_model_path(sft, tmp_path):
    out = tmp_path / "out"
    _assert_user_error(*sft("--model", tmp_path / "no-such-model", "--output_dir", out), "no-such-model", "offline")
    assert not out.exists()


def test_malformed_dataset_line_names_file_and_line(sft, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(
        '{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": "d"}\n{"instruction": "e", "output": \n'
    )
    out = tmp_path / "out"
    _assert_user_error(*sft("--model", "tiny", "--dataset", data, "--output_dir", out), f"{data}:3:", "invalid JSON")
    assert not out.exists()


def test_dataset_record_with_wrong_schema(sft, tmp_path):
    data = tmp_path / "data.json"
    data.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"question": "c"}\n]\n')
    _assert_user_error(
        *sft("--model", "tiny", "--dataset", data, "--output_dir", tmp_path / "out"), f"{data}:3:", "alpaca"
    )


def test_unknown_yaml_key_suggests_closest(sft, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("loraa_r: 16\nlr: 1e-4\n")  # (lora_rank is LLaMA-Factory's and ms-swift's: mapped, test_anchors)
    _assert_user_error(*sft("--config", config, "--output_dir", tmp_path / "out"), "loraa_r", "did you mean 'lora_r'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flag,suggested",
    [
        # aliases from other tools (LLaMA-Factory's and ms-swift's own keys are accepted: test_anchors.py)
        ("--micro_batch_size", "--batch_size"),
        ("--micro-batch-size", "--batch_size"),
        ("--grad_acum", "--grad_accum"),  # a typo
        ("--max-lenght", "--max_length"),
        ("--gradient_accumulation", "--grad_accum"),
        ("--num_epochs", "--epochs"),
    ],
)
def test_unknown_flag_suggests_only_close_names(sft, flag, suggested):
    _assert_user_error(
        *sft(flag, "4"), f"unknown option {flag.replace('-', '_').replace('__', '--', 1)}", f"did you mean {suggested}?"
    )


@pytest.mark.parametrize("flag", ["--banana", "--xyzzy", "--loss"])
def test_unknown_flag_far_from_every_key_gets_no_guess(sft, flag):
    line = _assert_user_error(*sft(flag, "1"), "unknown option")
    assert "did you mean" not in line and "--help" in line


def test_key_name_and_key_dash_name_are_the_same_key():
    from fused_stable.train.config.resolve import resolve_config

    a, _ = resolve_config(["--max_grad_norm", "0.5", "--grad-accum", "3", "--save-total-limit=2"])
    b, _ = resolve_config(["--max-grad-norm", "0.5", "--grad_accum", "3", "--save_total_limit=2"])
    assert a == b and a.max_grad_norm == 0.5 and a.grad_accum == 3 and a.save_total_limit == 2


def test_quant_bits_with_full_finetuning(sft, tmp_path):
    _assert_user_error(
        *sft("--tuner", "full", "--quant_bits", "4", "--output_dir", tmp_path / "o"), "quant_bits", "full"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        # the cases of the report this suite answers: each exited 0 with a NaN adapter, or with a traceback
        ("--lr", "inf", "lr in --lr must be a finite number"),
        ("--lr", "-1e-4", "lr must be in (0, 1]"),
        ("--lr", "1e30", "lr must be in (0, 1]"),
        ("--max_grad_norm", "nan", "max_grad_norm in --max_grad_norm must be a finite number"),
        ("--max_grad_norm", "inf", "must be a finite number"),
        ("--weight_decay", "nan", "weight_decay in --weight_decay must be a finite number"),
        ("--weight_decay", "1e5", "lr x weight_decay must be below 1"),
        ("--epochs", "inf", "epochs in --epochs must be a finite number"),
        ("--epochs", "1e9", "epochs must be in (0, 10000]"),
        ("--lora_r", "inf", "must be a finite number"),
        ("--lora_r", "nan", "must be a finite number"),
        ("--batch_size", "1e12", "batch_size must be in [1, 65536]"),
        ("--seed", "-1", "seed must be in [0, 4294967295]"),
        ("--precision", "fp8", "precision must be one of"),
        ("--batch_size", "two", "batch_size in --batch_size must be int, got 'two'"),
        ("--warmup_ratio", "1.5", "warmup_ratio must be in [0, 1)"),
        ("--device", "cudax", "device must be auto, cpu, cuda or cuda:N, got 'cudax'"),
        ("--target_modules", "q proj", "is not a module name"),
        ("--resume", "latest", "no complete checkpoint"),
    ],
)
def test_bad_values(sft, tmp_path, flag, value, needle):
    out = tmp_path / "o"
    _assert_user_error(*sft("--model", "tiny", flag, value, "--output_dir", out), needle)
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_cuda_device_without_cuda(sft, tmp_path, device):
    _assert_user_error(*sft("--device", device, "--output_dir", tmp_path / "o"), f"device={device}", "no CUDA device")
    assert not (tmp_path / "o").exists()


def test_resume_and_overwrite_together(sft, tmp_path):
    _assert_user_error(*sft("--resume", "latest", "--overwrite", "--output_dir", tmp_path / "o"), "exclude each other")


def test_output_dir_under_a_file(sft, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder\n")
    _assert_user_error(*sft(*RUN, "--output_dir", blocker / "run"), "cannot be created", "is a file")
    _assert_user_error(*sft(*RUN, "--output_dir", blocker), "exists and is not a directory")
    assert blocker.read_text() == "not a folder\n"


def test_unwritable_output_dir_before_the_model_is_built(tmp_path):
    """A folder this user cannot write: refused in setup, before any model or data work. Root may write
    anywhere, so as root the check runs with the privilege that allows it (CAP_DAC_OVERRIDE) dropped."""
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    cmd = [
        sys.executable,
        "-c",
        "import sys; from fused_stable.train.run import sft; sys.exit(sft.main(sys.argv[1:]))",
        *RUN,
        "--output_dir",
        str(parent / "run"),
    ]
    if os.geteuid() == 0:
        if not shutil.which("capsh"):
            pytest.skip("running as root without capsh: no way to take away root's right to write anywhere")
        cmd = ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", shlex.join(cmd)]
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"fused-stable sft: error: output_dir '{parent / 'run'}' cannot be created: "
        f"'{parent}' is not writable by this user"
    ]
    assert os.listdir(parent) == []


def test_real_process_exit_code_and_stderr(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fused_stable", "sft", "--lr", "-1", "--output_dir", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["fused-stable sft: error: lr must be in (0, 1], got -1.0"]
    assert not (tmp_path / "o").exists()


def test_help_lists_every_key_with_default_within_100_columns(sft):
    from fused_stable.train.config.keys import FIELDS

    code, out, _ = sft("--help")
    assert code == 0
    for name in FIELDS:
        assert f"--{name} " in out, name
    assert "(default: 0.001)" in out and "(default: all-linear)" in out and "(default: smollm2-135m)" in out
    assert max(len(line) for line in out.splitlines()) <= 100
