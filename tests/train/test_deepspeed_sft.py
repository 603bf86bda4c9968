"""`fused-stable sft --zero_stage N` / `--deepspeed ds.json` (train/run/deepspeed_run.py) with real DeepSpeed and real
processes on CPU (gloo): ZeRO-2 and ZeRO-3 on 2 ranks under torchrun train, read the same signals as without
DeepSpeed (the step-1 loss is the mean over the ranks, the grad norm the global one) and resume exactly; ZeRO-3's
adapter is gathered, so `fused-stable export` merges it and transformers loads the result; the example config
trains under the `deepspeed` launcher on one rank like the same run without DeepSpeed; the guard's rollback goes
through the engine; bad DeepSpeed input is one line before the model loads. DeepSpeed is in the test extra: not
installed is a failure, not a skip."""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import REPO_ROOT, TINY, read_metrics, setup_run
from test_torchrun import assert_group_freed, first_step_reference

from fused_stable.train.run import checkpoint, outputs

# 4 steps, checkpoints at 2 and 4; no LoRA dropout, so that the step-1 grad norm has a reference in one process
RUN = [*TINY, "--logging_steps", "1", "--save_total_limit", "0", "--lr", "1e-3", "--lora_dropout", "0"]
# the build of DeepSpeed's communication op that tests/integrations/integ_deepspeed.py keeps between test runs
EXTENSIONS_DIR = Path(tempfile.gettempdir()) / "fused_stable_deepspeed_extensions"
EXAMPLE = os.path.join(REPO_ROOT, "examples", "sft_zero2.json")
ERROR_PREFIX = "fused-stable sft: error:"


def launch(launcher, *argv, program=("-m", "fused_stable"), env=None, timeout=400, cwd=REPO_ROOT):
    """`fused-stable sft ARGV` under `launcher` (torchrun on 2 ranks, or DeepSpeed's own), DeepSpeed on the CPU,
    in `cwd` (the repository, or a config's own folder when its paths are relative)."""
    clean = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {
        **{k: v for k, v in os.environ.items() if k not in clean},
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_DIR),
        **(env or {}),
    }
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *program]
    else:  # the deepspeed launcher, one process (its console script may name another interpreter: use ours)
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", "0"]
        cmd += ["--module", *program[1:]] if program[0] == "-m" else list(program)
    cmd += ["sft", *map(str, argv)]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_deepspeed_is_installed():
    import importlib.util

    assert importlib.util.find_spec("deepspeed") is not None, "deepspeed is in the test extra: these tests must run"


def _check_engine_checkpoints(out, stage):
    """Every checkpoint through the engine, inside the trainer's layout: its files under deepspeed/, recorded by
    the COMPLETE marker (so verify_checkpoint checks them), and no weights of the trainer's own."""
    ckpts = sorted(os.listdir(out / "checkpoints"))
    assert ckpts == ["step-2", "step-4"]
    for name in ckpts:
        path = out / "checkpoints" / name
        record = checkpoint.verify_checkpoint(str(path))
        engine_files = [f for f in record["files"] if f.startswith("deepspeed/")]
        assert len(engine_files) >= 3 and any("optim_states" in f for f in engine_files), record["files"]
        assert not (path / "weights.safetensors").exists() and not (path / "optimizer.pt").exists()
        state = json.loads((path / "trainer_state.json").read_text())
        assert state["zero_stage"] == stage and state["world_size"] == 2


def _check_signals(out, proc, tmp_path, *reference_args):
    """One writer, and the step-1 loss and grad norm of a 2-rank run without DeepSpeed; the loss falls."""
    assert proc.stdout.count("done: steps 0->4") == 1
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    per_rank, grad_norm = first_step_reference(tmp_path, *reference_args)
    assert rows[0]["loss"] == pytest.approx(sum(per_rank) / 2, rel=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)  # the global norm, not a partition's
    assert rows[-1]["loss"] < rows[0]["loss"] and not any(r["skipped"] for r in rows)
    assert [r["lr"] for r in rows][1] == pytest.approx(1e-3)  # the schedule advanced once per step (warm-up 1)
    return rows


def _resume_exactly(out, tmp_path, saved):
    """A kill after the step-2 checkpoint (a half-written step-4 left behind), then --resume latest: the
    uninterrupted run's losses, grad norms and final weights, bit for bit."""
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    shutil.rmtree(broken / saved)
    os.rename(broken / "checkpoints" / "step-4", broken / "checkpoints" / ".tmp-step-4-123")
    proc = launch("torchrun", "--output_dir", broken, "--resume", "latest")
    assert proc.stdout.count("done: steps 2->4") == 1
    a, b = read_metrics(out), read_metrics(broken)
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in a] == [(r["loss"], r["grad_norm"], r["lr"]) for r in b]
    name = "adapter_model.safetensors" if saved == "adapter" else "model.safetensors"
    wa, wb = load_file(out / saved / name), load_file(broken / saved / name)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return wa


def _partition_elements(groups: list[list[int]], stage: int, ranks: int) -> list[int]:
    """Elements of each flat fp32 partition one rank's FusedAdamW steps, from the trainable params' sizes: ZeRO 1-2
    pad each group to a multiple of 2 x ranks and slice it evenly (deepspeed/runtime/zero/stage_1_and_2.py:
    alignment = nccl_start_alignment_factor (2) x the data-parallel size; parameter_alignment off by default);
    ZeRO-3 pads each param to a multiple of ranks, a rank holds ceil(numel / ranks) of each, one sub-group per
    group (partition_parameters.py `_padding_size`; sub_group_size 1e9)."""
    if stage == 3:
        return [sum(math.ceil(n / ranks) for n in group) for group in groups]
    return [math.ceil(sum(group) / (2 * ranks)) * 2 * ranks // ranks for group in groups]


def _check_state_header(proc, out, tmp_path, stage: int, ranks: int, args, host: bool = False):
    """The header's and run_manifest.json's optimizer state: every rank's ZeRO partitions, counted from the tiny
    model's trainable params (8 bytes an element: fp32 exp_avg and exp_avg_sq; 4 bytes of `step` a partition),
    not the module's empty params; the total is the ranks' sum, about `ranks` times a rank's (the padding)."""
    optimizer = setup_run(*args, "--output_dir", tmp_path / "count").trainer.optimizer  # no DeepSpeed
    groups = [[p.numel() for p in group["params"] if p.requires_grad] for group in optimizer.param_groups]
    elements = _partition_elements(groups, stage, ranks)
    per_rank = 8 * sum(elements) + 4 * len(elements)
    total = ranks * per_rank
    trainable = sum(map(sum, groups))
    padding = ranks * sum(elements) - trainable  # elements DeepSpeed added: all of the total's excess over 8 / element
    assert 0 <= padding < sum(2 * ranks if stage < 3 else ranks * len(group) for group in groups)
    assert total == 8 * (trainable + padding) + 4 * len(elements) * ranks and per_rank > 0
    state = outputs.read_manifest(str(out))["optimizer_state"]
    assert state == {
        "precision": "fp32",
        "mib": round(per_rank / 2**20, 3),
        "mib_total": round(total / 2**20, 3),
        "bytes_per_rank": [per_rank] * ranks,
        "zero_stage": stage,
        "memory": "host" if host else "device",
    }
    where = ", offloaded to host memory" if host else ""
    header = f"optimizer state fp32 {per_rank / 2**20:#.3g} MiB per rank, {total / 2**20:#.3g} MiB in all"
    assert proc.stdout.count(f"{header} (ZeRO-{stage} partitions{where}) |") == 1, proc.stdout[:3000]
    assert "optimizer state fp32 0.0 MiB" not in proc.stdout


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero2") / "run"
    return out, launch("torchrun", *RUN, "--zero_stage", "2", "--output_dir", out)


def test_zero2_two_ranks_trains_with_the_signals_of_ddp(zero2_run, tmp_path):
    out, proc = zero2_run
    assert proc.stdout.count("fused-stable sft: model=tiny tuner=lora") == 1
    _check_signals(out, proc, tmp_path, *RUN)
    _check_engine_checkpoints(out, 2)
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # trained (B starts at zero)
    _check_state_header(proc, out, tmp_path, 2, 2, RUN)


def test_zero2_resume_is_exact(zero2_run, tmp_path):
    _resume_exactly(zero2_run[0], tmp_path, "adapter")


def test_zero2_muon_two_ranks_trains_like_ddp(tmp_path):
    """`--optim muon --tuner full --zero_stage 2` on 2 ranks (FusedMuon's matrices rebuilt whole on their owner rank,
    integrations/deepspeed_muon.py): the step-1 loss and global grad norm of a 2-rank run without DeepSpeed, the
    loss falls, no step skipped; and every step's loss and grad norm that of the same run at ZeRO-0 (whole params,
    every rank orthogonalising every matrix; a full fine-tune under torchrun without DeepSpeed is FSDP2, where
    Muon is another helper's), within the 1e-5 of the HF Trainer's ZeRO-vs-DDP test."""
    args = [*RUN, "--optim", "muon", "--tuner", "full", "--save_steps", "4"]
    # the Gram products' blocks chosen, as on a CPU without AMX: FusedMuon.describe() (the run's split line) counts
    # no flat partition as a matrix (the tiny model's 64-row Grams are one block, so the update is unchanged)
    blocks = {"FUSED_STABLE_NEWTON_SCHULZ_BLOCKS": "1"}
    proc = launch("torchrun", *args, "--zero_stage", "2", "--output_dir", tmp_path / "ds", env=blocks)
    assert "optim=muon (FusedMuon)" in proc.stdout
    rows = _check_signals(tmp_path / "ds", proc, tmp_path, *args)
    launch("torchrun", *args, "--zero_stage", "0", "--output_dir", tmp_path / "zero0")
    whole = read_metrics(tmp_path / "zero0")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in whole], rel=1e-5), key


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """ZeRO-3 from a --deepspeed file that partitions every parameter: by default ZeRO-3 keeps tensors under
    stage3_param_persistence_threshold (1e5 elements: all of the tiny model's) whole on every rank."""
    folder = tmp_path_factory.mktemp("zero3")
    ds = folder / "zero3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    out = folder / "run"
    return out, launch("torchrun", *RUN, "--deepspeed", ds, "--output_dir", out)


def test_zero3_two_ranks_trains_and_the_export_loads_with_transformers(zero3_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out, proc = zero3_run
    # ZeRO-3 leaves empty tensors on the module: the banner counts the partitioned parameters' real sizes
    assert proc.stdout.count("16,384 trainable of 837,504 params") == 1
    _check_state_header(proc, out, tmp_path, 3, 2, RUN)  # the module's params are empty there
    _check_signals(out, proc, tmp_path, *RUN)
    _check_engine_checkpoints(out, 3)
    # the adapter was gathered from both ranks' partitions: whole tensors, trained
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all(v.dim() == 2 and v.numel() > 0 for v in adapter.values())
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    from fused_stable.train.saved import export

    assert export.main(["--adapter", str(out), "--output_dir", str(tmp_path / "exported")]) == 0
    merged = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True).named_parameters())
    # the merge is W + (alpha / r) B A with the gathered A and B, on the base the run started from
    base = dict(setup_run(*RUN, "--output_dir", tmp_path / "base").model.get_base_model().named_parameters())
    for layer in range(4):
        prefix = f"model.layers.{layer}.self_attn.q_proj"
        a = adapter[f"base_model.model.{prefix}.lora_A.weight"]
        b = adapter[f"base_model.model.{prefix}.lora_B.weight"]
        expected = base[f"{prefix}.base_layer.weight"].detach() + 2.0 * b @ a
        torch.testing.assert_close(merged[f"{prefix}.weight"].detach(), expected, rtol=1e-5, atol=1e-6)


def test_zero3_resume_is_exact(zero3_run, tmp_path):
    _resume_exactly(zero3_run[0], tmp_path, "adapter")


def test_example_config_under_the_deepspeed_launcher_matches_the_run_without_deepspeed(tmp_path, sft):
    """examples/sft_zero2.json ("auto" batch keys, bf16 and bucket size filled by the trainer) on one rank of
    DeepSpeed's own launcher, full fine-tuning: the losses, grad norms and lr of the same run in one process
    without DeepSpeed. The grad norm within 1e-4: ZeRO-2 hands FusedAdamW one flat 821,120-element gradient,
    whose norm torch's CPU `_foreach_norm` (fp32 accumulation, what clip_grad_norm_ uses too) takes 3.7e-5 off
    its fp64 value (measured on step 1, where the flat gradient's fp64 norm equals the per-tensor one exactly);
    per tensor (<= 33K elements) the error is 5e-8."""
    args = [*RUN, "--tuner", "full", "--save_steps", "4"]
    proc = launch("deepspeed", *args, "--deepspeed", EXAMPLE, "--output_dir", tmp_path / "ds")
    assert proc.stdout.count("done: steps 0->4") == 1
    code, _, err = sft(*args, "--output_dir", tmp_path / "plain")
    assert code == 0, err
    ours, plain = read_metrics(tmp_path / "ds"), read_metrics(tmp_path / "plain")
    for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4), ("lr", 1e-6)):
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in plain], rel=rel), key
    state = json.loads((tmp_path / "ds" / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert state["zero_stage"] == 2 and state["world_size"] == 1
    _check_state_header(proc, tmp_path / "ds", tmp_path, 2, 1, args)  # two groups (decay, no decay), one rank
    wa = load_file(tmp_path / "ds" / "model" / "model.safetensors")
    wb = load_file(tmp_path / "plain" / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6)


def test_one_process_without_a_launcher_with_zero_offload(tmp_path):
    """`python -m fused_stable sft --zero_stage 1 --offload_optimizer cpu` with no launcher at all: the trainer gives
    DeepSpeed the one-process environment it needs; FusedAdamW is the offloaded CPU optimizer."""
    out = tmp_path / "offload"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR))
    env.pop("DS_ACCELERATOR", None)  # set by the trainer for a CPU run
    args = [*RUN, "--max_steps", "2", "--zero_stage", "1", "--offload_optimizer", "cpu", "--output_dir", out]
    cmd = [sys.executable, "-m", "fused_stable", "sft", *map(str, args)]
    proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("done: steps 0->2") == 1
    state = json.loads((out / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["zero_stage"] == 1 and state["world_size"] == 1
    assert [r["skipped"] for r in read_metrics(out)] == [False, False]
    _check_state_header(proc, out, tmp_path, 1, 1, RUN, host=True)


def test_guard_rollback_goes_through_the_engine(tmp_path):
    """Non-finite logits on 3 micro-batches in a row on both ranks (ZeRO-1, the stage no other run here takes on 2
    ranks): the guard sees the skipped steps, rolls every rank back to the step-10 checkpoint through
    engine.load_checkpoint and the run completes; each rank frees its groups when it leaves (destroy_distributed
    destroys the DeepSpeed engine and lets deepspeed.comm drop its references: issue 52's SIGABRT at exit)."""
    out = tmp_path / "fault"
    threads = tmp_path / "threads"
    threads.mkdir()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_fault_script.py")
    args = [*TINY[:8], "--batch_size", 2, "--grad_accum", 1, "--max_length", 96, "--tensorboard", "false"]
    args += ["--logging_steps", 5, "--save_steps", 10, "--max_steps", 20, "--guard", "rollback"]
    proc = launch(
        "torchrun",
        *args,
        "--zero_stage",
        1,
        "--output_dir",
        out,
        program=(script,),
        env={"FAULT_BATCHES": "12,13,14", "GROUP_THREADS_AT_EXIT": str(threads)},
    )
    assert proc.stdout.count("done: steps 0->20") == 1
    assert_group_freed(threads)
    _check_state_header(proc, out, tmp_path, 1, 2, args)
    from fused_stable.train.run.report import read_alerts

    rollbacks = [a for a in read_alerts(str(out)) if a["action"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["detected_at"] == 15
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 21))  # rewound to step 10, then 11..20 again
    state = json.loads((out / "checkpoints" / "step-20" / "trainer_state.json").read_text())
    assert state["rollbacks"] == 1 and state["micro_batches"] == 25 and state["zero_stage"] == 1
    # the restored FusedAdamW counted no skip (step 10's state), the lr cut by guard_lr_factor after the rollback
    assert rows[-1]["skipped_total"] == 0 and all(r["loss"] == r["loss"] for r in rows[10:])


def test_the_header_says_what_the_state_figure_is_under_each_stage():
    """The header's words for the optimizer state (setup.state_words) from run_manifest.json's fields: the ranks'
    sum in all, a range where their partitions differ, ZeRO-0's copies, ZeRO-Offload's host memory; whose share
    under torchrun."""
    from fused_stable.train.run.setup import state_words

    mib = 2**20
    zero = {"precision": "bf16", "mib": 1.5, "zero_stage": 3, "memory": "device"}
    assert state_words({**zero, "bytes_per_rank": [3 * mib // 2] * 2}) == (
        "bf16 1.50 MiB per rank, 3.00 MiB in all (ZeRO-3 partitions)"
    )
    assert state_words({**zero, "bytes_per_rank": [mib, 2 * mib, 8 * mib], "memory": "host"}) == (
        "bf16 1.00-8.00 MiB per rank, 11.0 MiB in all (ZeRO-3 partitions, offloaded to host memory)"
    )
    assert state_words({**zero, "bytes_per_rank": [mib] * 4, "zero_stage": 0}) == (
        "bf16 1.00 MiB per rank, 4.00 MiB in all (ZeRO-0 replicated on every rank)"
    )
    plain = {"precision": "8bit", "mib": 0.126}
    assert state_words(plain) == "8bit 0.1 MiB"
    assert state_words(plain, "ddp", 2) == "8bit 0.1 MiB per rank (DDP replicates it)"
    assert state_words(plain, "fsdp2", 4) == "8bit 0.1 MiB on rank 0 (FSDP2 shards it over 4 ranks)"


# ------------------------------------------------------------------------------------------ refusals
def _json(tmp_path, content) -> str:
    path = tmp_path / "ds.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


REFUSALS = {
    "both": (lambda p: ["--deepspeed", _json(p, {}), "--zero_stage", "2"], "deepspeed and zero_stage exclude"),
    "missing file": (lambda p: ["--deepspeed", str(p / "nowhere.json")], "nowhere.json' not found"),
    "invalid json": (lambda p: ["--deepspeed", _json(p, '{"zero_optimization": ')], "invalid JSON"),
    "qlora zero3": (lambda p: ["--zero_stage", "3", "--quant_bits", "4"], "QLoRA) under ZeRO-3"),
    "qlora zero3 file": (
        lambda p: ["--deepspeed", _json(p, {"zero_optimization": {"stage": 3}}), "--quant_bits", "4"],
        "under ZeRO-3",
    ),
    "optimizer section": (
        lambda p: ["--deepspeed", _json(p, {"optimizer": {"type": "AdamW"}})],
        "has an `optimizer` section",
    ),
    "gradient clipping": (lambda p: ["--deepspeed", _json(p, {"gradient_clipping": 1.0})], "gradient_clipping=1.0"),
    "fp16 section": (lambda p: ["--deepspeed", _json(p, {"fp16": {"enabled": True}})], "fp16 under DeepSpeed"),
    "fp16 precision": (lambda p: ["--zero_stage", "2", "--precision", "fp16"], "precision=fp16 under DeepSpeed"),
    "scheduler section": (lambda p: ["--deepspeed", _json(p, {"scheduler": {"type": "WarmupLR"}})], "`scheduler`"),
    "batch size": (
        lambda p: ["--deepspeed", _json(p, {"train_micro_batch_size_per_gpu": 8})],
        "train_micro_batch_size_per_gpu=8, the trainer's keys make it 4",
    ),
    "global batch size": (
        lambda p: ["--deepspeed", _json(p, {"train_batch_size": 99})],
        "train_batch_size=99, the trainer's keys make it 8 (batch_size x grad_accum x ranks)",
    ),
    "bf16 without precision bf16": (
        lambda p: ["--deepspeed", _json(p, {"bf16": {"enabled": True}}), "--precision", "fp32"],
        "enables bf16 but this run's precision is fp32",
    ),
    "offload without stage": (lambda p: ["--offload_optimizer", "cpu"], "offload_optimizer=cpu needs zero_stage"),
    "stage": (lambda p: ["--zero_stage", "4"], "zero_stage must be in [0, 3], got 4"),
    "stage in file": (lambda p: ["--deepspeed", _json(p, {"zero_optimization": {"stage": 5}})], "stage must be 0"),
    "muon zero3": (lambda p: ["--zero_stage", "3", "--optim", "muon"], "optim muon under --zero_stage 3"),
    "muon 8bit zero2": (
        lambda p: ["--zero_stage", "2", "--optim", "muon", "--tuner", "full", "--state_precision", "8bit"],
        "optim muon with state_precision 8bit under --zero_stage 2",
    ),
    "muon offload": (
        lambda p: ["--zero_stage", "2", "--offload_optimizer", "cpu", "--optim", "muon"],
        "run at ZeRO 0-2 without offload_optimizer",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_deepspeed_input_is_one_line_before_the_model_loads(case, sft, tmp_path, monkeypatch):

    from fused_stable.train.model import load

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the DeepSpeed input was checked")

    monkeypatch.setattr(load, "load_base_model", no_model)
    argv, expected = REFUSALS[case]
    code, _, err = sft(*TINY, *argv(tmp_path), "--output_dir", tmp_path / "run")
    assert code == 2 and err.count("\n") == 1 and err.startswith(ERROR_PREFIX), err
    assert expected in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("saved, now", [(2, None), (None, 2), (2, 3)])
def test_resume_through_another_engine_is_refused(tmp_path, saved, now):
    from fused_stable.errors import UserError
    from fused_stable.train.config.resolve import resolve_config
    from fused_stable.train.run import deepspeed_run

    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "zero_stage": saved}))
    cfg, _ = resolve_config([] if now is None else ["--zero_stage", str(now)])
    with pytest.raises(UserError, match="resume it with the run's own deepspeed / zero_stage keys"):
        deepspeed_run.check_resume(str(tmp_path), cfg)
    cfg, _ = resolve_config([] if saved is None else ["--zero_stage", str(saved)])
    deepspeed_run.check_resume(str(tmp_path), cfg)  # the engine that wrote it


def test_a_llamafactory_zero3_config_is_filled_by_the_trainer(tmp_path):
    """LLaMA-Factory's examples/deepspeed/ds_z3_config.json as it ships (every size "auto", fp16 "auto"): the
    trainer fills what the HF Trainer fills there, and the integration's keys are set."""
    from fused_stable.train.config.resolve import resolve_config
    from fused_stable.train.run import deepspeed_run

    ds = json.loads((Path(__file__).parent / "llamafactory_ds_z3_config.json").read_text())
    cfg, _ = resolve_config(["--deepspeed", _json(tmp_path, ds), "--batch_size", "2", "--grad_accum", "3"])

    class Model:
        class config:
            hidden_size = 64

    out = deepspeed_run.engine_config(cfg, Model(), "bf16")
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"], out["train_batch_size"]) == (
        2,
        3,
        6,
    )
    assert out["bf16"]["enabled"] is True and out["fp16"]["enabled"] is False and out["gradient_clipping"] == 0
    zero_cfg = out["zero_optimization"]
    assert (zero_cfg["reduce_bucket_size"], zero_cfg["stage3_param_persistence_threshold"]) == (64 * 64, 640)
    assert zero_cfg["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert out["zero_allow_untested_optimizer"] is True
