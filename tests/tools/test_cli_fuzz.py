"""Every option of `fused-stable sft`, `stress`, `bench`, `chat` and `export` driven with bad values: non-numbers,
nan, inf, negatives, zero, huge, wrong YAML types, unknown keys, missing and damaged files.

Each must end the same way: exit code 2, exactly one line on stderr that names what is wrong, no traceback,
and nothing created or changed in the output folder. A value that is fine for one key (0 = "no clipping",
1e30 = "never alert") is listed in ACCEPTED with the reason, and is checked to pass validation instead.

The CLI `main()` functions run in-process (each case costs milliseconds: validation happens before any model
is built, which the `no_model_building` fixture enforces); a few real processes check the end-to-end
property (exit status and stderr of the installed entry point).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import typing

import pytest

from fused_stable import stress
from fused_stable.bench import cli as bench_cli
from fused_stable.train.config.keys import CHOICES, FIELDS, TrainConfig
from fused_stable.train.config.resolve import LIST_KEYS, resolve_config
from fused_stable.train.run import sft as sft_cli
from fused_stable.train.saved import chat as chat_cli
from fused_stable.train.saved import export as export_cli

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [
    "--model",
    "tiny",
    "--dataset",
    "arithmetic",
    "--arithmetic_examples",
    "64",
    "--batch_size",
    "4",
    "--grad_accum",
    "2",
    "--max_steps",
    "2",
    "--logging_steps",
    "1",
    "--save_steps",
    "1",
    "--tensorboard",
    "false",
    "--max_length",
    "96",
]
NUMBERS = ["abc", "nan", "inf", "-inf", "-1", "0", "1e30"]  # + "2.5" and "1e400" for integer keys

# (key, value) -> why the value is a fine setting of that key
ACCEPTED = {
    ("weight_decay", "0"): "no weight decay",
    ("max_grad_norm", "0"): "no clipping",
    ("max_grad_norm", "1e30"): "a clip that never triggers",
    ("warmup_ratio", "0"): "no warm-up",
    ("warmup_steps", "0"): "the warm-up from warmup_ratio",
    ("lora_dropout", "0"): "no dropout",
    ("save_steps", "0"): "a checkpoint only at the end",
    ("save_total_limit", "0"): "keep every checkpoint",
    ("seed", "0"): "seed 0",
    ("zero_stage", "0"): "DeepSpeed ZeRO-0 (the engine without partitioning)",
    ("threads", "0"): "OMP_NUM_THREADS or one thread per physical core",
    ("general_examples", "0"): "the identity examples alone",
    ("guard_grad_ratio", "0"): "the z-score alone",
    ("guard_loss_rise", "0"): "rise alerts off",
    ("guard_max_rollbacks", "0"): "stop at the first rollback",
    ("guard_grad_z", "1e30"): "grad-norm alerts never fire",
    ("guard_grad_ratio", "1e30"): "grad-norm alerts never fire",
    ("guard_skip_z", "1e30"): "spikes never skipped",
    ("guard_skip_ratio", "0"): "the z-score alone",
    ("guard_skip_ratio", "1e30"): "spikes never skipped",
    ("guard_loss_z", "1e30"): "loss alerts never fire",
    ("guard_loss_rise", "1e30"): "rise alerts never fire",
    ("val_size", "0"): "no examples held out",
    ("eval_steps", "0"): "no evaluation during training",
    ("guard_eval_rise", "0"): "evaluation rise alerts off",
    ("guard_eval_rise", "1e30"): "evaluation rise alerts never fire",
}


def _base_type(name):
    hint = typing.get_type_hints(TrainConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


NUMBER_KEYS = [n for n in FIELDS if _base_type(n) in (int, float)]
STRING_KEYS = [n for n in FIELDS if _base_type(n) is str]
BOOL_KEYS = [n for n in FIELDS if _base_type(n) is bool]


def snapshot(folder):
    """Every entry under `folder` with its content hash (None: the folder does not exist)."""
    if not os.path.exists(folder):
        return None
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), folder) + "/"] = None
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.fixture
def no_model_building(monkeypatch):
    """Validation must finish before any model is built: building one fails the test."""
    from fused_stable.train.model import load

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for an input that validation should have refused")

    monkeypatch.setattr(load, "load_base_model", refuse)


def _one_line(main, prefix, argv, capsys, needle):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (argv, code, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith(prefix), (argv, err)
    assert "Traceback" not in out + err
    assert needle in lines[0], (argv, lines[0])
    return lines[0]


def sft(argv, capsys, needle):
    return _one_line(sft_cli.main, "fused-stable sft: error: ", argv, capsys, needle)


# ------------------------------------------------------------------------------------------ sft: numbers
def _number_cases():
    for name in NUMBER_KEYS:
        values = NUMBERS + (["2.5", "1e400"] if _base_type(name) is int else [])
        for value in values:
            yield pytest.param(name, value, id=f"{name}={value}")


@pytest.mark.parametrize("name,value", list(_number_cases()))
def test_sft_number_flag(name, value, tmp_path, capsys, no_model_building):
    out = tmp_path / "out"
    if (name, value) in ACCEPTED:
        cfg, _ = resolve_config(["--model", "tiny", f"--{name}", value])
        assert getattr(cfg, name) == float(value)
        return
    sft([*TINY, f"--{name}", value, "--output_dir", out], capsys, name)
    assert not out.exists()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A real, finished tiny run (2 steps, a checkpoint each)."""
    out = tmp_path_factory.mktemp("fuzz") / "run"
    assert sft_cli.main([*TINY, "--output_dir", str(out)]) == 0
    return out


@pytest.mark.parametrize("name", [n for n in NUMBER_KEYS])
def test_sft_number_flags_leave_an_existing_run_unchanged(name, finished_run, capsys, no_model_building):
    """The same bad values against a finished run, even with --overwrite: the run is left byte for byte."""
    before = snapshot(finished_run)
    for value in ("nan", "-inf", "abc"):
        sft([*TINY, f"--{name}", value, "--output_dir", finished_run, "--overwrite"], capsys, name)
        assert snapshot(finished_run) == before


# ------------------------------------------------------------------------------------------ sft: YAML types
def _yaml_cases():
    for name in FIELDS:
        kind = _base_type(name)
        values = {"a list": "[1, 2]", "a mapping": "{a: 1}"}
        if kind is not bool and not {"on", "off"} <= set(CHOICES.get(name, ())):  # on/off keys take YAML's booleans
            values["a boolean"] = "true"
        if kind is str:
            values["a number"] = "5"
        if kind in (int, float):
            values["a word"] = "abc"
            values["nan"] = ".nan"
            values["inf"] = ".inf"
        if kind is bool:
            values["a word"] = "maybe"
        if name in LIST_KEYS:  # a YAML list is their right type (several datasets): a list of lists is not
            values["a list"] = "[[1], {a: 1}]"
        if name == "interleave_probs":  # numbers are its items
            values.pop("a number")
            values["a word"] = "abc"
        for what, text in values.items():
            yield pytest.param(name, text, id=f"{name}:{what}")


@pytest.mark.parametrize("name,text", list(_yaml_cases()))
def test_sft_yaml_wrong_type(name, text, tmp_path, capsys, no_model_building):
    config = tmp_path / "run.yaml"
    config.write_text(f"{name}: {text}\n")
    out = tmp_path / "out"
    line = sft([*TINY, "--config", config, "--output_dir", out], capsys, name)
    assert str(config) in line
    assert not out.exists()


# ------------------------------------------------------------------------------------------ sft: words, files
def _damaged_files(tmp):
    """Paths of bad inputs, made once per test in its own tmp dir."""
    (tmp / "garbage.bin").write_bytes(bytes(range(256)) * 4)
    (tmp / "garbage.jsonl").write_bytes(b"\xff\xfe\x00not text" * 10)
    (tmp / "empty.jsonl").write_text("")
    (tmp / "list.json").write_text('{"instruction": "a json object, not an array"}')
    (tmp / "a-file").write_text("x\n")
    (tmp / "folder").mkdir()
    (tmp / "model-broken").mkdir()
    (tmp / "model-broken" / "config.json").write_text("{ not json")
    (tmp / "ckpt-empty").mkdir()
    (tmp / "ckpt-broken").mkdir()
    (tmp / "ckpt-broken" / "COMPLETE").write_text("1796051234.5\n")
    (tmp / "bad.yaml").write_text("lr: [unclosed\n")
    (tmp / "list.yaml").write_text("- lr\n- 1e-4\n")
    (tmp / "unknown.yaml").write_text("not_a_key: 1\n")
    (tmp / "binary.yaml").write_bytes(b"\xff\xfe\x00\x01" * 8)
    (tmp / "not-empty").mkdir()
    (tmp / "not-empty" / "precious.txt").write_text("keep me\n")


# (flags, what the error line names); {t} is the test's tmp dir
WORD_CASES = [
    (["--model", "{t}/missing"], "missing"),
    (["--model", "{t}/model-broken"], "model-broken"),
    (["--model", "{t}/folder"], "folder"),
    (["--model", "{t}/a-file"], "a-file"),
    (["--model", ""], "model"),
    (["--dataset", "{t}/missing.jsonl"], "missing.jsonl"),
    (["--dataset", "{t}/garbage.jsonl"], "garbage.jsonl"),
    (["--dataset", "{t}/empty.jsonl"], "empty.jsonl"),
    (["--dataset", "{t}/list.json"], "list.json"),
    (["--dataset", "{t}/folder"], "folder"),
    (["--output_dir", "{t}/a-file"], "a-file"),
    (["--output_dir", "{t}/a-file/run"], "a-file"),
    (["--output_dir", "{t}/not-empty"], "not a fused-stable run"),
    (["--output_dir", "{t}/not-empty", "--overwrite"], "not a fused-stable run"),
    (["--output_dir", ""], "output_dir"),
    (["--dataset", "arithmetic#0"], "#N"),
    (["--dataset", "arithmetic#many"], "#N"),
    (["--dataset", ","], "dataset"),
    (["--dataset", "arithmetic,{t}/missing.jsonl"], "missing.jsonl"),
    (["--dataset", "arithmetic,identity", "--interleave_probs", "a,b"], "interleave_probs"),
    (["--dataset", "arithmetic,identity", "--interleave_probs", "0.5"], "interleave_probs"),
    (["--dataset", "arithmetic,identity", "--interleave_probs", "0.9,0.9"], "interleave_probs"),
    (["--dataset", "arithmetic,identity", "--interleave_probs", "nan,1"], "interleave_probs"),
    (["--eval_dataset", "arithmetic,{t}/missing.jsonl"], "missing.jsonl"),
    (["--eval_dataset", ","], "eval_dataset cannot be empty"),
    (["--eval_dataset", "arithmetic", "--val_size", "0.1"], "eval_dataset and val_size"),
    (
        ["--dataset", "arithmetic,identity", "--eval_dataset", "arithmetic,identity,arithmetic"]
        + ["--mix_strategy", "interleave_under", "--interleave_probs", "0.5,0.5"],
        "eval_dataset",
    ),
    (["--identity_name", ""], "identity_name"),
    (["--identity_name", " "], "identity_name"),
    (["--identity_author", ""], "identity_author"),
    (["--system", ""], "system"),
    (["--system", "  "], "system"),
    (["--tuner", "lorax"], "tuner"),
    (["--scheduler", "cosin"], "scheduler"),
    (["--precision", "fp8"], "precision"),
    (["--clip", "adaptive"], "clip"),
    (["--guard", "panic"], "guard"),
    (["--quant_bits", "3"], "quant_bits"),
    (["--device", "cudax"], "device"),
    (["--device", "cuda:7"], "cuda:7"),
    (["--device", "gpu"], "device"),
    (["--device", "-1"], "device"),
    (["--target_modules", ""], "target_modules"),
    (["--target_modules", ",,"], "target_modules"),
    (["--target_modules", "q proj;rm"], "target_modules"),
    (["--resume", "{t}/missing"], "missing"),
    (["--resume", "{t}/ckpt-empty"], "ckpt-empty"),
    (["--resume", "{t}/ckpt-broken"], "ckpt-broken"),
    (["--resume", "{t}/a-file"], "a-file"),
    (["--resume", "latest", "--overwrite"], "exclude each other"),
    (["--deepspeed", "{t}/missing"], "missing"),
    (["--deepspeed", "{t}/folder"], "folder"),
    (["--deepspeed", "{t}/garbage.jsonl"], "garbage.jsonl"),
    (["--config", "{t}/missing.yaml"], "missing.yaml"),
    (["--config", "{t}/folder"], "folder"),
    (["--config", "{t}/bad.yaml"], "bad.yaml"),
    (["--config", "{t}/list.yaml"], "list.yaml"),
    (["--config", "{t}/unknown.yaml"], "not_a_key"),
    (["--config", "{t}/binary.yaml"], "binary.yaml"),
    (["--not_a_key", "1"], "not_a_key"),
    (["--micro_batch_size", "4"], "did you mean --batch_size"),
    (["stray"], "stray"),
    (["--lr"], "--lr needs a value"),
    (["--lr", "--max_steps", "3"], "--lr needs a value"),
    (["--tensorboard", "maybe"], "tensorboard"),
    (["--overwrite", "2"], "overwrite"),
    (["--gradient_checkpointing", "yes please"], "gradient_checkpointing"),
    (["--tuner", "full", "--quant_bits", "4"], "quant_bits"),
    (["--tuner", "full", "--loraplus_lr_ratio", "4"], "loraplus_lr_ratio"),
    (["--lr", "0.5", "--loraplus_lr_ratio", "16"], "loraplus_lr_ratio"),
    (["--lr", "0.5", "--weight_decay", "2"], "weight_decay"),
]


@pytest.mark.parametrize("flags,needle", WORD_CASES, ids=[" ".join(f) for f, _ in WORD_CASES])
def test_sft_words_and_files(flags, needle, tmp_path, capsys, no_model_building):
    if "cuda" in " ".join(flags):
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 7:
            pytest.skip("this machine has a cuda:7")
    _damaged_files(tmp_path)
    flags = [f.replace("{t}", str(tmp_path)) for f in flags]
    before = {name: snapshot(tmp_path / name) for name in os.listdir(tmp_path)}
    argv = [*TINY, "--output_dir", tmp_path / "out", *flags]  # a later --output_dir wins
    sft(argv, capsys, needle.replace("{t}", str(tmp_path)))
    assert not (tmp_path / "out").exists()
    assert {name: snapshot(tmp_path / name) for name in os.listdir(tmp_path)} == before  # inputs untouched too


@pytest.mark.parametrize("name", [n for n in FIELDS if n in CHOICES or n in BOOL_KEYS])
def test_sft_choice_and_boolean_keys(name, tmp_path, capsys, no_model_building):
    """Keys with a fixed set of values (new ones are covered automatically)."""
    out = tmp_path / "out"
    for value in ("bogus", "2", "-1", "nan"):
        sft([*TINY, f"--{name}", value, "--output_dir", out], capsys, name)
    assert not out.exists()


def test_every_sft_key_is_driven():
    """A key added to TrainConfig is covered here automatically (numbers, choices, booleans, YAML types); a
    free-form one (a name or a path) must have its bad values in WORD_CASES: no key escapes the fuzz test."""
    named = {f.lstrip("-") for flags, _ in WORD_CASES for f in flags if f.startswith("--")}
    for name in FIELDS:
        assert name in NUMBER_KEYS or name in CHOICES or name in BOOL_KEYS or name in named, (
            f"--{name} has no bad-value case in WORD_CASES"
        )


# ------------------------------------------------------------------------------------------ stress and bench
def _parser_cases(parser, words):
    """(flag, value) for every option of an argparse parser: the NUMBERS for number options, 'bogus' for a
    choice, and the given words for the rest."""
    for action in parser._actions:
        flag = next((s for s in action.option_strings if s.startswith("--")), None)
        if flag in (None, "--help") or action.nargs == 0:
            continue
        if action.choices:
            yield flag, "bogus"
        elif getattr(action.type, "__name__", "") in ("number", "integer"):
            for value in NUMBERS + (["2.5"] if action.type.__name__ == "integer" else []):
                yield flag, value
        else:
            assert flag in words, f"{flag}: no bad value listed for it"
            for value in words[flag]:
                yield flag, value


STRESS_ACCEPTED = {("--pretrain-steps", "0"), ("--max-rollbacks", "0"), ("--seed", "0"), ("--eval-rise", "0")}  # 0: off
STRESS_WORDS = {
    "--scenarios": ["bogus", "", "clean,meteor", "lr_to_high"],
    "--output-dir": ["{t}/a-file", "{t}/a-file/x"],
    "--model": ["{t}/missing", "{t}/missing.gguf", "{t}/a-file"],
}


@pytest.mark.parametrize("flag,value", list(_parser_cases(stress.build_parser(), STRESS_WORDS)))
def test_stress_option(flag, value, tmp_path, capsys):
    if (flag, value) in STRESS_ACCEPTED:
        stress.build_parser().parse_args([flag, value])
        return
    (tmp_path / "a-file").write_text("x\n")
    out = tmp_path / "out"
    argv = ["--output-dir", out, flag, value.replace("{t}", str(tmp_path))]
    line = _one_line(stress.main, "fused-stable stress: error: ", argv, capsys, "")
    assert flag.lstrip("-").replace("-", "_") in line.replace("-", "_") or "scenario" in line, line
    assert not out.exists()


BENCH_ACCEPTED = {
    ("--warmup", "0"),
    ("--min-time", "0"),
    ("--copy-mib", "0"),
    ("--threads", "0"),
    ("--deadline", "0"),
    ("--seed", "0"),
}
BENCH_WORDS = {
    "--device": ["cudax", "cuda:7", "gpu", ""],
    "--sets": ["nope"],
    "--contenders": ["torch_fuse", "x"],
    "--compile-sets": ["nope"],
    "--out": ["{t}/a-file", "{t}/a-file/x"],
    "--name": ["../x", "a/b", ".."],
}


@pytest.mark.parametrize("flag,value", list(_parser_cases(bench_cli.build_parser(), BENCH_WORDS)))
def test_bench_option(flag, value, tmp_path, capsys):
    if (flag, value) in BENCH_ACCEPTED:
        bench_cli.build_parser().parse_args([flag, value])
        return
    if value == "cuda:7":
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 7:
            pytest.skip("this machine has a cuda:7")
    (tmp_path / "a-file").write_text("x\n")
    out = tmp_path / "out"
    argv = ["--plan", "smoke", "--out", out, flag, value.replace("{t}", str(tmp_path))]
    line = _one_line(bench_cli.main, "fused-stable bench: error: ", argv, capsys, "")
    assert flag in line or flag.lstrip("-") in line or "device" in line, line
    assert not out.exists()


# ------------------------------------------------------------------------------------------ chat and export
@pytest.fixture
def no_model_loading(monkeypatch):
    """chat and export must refuse bad input before any model is loaded: loading one fails the test."""
    from fused_stable.train.model import load
    from fused_stable.train.saved import final_model

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for an input that should have been refused first")

    # every base model is loaded by load.load_base (export and chat look it up there when they call it;
    # saved runs hold their own reference)
    monkeypatch.setattr(load, "load_base", refuse)
    monkeypatch.setattr(final_model, "load_base", refuse)


def _damaged_adapters(tmp):
    """Adapter folders broken in the ways a copy, a full disk or a hand edit break them."""
    import json

    def adapter(name, config='{"base_model_name_or_path": "tiny", "peft_type": "LORA"}', weights=None, extra=None):
        folder = tmp / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(config)
        if weights is not None:
            (folder / "adapter_model.safetensors").write_bytes(weights)
        for file, text in (extra or {}).items():
            (folder / file).write_text(text)

    adapter("adapter-broken-config", config="{ not json")
    adapter("adapter-list-config", config="[1, 2]")
    adapter("adapter-no-base", config='{"peft_type": "LORA"}', weights=b"")
    adapter("adapter-no-weights")
    adapter("adapter-bad-weights", weights=bytes(range(256)) * 4)
    adapter(
        "adapter-truncated-weights",
        weights=b'\x40\x00\x00\x00\x00\x00\x00\x00{"w": {"dtype": "F32", '
        b'"shape": [4, 4], "data_offsets": [0, 64]}}          ' + b"\x00" * 10,
    )
    import torch
    from safetensors.torch import save

    adapter(
        "adapter-missing-base",
        config=json.dumps({"base_model_name_or_path": str(tmp / "gone")}),
        weights=save({"w": torch.zeros(2)}),
    )
    adapter("adapter-bad-trained-with", weights=b"", extra={"fused_stable.json": "{ not json"})
    (tmp / "run-broken").mkdir()
    (tmp / "run-broken" / "adapter").mkdir()
    (tmp / "run-broken" / "adapter" / "adapter_config.json").write_text("{ not json")


# (value, what the error line names); {t} is the test's tmp dir
ADAPTER_CASES = [
    ("{t}/missing", "missing"),
    ("{t}/folder", "folder"),
    ("{t}/a-file", "a-file"),
    ("", "--adapter"),
    ("{t}/adapter-broken-config", "adapter_config.json"),
    ("{t}/adapter-list-config", "adapter_config.json"),
    ("{t}/adapter-no-base", "base_model_name_or_path"),
    ("{t}/adapter-no-weights", "adapter weights"),
    ("{t}/adapter-bad-weights", "adapter_model.safetensors"),
    ("{t}/adapter-truncated-weights", "adapter_model.safetensors"),
    ("{t}/adapter-missing-base", "gone"),
    ("{t}/adapter-bad-trained-with", "fused_stable.json"),
    ("{t}/run-broken", "adapter_config.json"),
]
CHAT_WORDS = {
    "--model": ["{t}/missing", "{t}/missing.gguf", "{t}/folder", "{t}/a-file", "{t}/model-broken", ""],
    "--adapter": [value for value, _ in ADAPTER_CASES],
    "--prompt": ["", "   "],
    "--system": [],  # any text is a system message; its missing value is checked in test_chat_and_export_need_values
    "--device": ["cudax", "cuda:7", "gpu", ""],
}
CHAT_ACCEPTED = {("--temperature", "0"), ("--seed", "0"), ("--threads", "0")}


def _skip_if_cuda7(value):
    if value == "cuda:7":
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 7:
            pytest.skip("this machine has a cuda:7")


@pytest.mark.parametrize("flag,value", list(_parser_cases(chat_cli.build_parser(), CHAT_WORDS)))
def test_chat_option(flag, value, tmp_path, capsys, monkeypatch, no_model_loading):
    if (flag, value) in CHAT_ACCEPTED:
        chat_cli.build_parser().parse_args([flag, value])
        return
    _skip_if_cuda7(value)
    _damaged_files(tmp_path)
    _damaged_adapters(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    value = value.replace("{t}", str(tmp_path))
    # --model tiny unless the case is about the model or the adapter (chat takes one of them)
    base = [] if flag in ("--model", "--adapter") else ["--model", "tiny"]
    needle = dict(ADAPTER_CASES).get(value.replace(str(tmp_path), "{t}"), "") if flag == "--adapter" else ""
    line = _one_line(
        chat_cli.main, "fused-stable chat: error: ", [*base, "--prompt", "hi", flag, value], capsys, needle
    )
    words = [flag, flag.lstrip("-").replace("-", "_"), "device", "model", "prompt", "adapter", "base"]
    assert any(w in line.replace("-", "_") or w in line for w in words) or os.path.basename(value) in line, line
    assert snapshot(tmp_path) == before  # nothing written, not even a cache or a log


EXPORT_WORDS = {
    "--adapter": [value for value, _ in ADAPTER_CASES],
    "--output-dir": ["{t}/a-file", "{t}/a-file/x", "{t}/not-empty", "{t}/run", ""],
}
EXPORT_ACCEPTED = {("--threads", "0")}


@pytest.mark.parametrize("flag,value", list(_parser_cases(export_cli.build_parser(), EXPORT_WORDS)))
def test_export_option(flag, value, finished_run, tmp_path, capsys, no_model_loading):
    """Bad adapters are tried with a good target, bad targets with a good adapter (a finished tiny run): each
    is refused before the base model is loaded, and nothing is created or changed anywhere."""
    if (flag, value) in EXPORT_ACCEPTED:
        export_cli.build_parser().parse_args(["--adapter", "a", "--output-dir", "b", flag, value])
        return
    import shutil

    _damaged_files(tmp_path)
    _damaged_adapters(tmp_path)
    shutil.copytree(finished_run, tmp_path / "run")  # a sft run folder is not an export target
    value = value.replace("{t}", str(tmp_path))
    argv = {"--adapter": ["--output-dir", tmp_path / "out"], "--output-dir": ["--adapter", finished_run]}.get(
        flag, ["--adapter", "{t}/missing".replace("{t}", str(tmp_path)), "--output-dir", tmp_path / "out"]
    )
    before, run_before = snapshot(tmp_path), snapshot(finished_run)
    for extra in ([], ["--overwrite"]) if flag == "--output-dir" else ([],):
        needle = dict(ADAPTER_CASES).get(value.replace(str(tmp_path), "{t}"), "") if flag == "--adapter" else ""
        line = _one_line(export_cli.main, "fused-stable export: error: ", [*argv, flag, value, *extra], capsys, needle)
        assert (
            flag.lstrip("-").replace("-", "_") in line.replace("-", "_")
            or os.path.basename(value) in line
            or "adapter" in line
        ), line
        assert snapshot(tmp_path) == before and snapshot(finished_run) == run_before


CHAT, EXPORT = (chat_cli.main, "fused-stable chat: error: "), (export_cli.main, "fused-stable export: error: ")


@pytest.mark.parametrize(
    "command,argv,needle",
    [
        (CHAT, ["--model", "tiny", "--system"], "--system"),
        (CHAT, ["--model", "tiny", "--prompt"], "--prompt"),
        (CHAT, ["--model"], "--model"),
        (CHAT, ["--model", "tiny", "--adapter", "x", "--prompt", "hi"], "not both"),
        (CHAT, ["--not-a-key", "1"], "unknown option --not-a-key"),
        (CHAT, ["stray"], "stray"),
        (EXPORT, ["--adapter"], "--adapter"),
        (EXPORT, ["--adapter", "x"], "required: --output-dir"),
        (EXPORT, ["--output_dir", "x"], "required: --adapter"),
        (EXPORT, ["--adapter", "x", "--output_dir", "y", "--overwrite", "yes"], "yes"),
    ],
)
def test_chat_and_export_malformed(command, argv, needle, tmp_path, capsys, monkeypatch, no_model_loading):
    monkeypatch.chdir(tmp_path)
    _one_line(*command, argv, capsys, needle)
    assert os.listdir(tmp_path) == []


def test_chat_and_export_take_both_spellings_and_suggest(capsys):
    assert chat_cli.build_parser().parse_args(["--max_new_tokens", "5"]).max_new_tokens == 5
    assert export_cli.build_parser().parse_args(["--adapter", "a", "--output_dir", "b"]).output_dir == "b"
    _one_line(
        chat_cli.main, "fused-stable chat: error: ", ["--max-tokens", "3"], capsys, "did you mean --max-new-tokens?"
    )
    _one_line(export_cli.main, "fused-stable export: error: ", ["--out", "x"], capsys, "did you mean --output-dir?")


@pytest.mark.parametrize(
    "main,prefix", [(stress.main, "fused-stable stress: error: "), (bench_cli.main, "fused-stable bench: error: ")]
)
@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--not-a-key", "1"], "unknown option --not-a-key"),
        (["--steps"], "--steps"),
        (["stray"], "stray"),
    ],
)
def test_stress_and_bench_unknown_and_malformed(main, prefix, argv, needle, capsys):
    _one_line(main, prefix, argv, capsys, needle)


@pytest.mark.parametrize(
    "main,argv,attr,expected",
    [
        (stress.build_parser, ["--log_every", "4", "--max-rollbacks", "2", "--output_dir", "x"], "log_every", 4),
        (bench_cli.build_parser, ["--size_scale", "0.5", "--max-steps", "7", "--input_sets", "2"], "size_scale", 0.5),
    ],
)
def test_stress_and_bench_take_both_spellings(main, argv, attr, expected):
    args = main().parse_args(argv)
    assert getattr(args, attr) == expected


@pytest.mark.parametrize(
    "argv,suggested",
    [
        (["--output_dir", "x"], "--out"),  # sft's name for it, on bench
        (["--size-scle", "2"], "--size-scale"),  # a typo
    ],
)
def test_bench_suggests_close_names(argv, suggested, capsys):
    _one_line(bench_cli.main, "fused-stable bench: error: ", argv, capsys, f"did you mean {suggested}?")


def test_help_of_every_command_fits_100_columns(capsys, monkeypatch):
    from fused_stable.cli import main as top

    monkeypatch.setenv("COLUMNS", "300")  # argparse would otherwise follow the terminal
    for argv in (
        ["--help"],
        ["sft", "--help"],
        ["stress", "--help"],
        ["bench", "--help"],
        ["chat", "--help"],
        ["export", "--help"],
    ):
        assert top(argv) == 0
        out = capsys.readouterr().out
        assert out.strip() and max(len(line) for line in out.splitlines()) <= 100, argv


# ------------------------------------------------------------------------------------------ real processes
REAL = [
    (["sft", "--lr", "nan"], "fused-stable sft: error: lr in --lr must be a finite number, got 'nan'"),
    (["sft", "--device", "cudax"], "fused-stable sft: error: device must be auto, cpu, cuda or cuda:N, got 'cudax'"),
    (["stress", "--steps", "-1"], "fused-stable stress: error: argument --steps: must be in [20, 100000], got -1"),
    (
        ["bench", "--size_scale", "inf"],
        "fused-stable bench: error: argument --size-scale: must be a finite number, got 'inf'",
    ),
]


def test_real_processes_one_line_exit_2_nothing_created(tmp_path):
    """`python -m fused_stable ...` as a user runs it (the four at once, to keep the suite fast)."""
    procs = []
    for i, (argv, _) in enumerate(REAL):
        cwd = tmp_path / str(i)
        cwd.mkdir()
        flag = {"sft": "--output_dir", "stress": "--output-dir", "bench": "--out"}[argv[0]]
        procs.append(
            (
                cwd,
                subprocess.Popen(
                    [sys.executable, "-m", "fused_stable", *argv, flag, str(cwd / "out")],
                    cwd=cwd,
                    env={**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        )
    for (cwd, proc), (argv, needle) in zip(procs, REAL):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 2, (argv, err[-2000:])
        assert err.strip().splitlines() == [needle], argv
        assert out == ""
        assert os.listdir(cwd) == []  # not even the output folder


@pytest.mark.parametrize("command,needle", [("sfx", "did you mean 'sft'?"), ("train", "commands: sft")])
def test_unknown_command_is_one_line(command, needle, capsys):
    from fused_stable.cli import main as top

    _one_line(top, "fused-stable: error: ", [command, "--lr", "1"], capsys, needle)
