"""Short end-to-end runs of `fused-stable sft`: each tuner, quantisation and precision trains, logs and saves."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import TINY, fit, read_metrics, setup_run

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "skipped", "tokens_per_s", "elapsed_s"}


def _check_outputs(out_dir, steps, saved="adapter"):
    rows = read_metrics(out_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # one line per optimizer step
    for row in rows:
        assert METRIC_KEYS <= row.keys()
        assert torch.isfinite(torch.tensor(row["loss"])) and row["loss"] > 0
        assert row["grad_norm"] > 0 and row["lr"] >= 0 and row["tokens_per_s"] > 0
    # the warm-up is ceil(warmup_ratio x steps), as the HF Trainer rounds it: its first step's lr is 0
    assert rows[-1]["lr"] > 0
    for name in ("run.yaml", "curves.png", saved):
        assert os.path.exists(os.path.join(out_dir, name)), name
    assert os.path.isfile(os.path.join(out_dir, "checkpoints", f"step-{steps}", "COMPLETE"))
    return rows


def test_lora_default_recipe_trains_and_saves(sft, tmp_path):
    out = tmp_path / "run"
    # TINY sets the recipe its tests were written for: drop it to see the defaults
    recipe = ("--lr", "--target_modules", "--lora_dropout")
    tiny = [a for i, a in enumerate(TINY) if a not in recipe and TINY[i - 1] not in recipe]
    code, stdout, _ = sft(*tiny, "--output_dir", out, "--tensorboard", "true")
    assert code == 0, stdout
    rows = _check_outputs(out, 4)
    assert os.path.isfile(out / "adapter" / "adapter_config.json")
    assert os.path.isfile(out / "adapter" / "tokenizer.json")  # the byte tokenizer travels with the adapter
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["lora_dropout"] == 0.0
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert config["base_model_name_or_path"] == "tiny"
    assert os.listdir(out / "tensorboard")
    # warm-up then cosine from the default peak lr 1e-3: ceil(0.1 * 4) = 1 warm-up step (lr 0, as the HF
    # Trainer rounds it), then the peak, then it decays
    assert rows[0]["lr"] == 0 and rows[1]["lr"] == pytest.approx(1e-3) and rows[1]["lr"] > rows[-1]["lr"]
    assert "loss" in stdout and "done:" in stdout


def _weights_by_name(model, predicate):
    return {n: p.detach().clone() for n, p in model.named_parameters() if predicate(n, p)}


def test_qlora_4bit_nf4_base_unchanged(tmp_path):
    import bitsandbytes as bnb

    setup = setup_run(*TINY, "--quant_bits", "4", "--output_dir", tmp_path / "q")
    model = setup.model
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit, "no 4-bit layers"
    assert all(m.weight.quant_type == "nf4" for m in four_bit)
    assert all(m.weight.quant_state.nested for m in four_bit)  # double quantisation
    base_before = [m.weight.data.clone() for m in four_bit]
    lora_before = _weights_by_name(model, lambda n, p: "lora_B" in n)
    fit(setup)
    for before, layer in zip(base_before, four_bit):
        assert torch.equal(before, layer.weight.data)  # the packed NF4 weights did not move
    assert not any(m.weight.requires_grad for m in four_bit)
    moved = [n for n, p in model.named_parameters() if "lora_B" in n and not torch.equal(p, lora_before[n])]
    assert moved, "the LoRA B matrices did not train"


def test_qlora_cli_run(sft, tmp_path):
    code, stdout, err = sft(*TINY, "--quant_bits", "4", "--output_dir", tmp_path / "q")
    assert code == 0, err
    _check_outputs(tmp_path / "q", 4)


def test_8bit_base(tmp_path):
    """LLM.int8 base: the frozen projections are bitsandbytes int8 layers that do not move; the adapters train."""
    import bitsandbytes as bnb

    out = tmp_path / "q8"
    setup = setup_run(*TINY, "--quant_bits", "8", "--max_steps", "2", "--output_dir", out)
    eight_bit = [m for m in setup.model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert eight_bit and all(m.weight.dtype == torch.int8 for m in eight_bit)
    base_before = [m.weight.data.clone() for m in eight_bit]
    lora_before = _weights_by_name(setup.model, lambda n, p: "lora_B" in n)
    fit(setup)
    assert all(torch.equal(b, m.weight.data) for b, m in zip(base_before, eight_bit))
    moved = [n for n, p in setup.model.named_parameters() if "lora_B" in n and not torch.equal(p, lora_before[n])]
    assert moved, "the LoRA B matrices did not train"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)


def test_dora(sft, tmp_path):
    out = tmp_path / "dora"
    code, _, err = sft(*TINY, "--tuner", "dora", "--output_dir", out)
    assert code == 0, err
    _check_outputs(out, 4)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["use_dora"] is True
    saved = load_file(out / "checkpoints" / "step-4" / "weights.safetensors")
    assert any("lora_magnitude_vector" in k for k in saved)


def test_loraplus_groups_and_run(sft, tmp_path):
    setup = setup_run(*TINY, "--loraplus_lr_ratio", "16", "--output_dir", tmp_path / "lp")
    groups = setup.trainer.optimizer.param_groups
    names = setup.trainer.optimizer.param_names
    # the groups' base lrs (group["lr"] shows the scheduled one, 0 at the first warm-up step)
    b_group = [g for g in groups if g["initial_lr"] == pytest.approx(2e-4 * 16)]
    assert len(b_group) == 1
    b_ids = {id(p) for p in b_group[0]["params"]}
    b_names = [n for n, p in zip(names, [p for g in groups for p in g["params"]]) if id(p) in b_ids]
    assert b_names and all("lora_B" in n for n in b_names)
    assert all(g["initial_lr"] == pytest.approx(2e-4) for g in groups if g is not b_group[0])
    code, _, err = sft(*TINY, "--loraplus_lr_ratio", "16", "--output_dir", tmp_path / "lp2")
    assert code == 0, err
    _check_outputs(tmp_path / "lp2", 4)


def _first_steps(tmp_path, *extra):
    """Two logged steps of the default recipe; returns (setup, metrics rows, dtypes of a base MLP's outputs)."""
    out = tmp_path / "run"
    setup = setup_run(
        *TINY, "--max_steps", "2", "--logging_steps", "1", "--save_steps", "0", "--output_dir", out, *extra
    )
    layer = next(m for m in setup.model.modules() if type(m).__name__ == "LlamaDecoderLayer")
    dtypes = []
    layer.mlp.down_proj.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    fit(setup)
    return setup, read_metrics(out), set(dtypes)


@pytest.fixture(scope="module")
def fp32_steps(tmp_path_factory):
    return _first_steps(tmp_path_factory.mktemp("fp32"), "--precision", "fp32")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision(tmp_path, precision, fp32_steps):
    """The forward runs in the low precision (autocast), the adapters stay fp32, fp16 scales the loss by the
    GradScaler's 2**16 and the optimizer divides it out again: loss and pre-clip grad norm agree with fp32 to
    the low precision's rounding (measured: <= 6e-4 relative), not to within a factor of 65536."""
    from fused_stable import GradScaler

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    _, ref_rows, ref_dtypes = fp32_steps
    setup, rows, dtypes = _first_steps(tmp_path, "--precision", precision)
    assert ref_dtypes == {torch.float32} and dtypes == {dtype}
    assert all(p.dtype == torch.float32 for p in setup.model.parameters() if p.requires_grad)
    for row, ref in zip(rows, ref_rows):
        assert row["loss"] == pytest.approx(ref["loss"], rel=5e-3)
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-3)
        assert not row["skipped"]
    if precision == "fp16":
        assert isinstance(setup.trainer.scaler, GradScaler)
        assert [r["loss_scale"] for r in rows] == [2.0**16, 2.0**16]  # no overflow, growth after 2000 steps
    else:
        assert setup.trainer.scaler is None and "loss_scale" not in rows[-1]


def test_full_finetune_with_gradient_checkpointing(sft, tmp_path):
    """Full fine-tuning with checkpointing trains and saves the whole model; that checkpointing recomputes is
    tested in test_trainer_promises.py."""
    out = tmp_path / "full"
    code, _, err = sft(*TINY, "--tuner", "full", "--gradient_checkpointing", "--lr", "1e-3", "--output_dir", out)
    assert code == 0, err
    rows = _check_outputs(out, 4, saved="model")
    assert os.path.isfile(out / "model" / "config.json")
    from transformers import AutoModelForCausalLM

    from fused_stable.train.model.tiny import build_tiny_model

    saved = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)
    base = build_tiny_model()
    changed = [n for n, p in saved.named_parameters() if not torch.equal(p, base.state_dict()[n])]
    assert len(changed) == len(list(base.parameters()))  # every weight trained (tuner full), not just some
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_local_model_directory(sft, tmp_path):
    """A local Hugging Face directory (the tiny model and tokenizer saved to disk) loads offline."""
    from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model

    local = tmp_path / "local-model"
    build_tiny_model().save_pretrained(local)
    build_byte_tokenizer().save_pretrained(local)
    code, _, err = sft(
        *TINY, "--model", local, "--max_steps", "2", "--target_modules", "all-linear", "--output_dir", tmp_path / "out"
    )
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert len(config["target_modules"]) == 7  # q, k, v, o, gate, up, down


def test_grad_accum_divides_by_window_tokens(tmp_path):
    """bs 2 x accum 2 sees the same 4 sequences as bs 4 x accum 1: same loss and same update."""
    common = [*TINY, "--max_steps", "1", "--lora_dropout", "0", "--max_grad_norm", "none"]
    a = setup_run(*common, "--batch_size", "2", "--grad_accum", "2", "--output_dir", tmp_path / "a")
    b = setup_run(*common, "--batch_size", "4", "--grad_accum", "1", "--output_dir", tmp_path / "b")
    fit(a)
    fit(b)
    loss_a, loss_b = read_metrics(tmp_path / "a")[0]["loss"], read_metrics(tmp_path / "b")[0]["loss"]
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    pa = dict(a.model.named_parameters())
    for name, p in b.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(pa[name], p, rtol=1e-4, atol=1e-6)


def test_runs_without_deepspeed_never_import_it_and_print_no_third_party_noise(tmp_path):
    """A LoRA run and a full fine-tuning run in one fresh process (bitsandbytes speaks once, at its import): the
    final saves import no deepspeed (accelerate's unwrap in `save_pretrained` used to, printing DeepSpeed's
    "Setting accelerator to CPU"), and the `kernels` package's offline "publisher trust check" note is not shown."""
    import subprocess
    import sys

    from sft_helpers import REPO_ROOT

    here = os.path.dirname(os.path.abspath(__file__))
    runs = [[*TINY, "--max_steps", 1, "--tuner", tuner, "--output_dir", tmp_path / tuner] for tuner in ("lora", "full")]
    code = (
        f"import sys; sys.path.insert(0, {here!r}); from torchrun_fault_script import trace_deepspeed_import\n"
        f"trace_deepspeed_import({str(tmp_path)!r})\nfrom fused_stable.train.run import sft\n"
        + "".join(f"assert sft.main({[str(a) for a in argv]!r}) == 0\n" for argv in runs)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("done: steps 0->1") == 2
    assert (tmp_path / "rank-0.txt").read_text() == "deepspeed loaded: False\n"  # no import, no stack
    for noise in ("Setting accelerator", "publisher trust check"):
        assert noise not in proc.stdout + proc.stderr, noise


def test_a_one_step_run_trains_its_step_at_the_peak_lr_and_says_why(sft, tmp_path):
    """`--max_steps 1`: the default warm-up (ceil(0.1 x 1) = 1 step, as the HF Trainer counts it) would put the
    only step at lr 0; it is cut to 0 steps, with a note, and the step moves the weights."""
    out = tmp_path / "run"
    code, stdout, err = sft(*TINY, "--max_steps", 1, "--tuner", "full", "--output_dir", out)
    assert code == 0, err
    assert "note: warm-up: 1 steps asked for in a run of 1; 0 taken" in stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1] and rows[0]["lr"] == pytest.approx(2e-4)  # TINY's lr
    base = setup_run(*TINY, "--tuner", "full", "--output_dir", tmp_path / "base").model
    trained = load_file(out / "checkpoints" / "step-1" / "weights.safetensors")
    moved = [n for n, p in base.named_parameters() if not torch.equal(p.detach(), trained[n])]
    assert len(moved) == len(trained), "every weight moved"
