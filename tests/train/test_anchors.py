"""LLaMA-Factory and ms-swift configs run as they are (train/config/foreign_configs.py): their keys mapped onto sft's,
the mapping printed once, the keys that cannot be honoured refused in one line, LLaMA-Factory's defaults for
what its config leaves out, dataset_info.json, and the hints for near-misses. Config-only: nothing trains here
(tests/train/test_examples.py trains from the examples/ config of each anchor)."""

import dataclasses
import json

import pytest
import yaml

from fused_stable.errors import UserError
from fused_stable.train.config import foreign_configs
from fused_stable.train.config.resolve import resolve_config, warmup_steps


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def resolve(*argv):
    lines = []
    cfg, explicit = resolve_config([str(a) for a in argv], log=lines.append)
    return cfg, explicit, lines


LLAMAFACTORY = """\
model_name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 16
lora_target: all
quantization_bit: 4
dataset: identity
template: smollm2
cutoff_len: 1024
learning_rate: 2.0e-4
num_train_epochs: 2.0
max_steps: -1
per_device_train_batch_size: 2
gradient_accumulation_steps: 4
lr_scheduler_type: constant_with_warmup
warmup_steps: 5
max_grad_norm: 0.5
bf16: true
logging_steps: 5
save_steps: 50
output_dir: runs/lf
overwrite_output_dir: true
report_to: none
seed: 7
"""


def test_a_llamafactory_config_maps_every_key(tmp_path):
    cfg, explicit, lines = resolve("--config", write(tmp_path, LLAMAFACTORY))
    got = {k: getattr(cfg, k) for k in ("model", "tuner", "lora_r", "target_modules", "quant_bits", "dataset")}
    assert got == {
        "model": "smollm2-135m",
        "tuner": "lora",
        "lora_r": 16,
        "target_modules": "all-linear",
        "quant_bits": 4,
        "dataset": "identity",
    }
    got = {k: getattr(cfg, k) for k in ("max_length", "lr", "epochs", "max_steps", "batch_size", "grad_accum")}
    assert got == {"max_length": 1024, "lr": 2e-4, "epochs": 2.0, "max_steps": None, "batch_size": 2, "grad_accum": 4}
    got = {k: getattr(cfg, k) for k in ("scheduler", "warmup_steps", "max_grad_norm", "precision", "logging_steps")}
    assert got == {
        "scheduler": "constant",
        "warmup_steps": 5,
        "max_grad_norm": 0.5,
        "precision": "bf16",
        "logging_steps": 5,
    }
    assert (cfg.save_steps, cfg.output_dir, cfg.overwrite, cfg.report_to, cfg.seed) == (50, "runs/lf", True, "none", 7)
    # LLaMA-Factory's lora_alpha default is 2 x lora_rank; its (HF Trainer's) weight decay is 0
    assert (cfg.lora_alpha, cfg.weight_decay) == (32, 0.0)
    assert {"lr", "tuner", "lora_r", "quant_bits", "max_length"} <= explicit
    # the mapping, printed once: one block naming each key with what it became
    assert len(lines) == 1
    assert lines[0].startswith("LLaMA-Factory keys read as fused-stable sft's:")
    assert "  lora_target: all -> target_modules: all-linear" in lines[0].splitlines()
    assert "  learning_rate: 0.0002 -> lr: 0.0002" in lines[0].splitlines()
    assert "  quantization_bit: 4 -> quant_bits: 4" in lines[0].splitlines()


def test_llamafactory_defaults_are_the_hf_trainers(tmp_path):
    """What a LLaMA-Factory config leaves out is LLaMA-Factory's default, which is the installed HF Trainer's
    where it comes from TrainingArguments (LLaMA-Factory's own: cutoff_len 2048, lora_target all)."""
    from transformers import TrainingArguments

    hf = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    defaults = foreign_configs.ANCHOR_DEFAULTS[foreign_configs.LLAMA_FACTORY]
    names = {
        "lr": "learning_rate",
        "weight_decay": "weight_decay",
        "epochs": "num_train_epochs",
        "batch_size": "per_device_train_batch_size",
        "scheduler": "lr_scheduler_type",
    }
    assert {ours: defaults[ours] for ours in names} == {ours: hf[theirs] for ours, theirs in names.items()}
    assert hf["warmup_steps"] == defaults["warmup_ratio"] == 0

    cfg, explicit, lines = resolve("--config", write(tmp_path, "stage: sft\nfinetuning_type: lora\n"))
    assert (cfg.lr, cfg.weight_decay, cfg.epochs, cfg.batch_size, cfg.scheduler) == (5e-5, 0.0, 3.0, 8, "linear")
    assert (cfg.warmup_ratio, cfg.max_length, cfg.lora_alpha) == (0.0, 2048, 2 * cfg.lora_r)
    assert "LLaMA-Factory's defaults for the keys not given: lr: 5e-05" in lines[0]
    # flags still win over both, and our own config keeps our defaults
    cfg, _, _ = resolve("--config", write(tmp_path, "stage: sft\n"), "--lr", "3e-4")
    assert cfg.lr == 3e-4
    ours, _, lines = resolve("--config", write(tmp_path, "lr: 1.0e-3\n"))
    assert (ours.weight_decay, ours.epochs, lines) == (0.01, 1.0, [])


def test_keys_that_cannot_be_honoured_are_refused_in_one_line(tmp_path):
    config = write(tmp_path, "stage: dpo\nuse_rslora: true\nfinetuning_type: freeze\nlearning_rate: 1.0e-4\n")
    with pytest.raises(UserError) as info:
        resolve("--config", config)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{config}: keys fused-stable sft cannot honour: ")
    for part in ("stage: dpo (only stage: sft", "rank-stabilised LoRA", "finetuning_type: freeze"):
        assert part in message
    assert "learning_rate" not in message, "a key that maps is not listed with the refused ones"
    # a refused key at its off value asks for nothing: accepted, and said so
    cfg, _, lines = resolve("--config", write(tmp_path, "stage: sft\nuse_rslora: false\n"))
    assert "use_rslora: False -> off, nothing to map" in lines[0]


def test_held_out_evaluation_keys_map_onto_ours(tmp_path):
    text = "stage: sft\nval_size: 0.1\neval_strategy: steps\neval_steps: 5\nper_device_eval_batch_size: 1\n"
    arithmetic = ("--dataset", "arithmetic")  # val_size does not apply to the identity task (its own held-out set)
    cfg, _, lines = resolve("--config", write(tmp_path, text), *arithmetic)
    assert (cfg.val_size, cfg.eval_steps) == (0.1, 5)
    assert "\n  per_device_eval_batch_size: 1 -> no effect" in lines[0]
    cfg, _, _ = resolve("--config", write(tmp_path, 'stage: sft\nval_size: 8\neval_strategy: "no"\n'), *arithmetic)
    assert (cfg.val_size, cfg.eval_steps) == (8, 0), "eval_strategy: no turns the evaluations off"
    cfg, _, _ = resolve("--config", write(tmp_path, "stage: sft\nval_size: 8\neval_strategy: no\n"), *arithmetic)
    assert cfg.eval_steps == 0, "an unquoted no (YAML's false) is eval_strategy: no"
    cfg, _, _ = resolve("--config", write(tmp_path, "train_type: lora\nsplit_dataset_ratio: 0.05\n"), *arithmetic)
    assert cfg.val_size == 0.05, "ms-swift's split_dataset_ratio is val_size"
    with pytest.raises(UserError, match="eval_strategy: epoch .*use eval_strategy: steps"):
        resolve("--config", write(tmp_path, "stage: sft\neval_strategy: epoch\n"))


@pytest.mark.parametrize(
    ("yaml_text", "problem"),
    [
        ("learning_rate: 1.0e-4\nlr: 1.0e-3\n", "sets lr twice"),
        ("finetuning_type: lora\ntrain_type: lora\n", "mix LLaMA-Factory's (finetuning_type) and ms-swift's"),
        ("bf16: true\nfp16: true\n", "fp16: True (contradicts bf16: True)"),
        ("finetuning_type: full\nuse_dora: true\n", "DoRA needs finetuning_type: lora"),
        ("stage: sft\ntemplate: llama3\n", "template: llama3 cannot be honoured"),
    ],
)
def test_contradictions_are_refused(tmp_path, yaml_text, problem):
    with pytest.raises(UserError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        resolve("--config", write(tmp_path, yaml_text))


def test_ms_swift_flags_map_on_the_command_line():
    cfg, explicit, lines = resolve(
        "--train_type", "lora", "--model", "tiny", "--dataset", "swift/self-cognition", "--lora_rank", "4",
        "--quant_bits", "4", "--use_dora", "--torch_dtype", "bfloat16", "--model_author", "Me",
    )  # fmt: skip
    assert (cfg.tuner, cfg.model, cfg.dataset, cfg.lora_r, cfg.quant_bits) == ("dora", "tiny", "identity", 4, 4)
    assert (cfg.precision, cfg.identity_author) == ("bf16", "Me")
    assert lines[0].startswith("ms-swift keys read as fused-stable sft's:")
    assert "  dataset: swift/self-cognition -> dataset: identity" in lines[0].splitlines()
    # ms-swift's defaults are not applied: what its flags leave out keeps fused-stable's
    assert (cfg.lr, cfg.weight_decay) == (1e-3, 0.01)


def test_ms_swift_yaml_lists(tmp_path):
    config = write(tmp_path, "train_type: lora\ntarget_modules: [q_proj, v_proj]\nmodel_name: [小黄, Xiao Huang]\n")
    cfg, _, _ = resolve("--config", config)
    assert (cfg.target_modules, cfg.identity_name) == ("q_proj,v_proj", "Xiao Huang")


@pytest.mark.parametrize(
    ("flag", "suggested"),
    [
        ("--finetuning_typ", "--finetuning_type"),
        ("--quantisation_bit", "--quantization_bit"),
        ("--lora_targets", "--lora_target"),
    ],
)
def test_misspelt_anchor_keys_get_a_did_you_mean(flag, suggested):
    with pytest.raises(UserError, match=f"did you mean {suggested}\\?"):
        resolve(flag, "x")


def test_qlora_as_a_tuner_says_what_it_is():
    with pytest.raises(UserError, match=r"got 'qlora'; QLoRA is --tuner lora --quant_bits 4"):
        resolve("--tuner", "qlora")


def test_yaml_booleans_for_on_off_keys(tmp_path):
    cfg, _, _ = resolve("--config", write(tmp_path, "evaluation: off\n"))
    assert cfg.evaluation == "off"
    cfg, _, _ = resolve("--config", write(tmp_path, "evaluation: on\n"))
    assert cfg.evaluation == "on"
    with pytest.raises(UserError, match=r"identity_name in .* got True \(YAML reads unquoted .*quote the value"):
        resolve("--config", write(tmp_path, "identity_name: yes\n"))


@pytest.mark.parametrize(
    ("ratio", "total", "steps"), [(0.1, 27, 3), (0.1, 30, 3), (0.05, 100, 5), (0.15, 7, 2), (0.0, 10, 0)]
)
def test_warmup_ratio_is_rounded_as_the_hf_trainer_rounds_it(tmp_path, ratio, total, steps):
    """The installed transformers' TrainingArguments.get_warmup_steps is the reference (a ratio as warmup_steps
    below 1 in transformers 5, warmup_ratio in 4): a ratio is rounded up."""
    from transformers import TrainingArguments

    hf = TrainingArguments(output_dir=str(tmp_path), warmup_steps=ratio, report_to="none").get_warmup_steps(total)
    cfg, _, _ = resolve("--warmup_ratio", ratio)
    assert warmup_steps(cfg, total) == hf == steps
    cfg, _, _ = resolve("--warmup_ratio", ratio, "--warmup_steps", 2)
    assert warmup_steps(cfg, total) == 2, "warmup_steps above 0 overrides warmup_ratio"


@pytest.mark.parametrize(("keys", "total", "asked", "taken"), [((), 1, 1, 0), (("--warmup_steps", 10), 5, 10, 4)])
def test_a_warmup_as_long_as_the_run_is_cut_to_leave_a_step_at_the_peak_lr(tmp_path, keys, total, asked, taken):
    """Where the HF Trainer's warm-up covers the whole run (`--max_steps 1`: ceil(0.1 x 1) = 1 step, its only step
    at lr 0, which trains nothing), the run warms up over total - 1 steps instead."""
    from transformers import TrainingArguments

    from fused_stable.train.config.resolve import warmup_asked

    cfg, _, _ = resolve(*keys)
    hf = TrainingArguments(output_dir=str(tmp_path), warmup_steps=cfg.warmup_steps or cfg.warmup_ratio)
    assert warmup_asked(cfg, total) == hf.get_warmup_steps(total) == asked
    assert warmup_steps(cfg, total) == taken


# ---------------------------------------------------------------------------------------------- dataset_info.json
def dataset_dir(tmp_path, info, rows=None):
    folder = tmp_path / "data"
    folder.mkdir(exist_ok=True)
    (folder / "dataset_info.json").write_text(json.dumps(info))
    (folder / "mine.json").write_text(json.dumps(rows or [{"instruction": "Hi?", "output": "Hello."}]))
    return folder


def test_dataset_info_names_the_file(tmp_path):
    folder = dataset_dir(tmp_path, {"mine": {"file_name": "mine.json"}, "chats": {"file_name": "mine.json"}})
    config = write(tmp_path, f"stage: sft\ndataset: mine\ndataset_dir: {folder}\n")
    cfg, _, lines = resolve("--config", config)
    assert cfg.dataset == str(folder / "mine.json")
    assert f"  dataset: mine -> dataset: {folder / 'mine.json'} ({folder / 'dataset_info.json'})" in lines[0]
    with pytest.raises(UserError, match=r"dataset 'theirs' is not in .*dataset_info.json \(it names: chats, mine\)"):
        resolve("--config", write(tmp_path, f"stage: sft\ndataset: theirs\ndataset_dir: {folder}\n"))


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"hf_hub_url": "tatsu-lab/alpaca"}, "fetched from hf_hub_url and runs here offline"),
        ({"file_name": "mine.json", "columns": {"prompt": "question"}}, "columns.prompt: 'question'"),
        ({"file_name": "mine.json", "formatting": "sharegpt", "tags": {"role_tag": "role"}}, "tags.role_tag: 'role'"),
        ({"file_name": "mine.json", "ranking": True}, "ranking"),
        ({"file_name": ".", "formatting": "alpaca"}, "is a directory"),
    ],
)
def test_dataset_info_entries_that_cannot_be_read_are_refused(tmp_path, entry, problem):
    folder = dataset_dir(tmp_path, {"mine": entry})
    with pytest.raises(UserError, match=problem):
        resolve("--config", write(tmp_path, f"stage: sft\ndataset: mine\ndataset_dir: {folder}\n"))


def test_identity_without_an_entry_is_the_built_in_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # LLaMA-Factory's dataset_dir defaults to ./data
    cfg, _, lines = resolve("--config", write(tmp_path, "stage: sft\ndataset: identity\n"))
    assert cfg.dataset == "identity"
    assert "dataset: identity -> the built-in identity task" in lines[0]
    with pytest.raises(UserError, match=r"dataset 'alpaca_en_demo': data/dataset_info.json not found"):
        resolve("--config", write(tmp_path, "stage: sft\ndataset: alpaca_en_demo\n"))


def test_every_anchor_key_is_in_the_docs():
    from sft_helpers import REPO_ROOT

    with open(f"{REPO_ROOT}/docs/trainer.md", encoding="utf-8") as f:
        docs = f.read()
    section = docs[docs.index("## Coming from LLaMA-Factory / ms-swift") :]
    missing = [name for name in [*foreign_configs.KEYS, *foreign_configs.REFUSED] if f"`{name}`" not in section]
    assert not missing, f"docs/trainer.md's anchor section lacks {missing}"


def test_examples_in_each_anchors_format_load():
    from sft_helpers import REPO_ROOT

    for name, anchor in (
        ("llamafactory_lora_sft", foreign_configs.LLAMA_FACTORY),
        ("ms_swift_lora_sft", foreign_configs.MS_SWIFT),
    ):
        path = f"{REPO_ROOT}/examples/{name}.yaml"
        with open(path, encoding="utf-8") as f:
            keys = set(yaml.safe_load(f))
        assert foreign_configs.anchor_of(keys) == anchor
        cfg, _, lines = resolve("--config", path)
        assert (cfg.model, cfg.dataset, cfg.tuner) == ("smollm2-135m", "identity", "lora")
        assert lines[0].startswith(f"{anchor} keys read as fused-stable sft's:")


def test_ms_swift_current_tuner_type_and_the_4bit_compute_dtype():
    """swift's current `--tuner_type` (issue 40 item 1) and `--bnb_4bit_compute_dtype`, which sets the run's
    precision (item 4): the same value as `--torch_dtype` is one setting; a different one is refused."""
    cfg, _, lines = resolve(
        "--tuner_type", "lora", "--model", "tiny", "--dataset", "swift/self-cognition", "--quant_bits", "4",
        "--bnb_4bit_compute_dtype", "bfloat16", "--torch_dtype", "bfloat16",
    )  # fmt: skip
    assert (cfg.tuner, cfg.quant_bits, cfg.precision) == ("lora", 4, "bf16")
    assert "  tuner_type: lora -> tuner: lora" in lines[0].splitlines()
    cfg, _, _ = resolve("--tuner_type", "full", "--model", "tiny", "--dataset", "swift/self-cognition")
    assert cfg.tuner == "full"
    with pytest.raises(UserError, match="tuner_type"):
        resolve("--tuner_type", "boft", "--model", "tiny", "--dataset", "swift/self-cognition")
    with pytest.raises(UserError, match=r"torch_dtype: bfloat16 \(contradicts bnb_4bit_compute_dtype: float16\)"):
        resolve(
            "--model", "tiny", "--dataset", "swift/self-cognition", "--quant_bits", "4",
            "--bnb_4bit_compute_dtype", "float16", "--torch_dtype", "bfloat16",
        )  # fmt: skip


@pytest.mark.parametrize(
    ("file_keys", "flag", "precision"),
    [
        ("bf16: true", ("--bf16", "false"), "fp32"),  # flags over the file: LF with neither key is fp32
        ("fp16: true", ("--fp16", "false"), "fp32"),
        ("fp16: true", ("--bf16", "false"), "fp16"),  # turning off what was not on changes nothing
        ("bf16: false", (), "auto"),  # false alone sets nothing: the run's default
        ("bf16: true", ("--bf16", "true"), "bf16"),
    ],
)
def test_a_flags_false_undoes_the_files_true_precision(tmp_path, file_keys, flag, precision):
    cfg, _, lines = resolve("--config", write(tmp_path, f"stage: sft\n{file_keys}\n"), *flag, "--dataset", "arithmetic")
    assert cfg.precision == precision
    assert ("false over the earlier true -> precision: fp32" in lines[0]) == (precision == "fp32")


@pytest.mark.parametrize(
    ("optim", "rule", "precision", "paged"),
    [
        ("adamw_torch", "adamw", "fp32", False),
        ("adamw_torch_fused", "adamw", "fp32", False),
        ("adamw_hf", "adamw", "fp32", False),
        ("paged_adamw_32bit", "adamw", "fp32", True),
        ("adamw_bnb_8bit", "adamw", "8bit", False),
        ("adamw_8bit", "adamw", "8bit", False),
        ("paged_adamw_8bit", "adamw", "8bit", True),
        ("lion_32bit", "lion", "fp32", False),
        ("paged_lion_32bit", "lion", "fp32", True),
        ("lion_8bit", "lion", "8bit", False),
        ("paged_lion_8bit", "lion", "8bit", True),
    ],
)
def test_the_hf_trainers_optim_names_set_the_rule_and_state_precision(tmp_path, optim, rule, precision, paged):
    """`optim:` (issue 35 item 6): an AdamW or Lion name is our rule with the state it names (two of our keys),
    and the mapping's line says what the optimizer and state are, and that a paged one is not paged."""
    cfg, explicit, lines = resolve("--config", write(tmp_path, f"stage: sft\noptim: {optim}\n"))
    assert (cfg.optim, cfg.state_precision) == (rule, precision)
    assert {"optim", "state_precision"} <= explicit
    line = next(line for line in lines[0].splitlines() if line.strip().startswith("optim:"))
    title = {"adamw": "FusedAdamW", "lion": "FusedLion"}[rule]
    assert line.strip() == (
        f"optim: {optim} -> optim: {rule}, state_precision: {precision} ({title}, "
        + ("8-bit blockwise state" if precision == "8bit" else "fp32 state")
        + (", not paged: it stays beside the params)" if paged else ")")
    )
    # the flag is read the same way (ms-swift's --optim)
    cfg, _, _ = resolve("--optim", optim, "--model", "tiny", "--dataset", "swift/self-cognition")
    assert (cfg.optim, cfg.state_precision) == (rule, precision)


def test_every_mapped_optim_name_is_the_hf_trainers():
    from transformers.training_args import OptimizerNames

    from fused_stable.integrations import optim_names

    names = {o.value for o in OptimizerNames}
    # adamw_hf is transformers' old AdamW, dropped from OptimizerNames; older configs still name it
    assert set(optim_names.OPTIMS) - names == {"adamw_hf"}
    # every AdamW and Lion name transformers has is mapped, but the 4-bit and the XLA/NPU-only names' kin
    adamw_or_lion = {n for n in names if n.startswith(("adamw", "paged_adamw", "lion", "paged_lion"))}
    assert adamw_or_lion - set(optim_names.OPTIMS) == {"adamw_anyprecision", "adamw_torch_4bit"}
    # transformers' own reading of a name: "lion" in it is bitsandbytes' Lion, "8bit" in it 8-bit state
    for name, entry in optim_names.OPTIMS.items():
        assert entry.rule == ("lion" if "lion" in name else "sgd" if name == "sgd" else "adamw")
        assert entry.state_precision == ("8bit" if "8bit" in name else "fp32")
    # our own rule names are transformers' where they mean the same rule (`sgd`: torch.optim.SGD either way);
    # `optim: lion` is ours, `optim: lion_8bit` the HF Trainer's. `adafactor` is both spellings of two algorithms:
    # ours is torch.optim.Adafactor (a config's `optim: adafactor` is our key: FusedAdafactor, the header says so),
    # the HF Trainer's is transformers' Adafactor, which fused_trainer_optimizers refuses saying why
    shared = names & set(foreign_configs.RULE_NAMES)
    assert shared == {"sgd", "adafactor"} and optim_names.OPTIMS["sgd"].rule == "sgd"
    assert (
        "adafactor" not in optim_names.OPTIMS and "transformers' own Adafactor" in optim_names.NOT_MAPPED["adafactor"]
    )


def test_our_optim_key_chooses_the_rule_and_its_default_lr(tmp_path):
    cfg, explicit, lines = resolve("--config", write(tmp_path, "optim: lion\n"))
    assert (cfg.optim, cfg.state_precision, lines) == ("lion", "fp32", [])
    # no lr given: every rule's default is the same (measured: docs/trainer.md, "The update rule")
    assert cfg.lr == 1e-3 and "lr" not in explicit
    assert resolve("--optim", "adamw")[0].lr == 1e-3
    assert resolve("--optim", "lion", "--lr", "2e-4")[0].lr == 2e-4, "a given lr is kept"
    # LLaMA-Factory's default lr (5e-5) for its Lion too, and the mapping says the lr the run has
    cfg, _, lines = resolve("--config", write(tmp_path, "stage: sft\noptim: lion_8bit\n"))
    assert cfg.lr == 5e-5
    assert f"defaults for the keys not given: lr: {cfg.lr}, weight_decay: 0.0" in lines[0]
    with pytest.raises(UserError, match=r"optim must be one of adamw \| lion \| muon \| sgd"):
        resolve_config([], base={"optim": "rmsprop"})


def test_use_muon_is_optim_muon(tmp_path):
    cfg, _, lines = resolve("--config", write(tmp_path, "stage: sft\nuse_muon: true\n"))
    assert cfg.optim == "muon" and "  use_muon: True -> optim: muon" in lines[0].splitlines()
    cfg, _, lines = resolve("--config", write(tmp_path, "stage: sft\nuse_muon: false\n"))
    assert cfg.optim == "adamw" and "  use_muon: False -> off, optim as given" in lines[0].splitlines()
    # as in LLaMA-Factory, use_muon: true builds Muon whatever AdamW name optim gives; a Lion name contradicts it
    cfg, _, _ = resolve("--config", write(tmp_path, "stage: sft\noptim: adamw_8bit\nuse_muon: true\n"))
    assert (cfg.optim, cfg.state_precision) == ("muon", "8bit")
    with pytest.raises(UserError, match=r"use_muon: True \(contradicts optim: lion_8bit\)$"):
        resolve("--config", write(tmp_path, "stage: sft\noptim: lion_8bit\nuse_muon: true\n"))


def test_swifts_optimizer_muon_is_optim_muon_with_the_lora_factors_on_muon():
    """ms-swift's --optimizer muon puts every 2-D trainable param but the embedding and head on Muon, LoRA factors
    included: optim muon + muon_lora, with a full fine-tune too (no factor there); `default` sets nothing; swift's
    other optimizers are refused naming the supported ones."""
    cfg, _, lines = resolve("--model", "tiny", "--optimizer", "muon")
    assert (cfg.optim, cfg.muon_lora, cfg.tuner) == ("muon", True, "lora")
    assert "  optimizer: muon -> optim: muon, muon_lora: True" in lines[0].splitlines()
    cfg, _, _ = resolve("--model", "tiny", "--optimizer", "muon", "--train_type", "full")
    assert (cfg.optim, cfg.muon_lora, cfg.tuner) == ("muon", True, "full")
    cfg, _, lines = resolve("--model", "tiny", "--optimizer", "default", "--train_type", "lora")
    assert (cfg.optim, cfg.muon_lora) == ("adamw", False)
    assert "  optimizer: default -> swift's default optimizer: the rule optim names (adamw)" in lines[0].splitlines()
    with pytest.raises(UserError, match=r"optimizer: galore \(not supported here \(supported: muon, default\)\)$"):
        resolve("--optimizer", "galore")


def test_other_optimizers_are_refused_naming_what_is_supported(tmp_path):
    from fused_stable.integrations.optim_names import OPTIMS
    from fused_stable.train.config.keys import CHOICES

    for name in ("rmsprop", "adamw_torch_4bit"):
        config = write(tmp_path, f"stage: sft\noptim: {name}\n")
        with pytest.raises(UserError) as info:
            resolve("--config", config)
        assert str(info.value) == (
            f"{config}: keys fused-stable sft cannot honour: optim: {name} (no fused rule for it; supported optim "
            f"values: {' | '.join(CHOICES['optim'])}, or the HF Trainer's {', '.join(OPTIMS)})"
        )
    assert "adamw | lion | muon | sgd" in " | ".join(CHOICES["optim"]) and "paged_lion_8bit, sgd" in ", ".join(OPTIMS)
    with pytest.raises(UserError, match=r"optim: rmsprop \(no fused rule"):
        resolve("--optim", "rmsprop")


@pytest.mark.parametrize(
    ("file", "flags", "expected"),
    [
        ("optim: lion_8bit\n", ("--state_precision", "fp32"), ("lion", "fp32")),  # a flag wins over the file
        ("optim: lion_8bit\n", ("--optim", "adamw"), ("adamw", "8bit")),
        ("optim: adamw_8bit\n", ("--optim", "lion_32bit"), ("lion", "fp32")),  # the flag's optim sets both
        ("state_precision: bf16\n", ("--optim", "lion_8bit"), ("lion", "8bit")),
    ],
)
def test_a_flag_wins_over_the_files_optim(tmp_path, file, flags, expected):
    cfg, _, _ = resolve("--config", write(tmp_path, f"stage: sft\n{file}"), *flags)
    assert (cfg.optim, cfg.state_precision) == expected


@pytest.mark.parametrize(
    ("text", "twice"),
    [
        ("optim: adamw_8bit\nstate_precision: bf16\n", "state_precision"),
        ("optim: lion_8bit\nstate_precision: 8bit\n", "state_precision"),  # even with the same value
        ("use_muon: true\noptim: lion\n", "optim"),
    ],
)
def test_one_of_our_keys_set_twice_in_one_file_is_refused(tmp_path, text, twice):
    with pytest.raises(UserError, match=rf"sets {twice} twice: by its own name and by another trainer's name"):
        resolve("--config", write(tmp_path, f"stage: sft\n{text}"))


def _switches():
    """Every boolean key: ours (TrainConfig's bool fields) and the other trainers' switches (BOOL_KEYS)."""
    import typing

    from fused_stable.train.config.keys import TrainConfig

    ours = [name for name, hint in typing.get_type_hints(TrainConfig).items() if hint is bool]
    assert {"packing", "gradient_checkpointing", "overwrite"} <= set(ours)
    return sorted(ours) + sorted(foreign_configs.BOOL_KEYS)


@pytest.mark.parametrize("key", _switches())
def test_a_switch_takes_a_boolean_or_is_refused_naming_the_key_and_the_value(tmp_path, key):
    # `use_muon: yes please` used to be read as off: the run trained AdamW without a word
    with pytest.raises(UserError, match=rf"^{key} in .*run\.yaml must be true or false, got 'yes please'$"):
        resolve("--config", write(tmp_path, f"{key}: yes please\n"))
    with pytest.raises(UserError, match=rf"^{key} in .* must be true or false, got 'maybe'$"):
        resolve(f"--{key}", "maybe")
    with pytest.raises(UserError, match=rf"^{key} in .*run\.yaml must be true or false, got 2$"):
        resolve("--config", write(tmp_path, f"{key}: 2\n"))


@pytest.mark.parametrize(
    ("written", "on"),
    [("true", True), ("yes", True), ("on", True), ("1", True), ("false", False), ("no", False), ("Off", False)],
)
def test_what_yaml_and_flags_read_as_booleans_turns_a_switch_on_or_off(tmp_path, written, on):
    cfg, _, _ = resolve("--config", write(tmp_path, f"stage: sft\nuse_muon: {written}\nuse_dora: {written}\n"))
    assert (cfg.optim, cfg.tuner) == (("muon", "dora") if on else ("adamw", "lora"))
    cfg, _, _ = resolve("--use_dora", written, "--packing", written, "--do_train", "yes", "--stage", "sft")
    assert (cfg.tuner, cfg.packing) == (("dora", True) if on else ("lora", False))
