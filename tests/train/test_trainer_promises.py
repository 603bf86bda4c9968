"""What docs/trainer.md promises about `fused-stable sft`, each checked where a one-line bug would show:
checkpoints pruned to `save_total_limit` and every file fsynced before the COMPLETE marker; weight decay on
matrices only (not on norms, biases or DoRA magnitudes); `--gradient_checkpointing true` really recomputes
activations in backward; the fp16 loss scaler's state comes back on `--resume`; ShareGPT assistant turns are
what the model learns; every guard_* key reaches the guard."""

import json
import os
import shutil
import signal

import pytest
import torch
from sft_helpers import TINY, fit, read_metrics, setup_run

from fused_stable import GradScaler
from fused_stable.train.data import instructions
from fused_stable.train.model.tiny import build_byte_tokenizer
from fused_stable.train.run import checkpoint

# TINY names --model tiny: these tests are about the trainer, not the default model
SHORT = TINY


# ------------------------------------------------------------------------------------------- checkpoints
def _fsynced_paths(monkeypatch):
    """Spy on os.fsync: the real call is made, and the path of each fsynced descriptor is recorded."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name a file descriptor")
def test_checkpoints_are_fsynced_then_pruned_to_save_total_limit(tmp_path, monkeypatch):
    out = tmp_path / "run"
    synced = _fsynced_paths(monkeypatch)
    setup = setup_run(
        *SHORT,
        "--max_steps",
        "3",
        "--save_steps",
        "1",
        "--save_total_limit",
        "2",
        "--grad_accum",
        "1",
        "--output_dir",
        out,
    )
    fit(setup)
    root = out / "checkpoints"
    assert sorted(os.listdir(root)) == ["step-2", "step-3"]  # step-1 removed once step-3 was complete
    assert [os.path.basename(p) for _, p in checkpoint.list_checkpoints(out)] == ["step-2", "step-3"]
    newest = root / "step-3"
    files = sorted(os.listdir(newest))
    assert {
        "weights.safetensors",
        "optimizer.pt",
        "rng.pt",
        "trainer_state.json",
        "config.yaml",
        checkpoint.COMPLETE_MARKER,
    } <= set(files)
    synced_set = set(synced)
    # every file's data (written under the temporary name, then renamed: the inode is what was synced) ...
    for name in files:
        if name != checkpoint.COMPLETE_MARKER:
            tmp_name = os.path.realpath(root / f".tmp-step-3-{os.getpid()}" / name)
            assert tmp_name in synced_set, f"{name} was not fsynced"
    # ... the temporary directory, the checkpoints directory after the rename, the marker and its directory
    assert os.path.realpath(root / f".tmp-step-3-{os.getpid()}") in synced_set
    assert os.path.realpath(root) in synced_set
    assert os.path.realpath(newest / checkpoint.COMPLETE_MARKER) in synced_set
    assert os.path.realpath(newest) in synced_set
    # the marker is written (and synced) after every file of the checkpoint
    marker_at = synced.index(os.path.realpath(newest / checkpoint.COMPLETE_MARKER))
    weights_at = synced.index(os.path.realpath(root / f".tmp-step-3-{os.getpid()}" / "weights.safetensors"))
    assert weights_at < marker_at


def test_save_total_limit_zero_keeps_every_checkpoint(tmp_path):
    out = tmp_path / "all"
    fit(
        setup_run(
            *SHORT,
            "--max_steps",
            "3",
            "--save_steps",
            "1",
            "--save_total_limit",
            "0",
            "--grad_accum",
            "1",
            "--output_dir",
            out,
        )
    )
    assert sorted(os.listdir(out / "checkpoints")) == ["step-1", "step-2", "step-3"]


def _save_small_checkpoint(out, step: int, keep: int = 0) -> str:
    """save_checkpoint with a one-tensor model and a real optimizer state (no trainer needed)."""
    weight = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    opt = torch.optim.AdamW([weight], lr=1e-3)
    weight.grad = torch.ones_like(weight)
    opt.step()
    return checkpoint.save_checkpoint(
        str(out),
        step,
        model_state={"weight": weight.detach()},
        optimizer=opt,
        trainer_state={"micro_batches": step},
        config={"lr": 1e-3},
        keep=keep,
    )


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs POSIX signal masks")
def test_the_rename_and_the_marker_are_written_with_signals_held(tmp_path, monkeypatch):
    """docs/trainer.md: the rename and the COMPLETE marker are written with SIGINT and SIGTERM held back, so an
    interrupt cannot cut the commit in two; they are delivered again right after."""
    held_at = {}

    def blocked_now():
        return signal.pthread_sigmask(signal.SIG_BLOCK, [])

    real_rename, real_write = os.rename, checkpoint._write_bytes

    def rename(src, dst):
        if os.path.basename(str(dst)).startswith("step-"):
            held_at["rename"] = blocked_now()
        return real_rename(src, dst)

    def write_bytes(path, data):
        if os.path.basename(path) == checkpoint.COMPLETE_MARKER:
            held_at["marker"] = blocked_now()
        return real_write(path, data)

    monkeypatch.setattr(checkpoint.os, "rename", rename)
    monkeypatch.setattr(checkpoint, "_write_bytes", write_bytes)
    assert signal.SIGINT not in blocked_now()
    path = _save_small_checkpoint(tmp_path / "run", 1)
    assert set(held_at) == {"rename", "marker"}
    for what, mask in held_at.items():
        assert {signal.SIGINT, signal.SIGTERM} <= set(mask), f"signals not held during the {what}"
    assert signal.SIGINT not in blocked_now() and signal.SIGTERM not in blocked_now()  # and released after
    checkpoint.verify_checkpoint(path)


def test_pruned_checkpoints_are_renamed_away_before_they_are_deleted(tmp_path, monkeypatch):
    """docs/trainer.md: older checkpoints are renamed away before they are deleted, so a kill during the
    clean-up never leaves a half-deleted `step-N` that looks complete."""
    out = tmp_path / "run"
    for step in (1, 2):
        _save_small_checkpoint(out, step)
    real_rmtree, deleting = shutil.rmtree, []

    def killed_mid_removal(path, *args, **kwargs):
        # the process dies half-way through deleting the pruned checkpoint: one file gone, the rest left behind
        if os.path.isdir(path) and "step-1" in os.path.basename(str(path)):
            deleting.append(os.path.basename(str(path)))
            os.remove(os.path.join(str(path), "weights.safetensors"))
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_mid_removal)
    with pytest.raises(KeyboardInterrupt):
        _save_small_checkpoint(out, 3, keep=2)
    assert deleting and not deleting[0].startswith("step-"), f"{deleting} deleted in place"
    # what a later run sees: no half-deleted step-1, complete or not, and nothing passed over on resume
    assert [s for s, _ in checkpoint.list_checkpoints(str(out), include_incomplete=True)] == [2, 3]
    path, passed_over = checkpoint.latest_verified_checkpoint(str(out))
    assert path == str(out / "checkpoints" / "step-3") and passed_over == []


# ------------------------------------------------------------------------------------------- weight decay
def _decay_by_name(setup):
    opt = setup.trainer.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    decay = [g["weight_decay"] for g in opt.param_groups for _ in g["params"]]
    assert len(opt.param_names) == len(params)
    return dict(zip(opt.param_names, decay)), dict(zip(opt.param_names, params))


def test_weight_decay_on_matrices_only_full_finetune_with_biases(tmp_path):
    """tuner=full on a local Llama with attention and MLP biases: norms and biases get no weight decay."""
    from transformers import LlamaForCausalLM

    from fused_stable.train.model.tiny import tiny_llama_config

    tok = build_byte_tokenizer()
    config = tiny_llama_config(len(tok))
    config.attention_bias = config.mlp_bias = True
    local = tmp_path / "biased"
    LlamaForCausalLM(config).save_pretrained(local)
    tok.save_pretrained(local)
    setup = setup_run(
        *TINY, "--model", local, "--tuner", "full", "--weight_decay", "0.1", "--output_dir", tmp_path / "o"
    )
    decay, params = _decay_by_name(setup)
    biases = [n for n in decay if n.endswith(".bias")]
    norms = [n for n in decay if "norm" in n]
    assert biases and norms
    for name in biases + norms:
        assert decay[name] == 0.0, name
    matrices = [n for n, p in params.items() if p.ndim == 2]
    assert matrices and all(decay[n] == 0.1 for n in matrices)
    assert len(matrices) + len(biases) + len(norms) == len(decay)


def test_weight_decay_spares_dora_magnitudes(tmp_path):
    setup = setup_run(*SHORT, "--tuner", "dora", "--weight_decay", "0.1", "--output_dir", tmp_path / "d")
    decay, params = _decay_by_name(setup)
    magnitudes = [n for n in decay if "lora_magnitude_vector" in n]
    lora = [n for n in decay if "lora_A" in n or "lora_B" in n]
    assert magnitudes and lora
    assert all(decay[n] == 0.0 for n in magnitudes)
    assert all(decay[n] == 0.1 for n in lora)


def test_a_no_decay_param_without_gradient_signal_does_not_shrink(tmp_path):
    """What a user would see: a norm weight whose gradient is zero stays put (weight decay would shrink it by
    lr x weight_decay per step), while a decayed matrix with a zero gradient shrinks."""
    setup = setup_run(
        *SHORT,
        "--tuner",
        "full",
        "--weight_decay",
        "0.5",
        "--lr",
        "0.01",
        "--warmup_ratio",
        "0",
        "--max_grad_norm",
        "none",
        "--output_dir",
        tmp_path / "z",
    )
    _, params = _decay_by_name(setup)
    norm_name = next(n for n in params if "norm" in n)
    matrix_name = next(n for n, p in params.items() if p.ndim == 2)
    before = {n: params[n].detach().clone() for n in (norm_name, matrix_name)}
    for p in params.values():
        p.grad = torch.zeros_like(p)
    setup.trainer.optimizer.step()
    assert torch.equal(params[norm_name], before[norm_name])
    torch.testing.assert_close(params[matrix_name], before[matrix_name] * (1 - 0.01 * 0.5), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------- checkpointing
def _decoder_layer_forwards(setup):
    """The forward calls of the first decoder layer's MLP during the run (transformers checkpoints a layer's
    `forward`, below the layer's own hooks, so a hook inside the layer sees the recomputation; a pre-hook,
    because the recomputation stops early once the last saved tensor is rebuilt, before the MLP returns)."""
    layers = [m for m in setup.model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert layers
    calls = []
    handle = layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(torch.is_grad_enabled()))
    try:
        fit(setup)
    finally:
        handle.remove()
    return calls


@pytest.mark.parametrize("tuner", ["lora", "full"])
def test_gradient_checkpointing_recomputes_each_layer_in_backward(tmp_path, tuner):
    common = [*SHORT, "--tuner", tuner, "--max_steps", "1", "--grad_accum", "1", "--save_steps", "0"]
    plain = _decoder_layer_forwards(setup_run(*common, "--output_dir", tmp_path / "plain"))
    recomputed = _decoder_layer_forwards(
        setup_run(*common, "--gradient_checkpointing", "true", "--output_dir", tmp_path / "gc")
    )
    assert len(plain) == 1  # one micro-batch: one forward
    assert len(recomputed) == 2  # the forward, and its recomputation during backward


# ------------------------------------------------------------------------------------------- resume
def test_resume_restores_the_loss_scaler_state(tmp_path):
    """An fp16 run's scale and growth tracker come back on --resume (a fresh scaler would restart at 2**16)."""
    out = tmp_path / "fp16"
    first = setup_run(
        *SHORT,
        "--precision",
        "fp16",
        "--max_steps",
        "3",
        "--save_steps",
        "3",
        "--grad_accum",
        "1",
        "--logging_steps",
        "1",
        "--output_dir",
        out,
    )
    # a scaler that grows every 2 steps, so that its scale and growth tracker differ from a fresh one's
    first.trainer.scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    fit(first)
    saved = torch.load(out / "checkpoints" / "step-3" / "scaler.pt", weights_only=True)
    assert saved["scale"] == 2.0**11 and saved["_growth_tracker"] == 1 and saved["growth_interval"] == 2
    assert read_metrics(out)[-1]["loss_scale"] == 2.0**11

    resumed = setup_run("--output_dir", out, "--resume", "latest", "--max_steps", "5")
    resumed.start()
    try:
        state = resumed.trainer.scaler.state_dict()
    finally:
        resumed.trainer.reporter.close()
    assert state == saved
    assert resumed.trainer.scaler.get_scale() == 2.0**11


# ------------------------------------------------------------------------------------------- sharegpt
def _trained_text(item, tok):
    return tok.decode([t for t, label in zip(item.input_ids, item.labels) if label != instructions.IGNORE_INDEX])


@pytest.mark.parametrize("style", ["from/value", "role/content"])
def test_sharegpt_learns_every_assistant_turn_and_nothing_else(tmp_path, style):
    speaker, text = ("from", "value") if style == "from/value" else ("role", "content")
    names = (
        {"system": "system", "user": "human", "assistant": "gpt"}
        if style == "from/value"
        else {"system": "system", "user": "user", "assistant": "assistant"}
    )
    turns = [("system", "be brief"), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?"), ("assistant", "6!")]
    record = {"conversations": [{speaker: names[role], text: value} for role, value in turns]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(record) + "\n")
    tok = build_byte_tokenizer()
    [item] = instructions.tokenize_examples(instructions.load_examples(str(path)), tok, 512)
    eos = tok.eos_token
    assert _trained_text(item, tok) == f"4{eos}6!{eos}"  # both answers (+ </s>), no prompt, no system text
    # and the trainer sees those label tokens in its batches
    setup = setup_run(
        *SHORT,
        "--dataset",
        path,
        "--batch_size",
        "1",
        "--grad_accum",
        "1",
        "--max_length",
        "512",
        "--output_dir",
        tmp_path / "o",
    )  # 512: the short runs' 96 tokens cut the second answer
    assert setup.trainer.batches.batch(0).num_label_tokens == len("4") + 1 + len("6!") + 1


# ------------------------------------------------------------------------------------------- guard keys
def test_every_guard_key_reaches_the_guard(tmp_path):
    setup = setup_run(
        *SHORT,
        "--guard",
        "rollback",
        "--guard_grad_z",
        "7.5",
        "--guard_grad_ratio",
        "3.5",
        "--guard_skip_z",
        "30",
        "--guard_loss_z",
        "8",
        "--guard_loss_rise",
        "2.5",
        "--guard_nonfinite_storm",
        "4",
        "--guard_lr_factor",
        "0.25",
        "--guard_eval_lr_factor",
        "0.125",
        "--guard_max_rollbacks",
        "2",
        "--guard_eval_rise",
        "1.7",
        "--output_dir",
        tmp_path / "g",
    )
    c = setup.trainer.guard.config
    assert (
        c.policy,
        c.grad_z,
        c.grad_ratio,
        c.skip_z,
        c.loss_z,
        c.loss_rise,
        c.nonfinite_storm,
        c.lr_factor,
        c.eval_lr_factor,
        c.max_rollbacks,
        c.eval_rise,
    ) == ("rollback", 7.5, 3.5, 30.0, 8.0, 2.5, 4, 0.25, 0.125, 2, 1.7)
    assert setup.trainer.optimizer.policy.spike_skip_threshold == 30.0


# ------------------------------------------------------------------------------------------- loop timing
def test_the_guard_also_looks_at_every_checkpoint_step(tmp_path):
    """docs/trainer.md: the guard reads at each logging step and at each save_steps step, so every checkpoint is
    one the guard has looked at (a rollback returns to it)."""
    setup = setup_run(
        *SHORT,
        "--max_steps",
        "5",
        "--logging_steps",
        "3",
        "--save_steps",
        "2",
        "--grad_accum",
        "1",
        "--output_dir",
        tmp_path / "run",
    )
    trainer, checked = setup.trainer, []
    real_check = trainer.guard.check

    def check(step, optimizer, rows):
        checked.append(step)
        return real_check(step, optimizer, rows)

    trainer.guard.check = check
    fit(setup)
    assert checked == [2, 3, 4, 5]  # save steps 2 and 4, logging step 3, the last step 5


def test_without_a_terminal_one_progress_line_per_logging_step(tmp_path, capsys):
    """docs/trainer.md: when stdout is not a terminal the progress is one line per logging step."""
    fit(
        setup_run(
            *SHORT, "--max_steps", "4", "--logging_steps", "2", "--grad_accum", "1", "--output_dir", tmp_path / "run"
        )
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 4/4"]


@pytest.mark.skipif(not hasattr(signal, "raise_signal"), reason="needs signal.raise_signal")
def test_an_interrupt_before_training_starts_stops_at_once_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """docs/trainer.md: an interrupt before training starts stops at once (exit 130): nothing has been written."""
    from fused_stable.train.run import sft

    real_setup = sft.setup_run

    def setup_then_ctrl_c(argv):
        setup = real_setup(argv)
        signal.raise_signal(signal.SIGINT)  # arrives while the model is built: nothing written yet
        return setup

    monkeypatch.setattr(sft, "setup_run", setup_then_ctrl_c)
    before = signal.getsignal(signal.SIGINT)  # Python's default, or "ignore" in an xdist worker
    out = tmp_path / "run"
    code = sft.main([str(a) for a in (*SHORT, "--output_dir", out)])
    err = capsys.readouterr().err
    assert code == 130
    assert "interrupted before training started; nothing was written" in err
    assert not out.exists()
    assert signal.getsignal(signal.SIGINT) is before  # the handler is given back
