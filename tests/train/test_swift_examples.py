"""ms-swift's own example scripts run through `fused-stable sft` with their flags as written (issue 40 item 5):
the three scripts' text is below verbatim, and each test builds its command line from that text, replacing only
the model (`--model tiny`) and the hub datasets (a local JSON file of the same name, with the same `#N`), and
adding `--max_steps 2`. Each trains on the tiny model, and its output says what each dataset contributed.

Source: github.com/modelscope/ms-swift at commit 3602360a562313afbf2ef6065fdf61f271a2c5b9 (2026-08-22),
`examples/train/lora_sft.sh`, `examples/train/tuners/dora/train.sh`, `examples/train/qlora/bnb/train.sh`; and at
commit 1acfef4b926808299d5afdc6d1d8913a57ba36ed `examples/train/optimizer/muon.sh` (issue 50: `--optimizer muon`).
Left out: the `CUDA_VISIBLE_DEVICES=0` environment assignment before `swift sft` (not a flag; the tests run on
the CPU, where it picks nothing). Every flag is kept; `--output_dir output` is the test's folder (it runs there).
"""

import json
import shlex

import pytest
import yaml

LORA_SFT = """\
# 22GB
# qwen3: https://github.com/modelscope/ms-swift/blob/main/examples/train/think_model/qwen3_demo1.sh
CUDA_VISIBLE_DEVICES=0 \\
swift sft \\
    --model Qwen/Qwen2.5-7B-Instruct \\
    --tuner_type lora \\
    --dataset 'AI-ModelScope/alpaca-gpt4-data-zh#500' \\
              'AI-ModelScope/alpaca-gpt4-data-en#500' \\
              'swift/self-cognition#500' \\
    --torch_dtype bfloat16 \\
    --num_train_epochs 1 \\
    --per_device_train_batch_size 1 \\
    --per_device_eval_batch_size 1 \\
    --learning_rate 1e-4 \\
    --lora_rank 8 \\
    --lora_alpha 32 \\
    --target_modules all-linear \\
    --gradient_accumulation_steps 16 \\
    --eval_steps 50 \\
    --save_steps 50 \\
    --save_total_limit 2 \\
    --logging_steps 5 \\
    --max_length 2048 \\
    --output_dir output \\
    --system 'You are a helpful assistant.' \\
    --warmup_ratio 0.05 \\
    --dataset_num_proc 4 \\
    --dataloader_num_workers 4 \\
    --model_author swift \\
    --model_name swift-robot
"""

DORA = """\
# 17.2GiB
CUDA_VISIBLE_DEVICES=0 \\
swift sft \\
    --model Qwen/Qwen2.5-7B-Instruct \\
    --tuner_type lora \\
    --use_dora true \\
    --dataset 'swift/self-cognition#1000' \\
    --num_train_epochs 1 \\
    --per_device_train_batch_size 1 \\
    --learning_rate 1e-4 \\
    --lora_rank 8 \\
    --lora_alpha 32 \\
    --gradient_accumulation_steps 16 \\
    --eval_steps 100 \\
    --save_steps 100 \\
    --save_total_limit 2 \\
    --logging_steps 5 \\
    --model_author swift \\
    --model_name swift-robot
"""

QLORA_BNB = """\
# 10GB
# pip install bitsandbytes
CUDA_VISIBLE_DEVICES=0 \\
swift sft \\
    --model Qwen/Qwen2.5-7B-Instruct \\
    --tuner_type lora \\
    --dataset 'AI-ModelScope/alpaca-gpt4-data-zh#500' \\
              'AI-ModelScope/alpaca-gpt4-data-en#500' \\
              'swift/self-cognition#500' \\
    --torch_dtype bfloat16 \\
    --bnb_4bit_compute_dtype bfloat16 \\
    --bnb_4bit_quant_type nf4 \\
    --bnb_4bit_use_double_quant true \\
    --quant_method bnb \\
    --quant_bits 4 \\
    --num_train_epochs 1 \\
    --per_device_train_batch_size 1 \\
    --per_device_eval_batch_size 1 \\
    --learning_rate 1e-4 \\
    --lora_rank 8 \\
    --lora_alpha 32 \\
    --target_modules all-linear \\
    --gradient_accumulation_steps 16 \\
    --eval_steps 50 \\
    --save_steps 50 \\
    --save_total_limit 2 \\
    --logging_steps 5 \\
    --max_length 2048 \\
    --output_dir output \\
    --system 'You are a helpful assistant.' \\
    --warmup_ratio 0.05 \\
    --dataloader_num_workers 4 \\
    --model_author swift \\
    --model_name swift-robot
"""

MUON = """\
# 17GB
# ref: https://github.com/MoonshotAI/Moonlight/blob/master/examples/toy_train.py
CUDA_VISIBLE_DEVICES=0 \\
swift sft \\
    --model Qwen/Qwen2.5-7B-Instruct \\
    --train_type lora \\
    --dataset 'AI-ModelScope/alpaca-gpt4-data-zh#500' \\
              'AI-ModelScope/alpaca-gpt4-data-en#500' \\
              'swift/self-cognition#500' \\
    --optimizer muon \\
    --torch_dtype bfloat16 \\
    --num_train_epochs 1 \\
    --per_device_train_batch_size 1 \\
    --per_device_eval_batch_size 1 \\
    --learning_rate 1e-4 \\
    --lora_rank 8 \\
    --lora_alpha 32 \\
    --target_modules all-linear \\
    --gradient_accumulation_steps 16 \\
    --eval_steps 50 \\
    --save_steps 50 \\
    --save_total_limit 5 \\
    --logging_steps 5 \\
    --max_length 2048 \\
    --output_dir output \\
    --system 'You are a helpful assistant.' \\
    --warmup_ratio 0.05 \\
    --dataloader_num_workers 4 \\
    --model_author swift \\
    --model_name swift-robot
"""

HUB_DATASETS = ("AI-ModelScope/alpaca-gpt4-data-zh", "AI-ModelScope/alpaca-gpt4-data-en")
LOCAL_ROWS = 600  # more than the scripts' #500, so #500 samples without replacement, as on the hub's data sets


def swift_flags(script: str) -> list[str]:
    """The arguments after `swift sft` in a shell script, as the shell splits them."""
    lines = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    words = shlex.split(" ".join(lines).replace("\\ ", " "))
    return words[words.index("sft") + 1 :]


def local_command(script: str, folder) -> list[str]:
    """The script's flags with the model replaced by `tiny`, each hub dataset by a local JSON file of the same
    name (its `#N` kept), and `--max_steps 2` added; nothing else changed."""
    flags = swift_flags(script)
    flags[flags.index("--model") + 1] = "tiny"
    out = []
    for word in flags:
        name, hashed, count = word.partition("#")
        if name in HUB_DATASETS:
            word = f"{_local_dataset(folder, name)}{hashed}{count}"
        out.append(word)
    return [*out, "--max_steps", "2"]


def _local_dataset(folder, hub_name: str) -> str:
    """An alpaca file (instruction / input / output, the hub data set's columns) named after the hub data set."""
    name = hub_name.split("/")[-1]
    chinese = name.endswith("-zh")
    records = [
        {
            "instruction": f"{'把这个数加一' if chinese else 'Add one to this number'} ({i})",
            "input": str(i),
            "output": str(i + 1),
        }
        for i in range(LOCAL_ROWS)
    ]
    path = folder / f"{name}.json"
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return str(path)


def _train(sft, tmp_path, monkeypatch, script):
    """Train from the script's flags in tmp_path; (stdout, run.yaml, the run folder)."""
    monkeypatch.chdir(tmp_path)  # --output_dir output, as the script writes it (dora's keeps sft's runs/sft)
    argv = local_command(script, tmp_path)
    code, stdout, err = sft(*argv)
    assert code == 0, err
    out = tmp_path / ("output" if "--output_dir" in argv else "runs/sft")
    assert "done: steps 0->2" in stdout
    return stdout, yaml.safe_load((out / "run.yaml").read_text()), out


def test_the_scripts_flags_are_kept_as_written(tmp_path):
    """Only the model and the hub datasets are replaced, and --max_steps 2 added."""
    for script in (LORA_SFT, DORA, QLORA_BNB, MUON):
        flags, local = swift_flags(script), local_command(script, tmp_path)
        assert local[-2:] == ["--max_steps", "2"] and len(local) == len(flags) + 2
        changed = [(a, b) for a, b in zip(flags, local) if a != b]
        assert changed[0] == ("Qwen/Qwen2.5-7B-Instruct", "tiny")
        assert all(a.split("#")[0] in HUB_DATASETS and a.split("#")[1:] == b.split("#")[1:] for a, b in changed[1:])


def test_lora_sft_sh(sft, tmp_path, monkeypatch):
    stdout, run, out = _train(sft, tmp_path, monkeypatch, LORA_SFT)
    assert (
        "datasets: alpaca-gpt4-data-zh#500 500 + alpaca-gpt4-data-en#500 500 + identity#500 500 = 1500 examples"
        in stdout
    )
    assert "system: 'You are a helpful assistant.' (given to the 1,500 training and held-out examples" in stdout
    assert (run["tuner"], run["precision"], run["lora_r"], run["lora_alpha"]) == ("lora", "bf16", 8, 32)
    assert (run["grad_accum"], run["batch_size"], run["warmup_ratio"]) == (16, 1, 0.05)
    assert (run["identity_name"], run["identity_author"]) == ("swift-robot", "swift")
    saved = json.loads((out / "adapter" / "fused_stable.json").read_text())
    assert saved["system"] == "You are a helpful assistant."


def test_dora_train_sh(sft, tmp_path, monkeypatch):
    stdout, run, _ = _train(sft, tmp_path, monkeypatch, DORA)
    assert "dataset: identity#1000 1000 examples" in stdout
    assert (run["tuner"], run["lora_alpha"], run["identity_name"]) == ("dora", 32, "swift-robot")


def test_qlora_bnb_train_sh(sft, tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    stdout, run, out = _train(sft, tmp_path, monkeypatch, QLORA_BNB)
    assert (
        "datasets: alpaca-gpt4-data-zh#500 500 + alpaca-gpt4-data-en#500 500 + identity#500 500 = 1500 examples"
        in stdout
    )
    assert "quant_bits=4 precision=bf16" in stdout
    assert (run["tuner"], run["quant_bits"], run["precision"]) == ("lora", 4, "bf16")
    assert json.loads((out / "adapter" / "fused_stable.json").read_text())["quant_bits"] == 4


def test_optimizer_muon_sh(sft, tmp_path, monkeypatch):
    """swift's `--optimizer muon` is optim muon with its LoRA factors on Muon (muon_lora), as swift splits them
    (every 2-D trainable param but the embedding and the head): all-linear LoRA on the tiny model's 4 layers is 56
    factors, every one a Muon matrix, none on AdamW; the mapping line and the run's split say so."""
    stdout, run, out = _train(sft, tmp_path, monkeypatch, MUON)
    assert "optimizer: muon -> optim: muon, muon_lora: True" in stdout
    assert (run["optim"], run["muon_lora"], run["tuner"]) == ("muon", True, "lora")
    assert "optim muon: Muon: 56 matrices in 56 tensors" in stdout and "(LoRA factor 56) | AdamW: 0 tensors" in stdout
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["muon_split"]["muon"]["reasons"]["LoRA factor"]["tensors"] == 56
