"""`fused-stable chat` and `fused-stable export` on adapters of the tiny model (the real model has its own slow
tests in test_real_model.py): adapters know their base, chat one-shot prints only the answer, interactive
chat keeps the conversation, an export loads with plain transformers and answers like the adapter."""

import builtins
import json
import os

import pytest
import torch
from sft_helpers import TINY

from fused_stable.train.evaluation.generate import generate_answers
from fused_stable.train.saved import chat, export
from fused_stable.train.saved.final_model import inspect_saved, load_trained

# a few steps at a high lr, so that the adapter changes the tiny model's answers
TRAINED = [
    *TINY,
    "--lr",
    "5e-2",
    "--warmup_ratio",
    "0",
    "--lora_dropout",
    "0",
    "--target_modules",
    "all-linear",
    "--save_steps",
    "0",
]
PROMPTS = ["Add.\n\n12 + 30", "Reverse.\n\nhello", "Who are you?"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Adapter runs shared by this module's tests: LoRA, DoRA and QLoRA (4-bit base)."""
    from fused_stable.train.run import sft as sft_command

    root = tmp_path_factory.mktemp("chat_export")
    made = {}
    for name, extra in {"lora": [], "dora": ["--tuner", "dora"], "qlora": ["--quant_bits", "4"]}.items():
        out = root / name
        assert sft_command.main([*TRAINED, *extra, "--output_dir", str(out)]) == 0
        made[name] = out
    return made


def _answers(model, tokenizer, prompts=PROMPTS):
    return generate_answers(model, tokenizer, prompts, max_new_tokens=12, batch_size=1)


def test_adapter_records_a_base_that_loads_again(runs, tmp_path, sft, monkeypatch):
    config = json.loads((runs["lora"] / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny"
    assert json.loads((runs["qlora"] / "adapter" / "fused_stable.json").read_text())["quant_bits"] == 4
    # a local model directory is recorded as an absolute path
    from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model

    local = tmp_path / "local"
    build_tiny_model().save_pretrained(local)
    build_byte_tokenizer().save_pretrained(local)
    monkeypatch.chdir(tmp_path)  # given as a relative path
    code, _, err = sft(*TINY, "--model", "local", "--max_steps", "1", "--output_dir", tmp_path / "out")
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(local) and os.path.isabs(config["base_model_name_or_path"])
    assert load_trained(str(tmp_path / "out")).base.reference == str(local)


@pytest.mark.parametrize("kind", ["lora", "dora", "qlora"])
def test_export_loads_with_transformers_and_answers_like_the_adapter(runs, tmp_path, kind, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = load_trained(str(runs[kind]))
    assert (trained.quant_bits == 4) is (kind == "qlora")
    expected = _answers(trained.model, trained.tokenizer)
    target = tmp_path / "merged"
    assert export.main(["--adapter", str(runs[kind] / "adapter"), "--output_dir", str(target)]) == 0
    printed = capsys.readouterr().out
    assert ("dequantised 4-bit base" in printed) is (kind == "qlora")
    assert not any(name.startswith("adapter") for name in os.listdir(target))
    merged = AutoModelForCausalLM.from_pretrained(target, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    assert not hasattr(merged, "peft_config") and merged.dtype == torch.float32
    assert _answers(merged, tokenizer) == expected
    # same logits as the adapter, up to float rounding of the merge and, for QLoRA, of bitsandbytes' 4-bit
    # matmul against the dequantised fp32 weights the export merges into: that floor is measured here, on the
    # base alone. On a CPU with avx512_bf16, bitsandbytes 0.50 runs inference without grad through its packed
    # bf16 CPU kernel (Linear4bit.forward): floor 0.069, merged vs adapter 0.0084, the adapter's own effect on
    # these logits 5.8; the machines before (no avx512_bf16) matched within 1e-4 with no floor.
    ids = torch.tensor([tokenizer("### Instruction:\nAdd.", add_special_tokens=False)["input_ids"]])
    floor = 0.0
    with torch.no_grad():
        if kind == "qlora":
            saved = inspect_saved(str(runs[kind] / "adapter"))
            dequantised = export._dequantised_base(saved.base, tokenizer, 4, lambda *a: None).eval()
            with trained.model.disable_adapter():
                floor = (trained.model(ids).logits - dequantised(ids).logits).abs().max().item()
        torch.testing.assert_close(merged(ids).logits, trained.model(ids).logits, rtol=1e-4, atol=1e-4 + floor)


def test_export_overwrite_replaces_only_a_previous_export(runs, tmp_path, capsys):
    """A folder holding anything but a previous export is refused, with or without --overwrite, and left as
    it was; a previous export is replaced only with --overwrite (its manifest names what it wrote)."""
    from fused_stable.train.run.outputs import read_manifest

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert export.main(["--adapter", str(runs["lora"]), "--output_dir", str(taken), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not an export" in err and "keep.txt" in err
        assert os.listdir(taken) == ["keep.txt"] and (taken / "keep.txt").read_text() == "mine"
    # a run folder (its manifest says fused-stable sft) is never an export target
    assert export.main(["--adapter", str(runs["lora"]), "--output_dir", str(runs["dora"]), "--overwrite"]) == 2
    assert "holds a fused-stable sft run" in capsys.readouterr().err and (runs["dora"] / "adapter").is_dir()

    target = tmp_path / "merged"
    assert export.main(["--adapter", str(runs["lora"]), "--output_dir", str(target)]) == 0
    manifest = read_manifest(str(target))
    assert manifest["created_by"] == "fused-stable export"
    assert set(manifest["entries"]) == set(os.listdir(target)) - {"run_manifest.json"}
    assert export.main(["--adapter", str(runs["dora"]), "--output_dir", str(target)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    (target / "notes.txt").write_text("mine")
    assert export.main(["--adapter", str(runs["dora"]), "--output_dir", str(target), "--overwrite"]) == 2
    assert "notes.txt" in capsys.readouterr().err and (target / "notes.txt").exists()
    (target / "notes.txt").unlink()
    weights = (target / "model.safetensors").read_bytes()
    assert export.main(["--adapter", str(runs["dora"]), "--output_dir", str(target), "--overwrite"]) == 0
    assert (target / "model.safetensors").read_bytes() != weights  # the DoRA merge replaced the LoRA one
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no scratch or swapped-out folder left


def test_export_folder_is_readable_as_the_umask_says(runs, tmp_path, capsys):
    """The exported folder (made by mkdtemp, 0700) gets the mode mkdir would give it: others can read the model."""
    import stat

    target = tmp_path / "merged"
    previous = os.umask(0o027)
    try:
        assert export.main(["--adapter", str(runs["lora"]), "--output_dir", str(target)]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o750
    assert stat.S_IMODE(os.stat(target / "model.safetensors").st_mode) == 0o640


def test_chat_one_shot_prints_only_the_answer(runs, capsys):
    trained = load_trained(str(runs["lora"]))
    expected = _answers(trained.model, trained.tokenizer, ["Add.\n\n12 + 30"])[0]
    code = chat.main(["--adapter", str(runs["lora"]), "--prompt", "Add.\n\n12 + 30", "--max_new_tokens", "12"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.strip() == expected and out.endswith("\n")
    assert "fused-stable chat:" in err and "greedy" in err


def test_chat_interactive_keeps_the_conversation(runs, capsys, monkeypatch):
    lines = iter(["Add.\n\n1 + 2", "Reverse.\n\nabc", "/reset", "Reverse.\n\nabc", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    seen = []
    real_answer = chat.answer

    def spy(model, tokenizer, messages, **kwargs):
        seen.append([m["content"] for m in messages])
        return real_answer(model, tokenizer, messages, **kwargs)

    monkeypatch.setattr(chat, "answer", spy)
    assert chat.main(["--adapter", str(runs["lora"]), "--max_new_tokens", "6"]) == 0
    assert len(seen) == 3
    assert seen[1][0] == "Add.\n\n1 + 2" and seen[1][-1] == "Reverse.\n\nabc" and len(seen[1]) == 3  # history
    assert seen[2] == ["Reverse.\n\nabc"]  # after /reset
    assert capsys.readouterr().out.count("assistant> ") == 3


def test_ctrl_c_stops_the_answer_and_keeps_the_session(runs, capsys, monkeypatch):
    lines = iter(["Add.\n\n1 + 2", "Reverse.\n\nabc", "Add.\n\n2 + 2", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    seen = []
    real_answer = chat.answer

    def interrupted_second(model, tokenizer, messages, **kwargs):
        seen.append([m["content"] for m in messages])
        if len(seen) == 2:
            raise KeyboardInterrupt  # Ctrl-C while the second answer is generated
        return real_answer(model, tokenizer, messages, **kwargs)

    monkeypatch.setattr(chat, "answer", interrupted_second)
    assert chat.main(["--adapter", str(runs["lora"]), "--max_new_tokens", "4"]) == 0
    assert len(seen) == 3, "the session went on after the stopped answer"
    # the stopped turn is not in the conversation: the third question follows the first answer
    assert seen[2][0] == "Add.\n\n1 + 2" and seen[2][-1] == "Add.\n\n2 + 2" and len(seen[2]) == 3
    assert "answer stopped" in capsys.readouterr().err


def test_chat_base_model_and_errors(capsys):
    assert chat.main(["--model", "tiny", "--prompt", "Add.\n\n1 + 2", "--max_new_tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "tiny" in err and out.endswith("\n")
    assert chat.main(["--model", "tiny", "--adapter", "x", "--prompt", "hi"]) == 2
    assert "not both" in capsys.readouterr().err
    assert chat.main(["--model", "/no/such/model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err


def test_adapter_of_the_embedded_model_names_its_public_base(tmp_path):
    """base_model_name_or_path is the public name (other Hugging Face tools resolve it), fused_stable.json says
    where this project found it, the adapter loads back on it, and saving it warns nothing (peft's offline Hub
    look-up for embedding layers is not made)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    from fused_stable.train.config.keys import TrainConfig
    from fused_stable.train.model.sources import resolve_model
    from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model
    from fused_stable.train.saved.final_model import inspect_saved, save_final

    source = resolve_model("smollm2-135m")
    model = get_peft_model(build_tiny_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_final(model, build_byte_tokenizer(), TrainConfig(), str(tmp_path), source=source)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    trained_with = json.loads((tmp_path / "adapter" / "fused_stable.json").read_text())
    assert (trained_with["base_model"], trained_with["base_model_file"]) == ("smollm2-135m", source.path)
    assert inspect_saved(str(tmp_path)).base.reference == "smollm2-135m"
