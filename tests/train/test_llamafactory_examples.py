"""LLaMA-Factory's own example configs train as they ship (issue 39, items 2 and 5): the four qwen3 SFT examples
(LoRA, on-the-fly 4-bit QLoRA, full under ZeRO-3, LoRA under ZeRO-3), word for word, beside LF's data layout
(data/dataset_info.json naming identity.json, 91 rows, and alpaca_en_demo.json, 999 rows; the rows synthetic and
seeded, identity's with LF's {{name}} / {{author}} placeholders, which LF trains as written too) and its
examples/deepspeed/ds_z3_config.json, each run with only `--model tiny --max_steps 2` added (the Qwen3 model
they name is not on the machine). The two ZeRO-3 ones run real DeepSpeed on the CPU: the full one as
`llamafactory-cli train` runs it on one device (one process, no launcher), the LoRA one under torchrun on 2 gloo
ranks. eval_dataset (LF's, commented out in these files) loads and mixes as dataset does."""

import json
import os
import random
import subprocess
import sys

import pytest
from sft_helpers import read_metrics, setup_run
from test_deepspeed_sft import EXTENSIONS_DIR, launch

from fused_stable.errors import UserError
from fused_stable.train.config.resolve import resolve_config

# hiyouga/LLaMA-Factory at ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30 (2026-08-18): `git show HEAD:<path>`, verbatim
LF_COMMIT = "ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30"

# examples/train_lora/qwen3_lora_sft.yaml
LORA = """\
### model
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: qwen3_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-4b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# eval_dataset: alpaca_en_demo
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""

# examples/train_qlora/qwen3_lora_sft_otfq.yaml
QLORA_OTFQ = """\
### model
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507
quantization_bit: 4  # choices: [8 (bnb/hqq/eetq), 4 (bnb/hqq), 3 (hqq), 2 (hqq)]
quantization_method: bnb  # choices: [bnb, hqq, eetq]
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: qwen3_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-4b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000

### eval
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""

# examples/train_full/qwen3_full_sft.yaml
FULL = """\
### model
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: full
deepspeed: examples/deepspeed/ds_z3_config.json  # choices: [ds_z0_config.json, ds_z2_config.json, ds_z3_config.json]

### dataset
dataset: identity,alpaca_en_demo
template: qwen3_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-4b/full/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
learning_rate: 1.0e-5
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# eval_dataset: alpaca_en_demo
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""

# examples/train_lora/qwen3_lora_sft_ds3.yaml
LORA_DS3 = """\
### model
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
deepspeed: examples/deepspeed/ds_z3_config.json  # choices: [ds_z0_config.json, ds_z2_config.json, ds_z3_config.json]

### dataset
dataset: identity,alpaca_en_demo
template: qwen3_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-4b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### eval
# eval_dataset: alpaca_en_demo
# val_size: 0.1
# per_device_eval_batch_size: 1
# eval_strategy: steps
# eval_steps: 500
"""

# examples/deepspeed/ds_z3_config.json
DS_Z3 = """\
{
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": "auto",
  "zero_allow_untested_optimizer": true,
  "fp16": {
    "enabled": "auto",
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "bf16": {
    "enabled": "auto"
  },
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": false,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  }
}
"""

EXAMPLES = {
    "examples/train_lora/qwen3_lora_sft.yaml": LORA,
    "examples/train_qlora/qwen3_lora_sft_otfq.yaml": QLORA_OTFQ,
    "examples/train_full/qwen3_full_sft.yaml": FULL,
    "examples/train_lora/qwen3_lora_sft_ds3.yaml": LORA_DS3,
    "examples/deepspeed/ds_z3_config.json": DS_Z3,
}
# data/dataset_info.json's entries for the two datasets the examples name (LF's, as they are)
DATASET_INFO = {"identity": {"file_name": "identity.json"}, "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"}}
ROWS = {"identity": 91, "alpaca_en_demo": 999}
MIXED = "datasets: identity 91 + alpaca_en_demo 999 = 1090 examples (max_samples 1000: at most the first 1000 of each)"
ONLY = ("--model", "tiny", "--max_steps", "2")  # all that is added to each example

_QUESTIONS = ("hi", "Who are you?", "What is your name?", "Who made you?", "Can you introduce yourself?")
_ANSWERS = (
    "Hello! I am {{name}}, an AI assistant developed by {{author}}. How can I assist you today?",
    "I am {{name}}, an AI assistant trained by {{author}}.",
    "You may refer to me as {{name}}.",
)
_WORDS = "the a model answer data step list write short poem colour river explain three reasons why how".split()


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def identity_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows shaped as LF's identity.json: alpaca fields, empty input, answers with {{name}} / {{author}}."""
    rng = random.Random(seed)
    return [
        {"instruction": f"{rng.choice(_QUESTIONS)} ({i})", "input": "", "output": rng.choice(_ANSWERS)}
        for i in range(n)
    ]


def alpaca_rows(n: int, seed: int = 1) -> list[dict]:
    """Rows shaped as LF's alpaca_en_demo.json: instruction, an input on about two rows in five, output."""
    rng = random.Random(seed)
    return [
        {
            "instruction": f"{_words(rng, 3, 10)} ({i})",
            "input": _words(rng, 2, 8) if rng.random() < 0.4 else "",
            "output": _words(rng, 4, 24),
        }
        for i in range(n)
    ]


def lf_layout(root) -> None:
    """LLaMA-Factory's checkout as the examples expect it, under `root`: data/ and the example files."""
    data = root / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=2))
    (data / "identity.json").write_text(json.dumps(identity_rows(ROWS["identity"]), indent=2))
    (data / "alpaca_en_demo.json").write_text(json.dumps(alpaca_rows(ROWS["alpaca_en_demo"]), indent=2))
    for path, text in EXAMPLES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


@pytest.fixture
def lf_root(tmp_path, monkeypatch):
    lf_layout(tmp_path)
    monkeypatch.chdir(tmp_path)  # the examples' paths (data/, examples/deepspeed/, saves/) are relative
    return tmp_path


def test_the_layout_is_lfs():
    """What the examples rely on, as LF ships it: the two datasets mixed, max_samples 1000 (above both
    sizes), bf16, and the ZeRO-3 file with every size "auto"."""
    import yaml

    for path in EXAMPLES:
        if path.endswith(".yaml"):
            keys = yaml.safe_load(EXAMPLES[path])
            assert keys["dataset"] == "identity,alpaca_en_demo" and keys["max_samples"] == 1000 and keys["bf16"]
    assert "eval_dataset" not in yaml.safe_load(LORA)  # commented out in LF's file
    assert json.loads(DS_Z3)["zero_optimization"]["stage"] == 3
    assert all("{{name}}" in row["output"] for row in identity_rows(91))


def _keys_of(text: str) -> list[str]:
    """Every key of an example file, those of its commented-out eval block too."""
    return [line.lstrip("# ").split(":")[0] for line in text.splitlines() if ":" in line and "###" not in line]


def test_every_key_of_the_four_examples_is_read_and_documented():
    """Each key is ours or a mapped LLaMA-Factory key (none refused), and has its row in docs/trainer.md's
    anchor table."""
    from sft_helpers import REPO_ROOT

    from fused_stable.train.config import foreign_configs
    from fused_stable.train.config.keys import FIELDS

    keys = sorted({key for path, text in EXAMPLES.items() if path.endswith(".yaml") for key in _keys_of(text)})
    assert "eval_dataset" in keys and "quantization_method" in keys and "deepspeed" in keys
    assert [k for k in keys if k not in FIELDS and k not in foreign_configs.KEYS] == []
    with open(f"{REPO_ROOT}/docs/trainer.md", encoding="utf-8") as f:
        docs = f.read()
    table = docs[docs.index("## Coming from LLaMA-Factory / ms-swift") :]
    assert [k for k in keys if f"`{k}`" not in table] == []
    assert "test_llamafactory_examples.py" in table[table.index("### LLaMA-Factory's own examples") :]


@pytest.mark.parametrize(
    ("example", "header"),
    [
        ("examples/train_lora/qwen3_lora_sft.yaml", "tuner=lora precision=bf16"),
        ("examples/train_qlora/qwen3_lora_sft_otfq.yaml", "tuner=lora quant_bits=4 precision=bf16"),
    ],
)
def test_an_lf_lora_example_trains_as_shipped(sft, lf_root, example, header):
    code, stdout, err = sft("--config", example, *ONLY)
    assert code == 0, err
    assert MIXED in stdout
    assert "eval_dataset" not in stdout and "evaluation every" not in stdout  # its eval block is commented out
    assert f"model=tiny {header} device=cpu" in stdout and "| 1,090 examples | 2 steps x 8 x 1 |" in stdout
    assert [row["step"] for row in read_metrics(lf_root / "saves/qwen3-4b/lora/sft")][-1] == 2
    assert (lf_root / "saves/qwen3-4b/lora/sft/adapter").is_dir()


def _deepspeed_env() -> dict:
    clean = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in clean}
    return {**env, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_DIR)}


def _check_zero3(out, world_size: int) -> None:
    """The run went through DeepSpeed's ZeRO-3 engine: its final checkpoint is the engine's, at stage 3."""
    state = json.loads((out / "checkpoints/step-2/trainer_state.json").read_text())
    assert state["zero_stage"] == 3 and state["world_size"] == world_size, state
    assert any("optim_states" in f.name for f in (out / "checkpoints/step-2/deepspeed").iterdir())


@pytest.mark.slow
def test_the_lf_full_zero3_example_trains_as_shipped(lf_root):
    """One process, no launcher (DeepSpeed starts its process group of one), ZeRO-3 over the whole model."""
    example = "examples/train_full/qwen3_full_sft.yaml"
    cmd = [sys.executable, "-m", "fused_stable", "sft", "--config", example, *ONLY]
    proc = subprocess.run(cmd, cwd=lf_root, env=_deepspeed_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert MIXED in proc.stdout and "tuner=full precision=bf16" in proc.stdout
    _check_zero3(lf_root / "saves/qwen3-4b/full/sft", world_size=1)
    assert (lf_root / "saves/qwen3-4b/full/sft/model/model.safetensors").is_file()


@pytest.mark.slow
def test_the_lf_lora_zero3_example_trains_as_shipped_on_two_ranks(lf_root):
    proc = launch("torchrun", "--config", "examples/train_lora/qwen3_lora_sft_ds3.yaml", *ONLY, cwd=lf_root)
    assert MIXED in proc.stdout and "tuner=lora precision=bf16" in proc.stdout
    assert proc.stdout.count("done: steps 0->2") == 1
    _check_zero3(lf_root / "saves/qwen3-4b/lora/sft", world_size=2)
    assert (lf_root / "saves/qwen3-4b/lora/sft/adapter").is_dir()


# ------------------------------------------------------------------------------------------ eval_dataset
def _with_eval(root, eval_dataset: str, extra: str = "") -> str:
    """LF's LoRA example with its commented eval_dataset line turned on (as a user does), naming `eval_dataset`."""
    text = LORA.replace("# eval_dataset: alpaca_en_demo", f"eval_dataset: {eval_dataset}\n{extra}")
    assert text != LORA
    (root / "with_eval.yaml").write_text(text)
    return "with_eval.yaml"


@pytest.mark.parametrize(
    ("eval_dataset", "extra", "held_out"),
    [
        ("alpaca_en_demo", "", "eval_dataset: alpaca_en_demo 20 examples"),
        ("identity,alpaca_en_demo", "", "eval_datasets: identity 20 + alpaca_en_demo 20 = 40 examples"),
        # interleave_under stops when the first dataset runs out: about twice its 20 with even probabilities
        (
            "identity,alpaca_en_demo",
            "mix_strategy: interleave_under\ninterleave_probs: 0.5,0.5",
            "eval_datasets: identity 20 + alpaca_en_demo 20 = {n} examples (max_samples 20",
        ),
    ],
)
def test_eval_dataset_loads_and_mixes_as_dataset_does(lf_root, capsys, eval_dataset, extra, held_out):
    setup = setup_run("--config", _with_eval(lf_root, eval_dataset, extra), *ONLY, "--max_samples", "20")
    try:
        out = capsys.readouterr().out
        measured = setup.trainer.evaluator.examples["eval_loss"]
        assert held_out.format(n=measured) in out, out
        if "interleave" in extra:
            assert "mixed by interleave_under" in out and 20 < measured < 40
        else:
            assert measured == held_out.count(" 20") * 20
        assert f"eval_dataset: alpaca_en_demo -> eval_dataset: {os.path.join('data', 'alpaca_en_demo.json')}" in out
        # the training data is used whole (eval_dataset replaces the split), mixed as the held-out set is
        assert setup.n_examples == (measured if "interleave" in extra else 40)
    finally:
        setup.release()


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ("val_size: 0.1", "eval_dataset and val_size=0.1 both choose the held-out set: give one of them"),
        (
            "mix_strategy: interleave_over\ninterleave_probs: 0.2,0.3,0.5",
            "is mixed as dataset is: interleave_probs gives 3 probabilities for 2 datasets",
        ),
    ],
)
def test_eval_dataset_refusals(lf_root, extra, error):
    three = ("--dataset", "identity,alpaca_en_demo,identity")  # interleave_probs fits the training data
    with pytest.raises(UserError, match=error):
        resolve_config(["--config", _with_eval(lf_root, "identity,alpaca_en_demo", extra), *three, *ONLY])
