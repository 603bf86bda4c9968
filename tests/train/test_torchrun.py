"""`fused-stable sft` under `torchrun --standalone --nproc-per-node 2` on CPU (gloo): LoRA under DDP and full
fine-tuning under FSDP2, each rank on its own shard of the rows, rank 0 alone writing output_dir, the logged
loss the mean over the ranks, checkpoints resumable under torchrun bit for bit, the guard's rollback taking
every rank back together, and bad input refused with one line from rank 0."""

import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from sft_helpers import REPO_ROOT, TINY, read_metrics, setup_run

from fused_stable.integrations.distributed import shard_data
from fused_stable.train.data.instructions import IGNORE_INDEX, BatchOrder
from fused_stable.train.run import checkpoint, outputs
from fused_stable.train.run.report import read_alerts

# 4 steps of 2 micro-batches of 4 rows per rank, a checkpoint every 2 steps, all kept
RUN = [*TINY, "--logging_steps", "1", "--save_total_limit", "0"]
ERROR_PREFIX = "fused-stable sft: error:"


def torchrun(*argv, program=("-m", "fused_stable"), env=None, timeout=300):
    """`torchrun --standalone --nproc-per-node 2 PROGRAM sft ARGV` in a fresh process tree (its own free
    rendezvous port); one OpenMP thread per rank on this 2-core machine."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    # PYTHONFAULTHANDLER: a rank that aborts (issue 52's rare SIGABRT at exit) prints every thread's Python stack
    env = {
        **{k: v for k, v in os.environ.items() if k not in launch},
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *program,
        "sft",
        *map(str, argv),
    ]
    return subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _window_loss(model, window):
    """The loop's loss: summed over the window's answer tokens / their count."""
    total = 0.0
    for b in window:
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        total = total + F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)),
            b.labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
    return total / sum(b.num_label_tokens for b in window)


def first_step_reference(tmp_path, *argv):
    """Step 1 (before any update) of a 2-rank run, computed in this one process: each rank's loss on its shard
    (every 2nd row from its rank) and the norm of the rank-averaged gradient, which is what DDP and FSDP2
    give the optimizer. The model is in eval mode: right for full fine-tuning (the tiny Llama has no dropout)
    and for LoRA's step-1 loss (B starts at zero, so the adapters' dropout cannot change it)."""
    setup = setup_run(*argv, "--output_dir", tmp_path / "reference")
    model, cfg, batches = setup.model, setup.cfg, setup.trainer.batches
    model.eval()
    losses, grads = [], []
    for rank in range(2):
        order = BatchOrder(shard_data(batches.items, rank, 2), cfg.batch_size, cfg.seed, batches.pad_id)
        loss = _window_loss(model, [order.batch(i) for i in range(cfg.grad_accum)])
        params = [p for p in model.parameters() if p.requires_grad]
        grads.append(torch.autograd.grad(loss, params))
        losses.append(float(loss.detach()))
    mean_grads = [(a + b) / 2 for a, b in zip(*grads)]
    return losses, float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in mean_grads])))


def _check_rank0_outputs(out, steps, saved):
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # one writer: no duplicated rows
    for name in ("run.yaml", "curves.png", saved):
        assert os.path.exists(out / name), name
    ckpts = sorted(os.listdir(out / "checkpoints"))
    assert ckpts == [f"step-{s}" for s in range(2, steps + 1, 2)]  # nothing half-written left behind
    for name in ckpts:
        assert os.path.isfile(out / "checkpoints" / name / "COMPLETE")
        state = json.loads((out / "checkpoints" / name / "trainer_state.json").read_text())
        assert state["world_size"] == 2
    return rows


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_fault_script.py")


def torchrun_reporting_threads(tmp_path, *argv):
    """torchrun(ARGV) through torchrun_fault_script, which reports each rank's process-group threads at exit
    (tmp_path/threads/threads-rank-R.txt); returns the run and that folder."""
    folder = tmp_path / "threads"
    folder.mkdir()
    return torchrun(*argv, program=(SCRIPT,), env={"GROUP_THREADS_AT_EXIT": str(folder)}), folder


def assert_group_freed(folder):
    """Every rank freed its process group before the interpreter shut down: no gloo worker was left to release a
    collective's tensors during shutdown, which aborted ranks now and then (issue 52: torch.distributed.nn imported
    after init_process_group, and DTensor's caches, held the group past destroy_process_group)."""
    for rank in (0, 1):
        assert (folder / f"threads-rank-{rank}.txt").read_text() == "[]", rank


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "straight"
    proc, threads = torchrun_reporting_threads(out.parent, *RUN, "--output_dir", out)
    _ok(proc)
    assert_group_freed(threads)
    return out, proc


def test_lora_ddp_two_ranks_rank0_outputs_and_mean_loss(ddp_run, tmp_path):
    out, proc = ddp_run
    # rank 0 alone prints and writes: one banner, one summary, one set of files
    assert proc.stdout.count("fused-stable sft: model=tiny tuner=lora") == 1
    assert proc.stdout.count("done: steps 0->4") == 1
    rows = _check_rank0_outputs(out, 4, "adapter")
    assert os.path.isfile(out / "adapter" / "adapter_config.json")
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    # the same adapter as the last checkpoint (the DDP wrapper's `module.` prefix stripped)
    ckpt = load_file(out / "checkpoints" / "step-4" / "weights.safetensors")
    assert all(k.startswith("base_model.model.") and "lora_" in k for k in ckpt)
    assert sum(v.numel() for v in ckpt.values()) == sum(v.numel() for v in adapter.values())
    # the header's optimizer state is a rank's, which DDP replicates: 8 bytes an adapter element (fp32 exp_avg,
    # exp_avg_sq) and 4 of `step` a tensor
    mib = round((8 * sum(v.numel() for v in ckpt.values()) + 4 * len(ckpt)) / 2**20, 3)
    assert outputs.read_manifest(str(out))["optimizer_state"] == {"precision": "fp32", "mib": mib}
    assert proc.stdout.count(f"optimizer state fp32 {mib:.1f} MiB per rank (DDP replicates it) |") == 1

    # each rank trained on its own half of the rows and the logged loss is the mean of the two
    per_rank, _ = first_step_reference(tmp_path, *RUN)
    assert abs(per_rank[0] - per_rank[1]) > 1e-3
    assert rows[0]["loss"] == pytest.approx(sum(per_rank) / 2, rel=1e-5)
    # every rank's RNG stream is saved (their dropout masks differ, so the streams do too)
    rng = torch.load(out / "checkpoints" / "step-2" / "rng.pt", weights_only=False)
    assert len(rng["ranks"]) == 2 and not torch.equal(rng["ranks"][0]["torch"], rng["ranks"][1]["torch"])


def test_ddp_resume_matches_the_uninterrupted_run(ddp_run, tmp_path):
    straight, _ = ddp_run
    # the run as a kill after the step-2 checkpoint leaves it (a half-written step-4 is ignored)
    broken = tmp_path / "broken"
    shutil.copytree(straight, broken)
    shutil.rmtree(broken / "adapter")
    os.rename(broken / "checkpoints" / "step-4", broken / "checkpoints" / ".tmp-step-4-123")
    proc = _ok(torchrun("--output_dir", broken, "--resume", "latest"))
    assert "resumed from" in proc.stdout and proc.stdout.count("done: steps 2->4") == 1

    a, b = read_metrics(straight), read_metrics(broken)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # exact floats
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    wa = load_file(straight / "checkpoints" / "step-4" / "weights.safetensors")
    wb = load_file(broken / "checkpoints" / "step-4" / "weights.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa = torch.load(straight / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    ob = torch.load(broken / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    for key, state in oa["state"].items():
        for k, v in state.items():
            assert torch.equal(v, ob["state"][key][k]), (key, k)


def test_resume_with_another_process_count_is_refused(ddp_run, sft, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(ddp_run[0], copy)
    code, _, err = sft("--output_dir", copy, "--resume", "latest")  # a single process
    assert code == 2
    assert err.count("\n") == 1 and "run of 2 process(es)" in err and "--nproc-per-node 2" in err


@pytest.mark.slow  # two FSDP2 launches: ~18 s on a quiet 2-core machine, ~30 s on a loaded one
def test_fsdp2_full_two_ranks_and_exact_resume(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "full"
    args = [*RUN, "--tuner", "full", "--lr", "1e-3"]
    traces = tmp_path / "traces"
    traces.mkdir()
    env = {"DEEPSPEED_IMPORT_TRACE": str(traces), "GROUP_THREADS_AT_EXIT": str(traces)}
    proc = _ok(torchrun(*args, "--output_dir", out, program=(SCRIPT,), env=env))
    assert proc.stdout.count("done: steps 0->4") == 1
    assert_group_freed(traces)
    # no rank imports deepspeed (the final save used to, through accelerate's unwrap: issue 52's aborts at exit)
    for rank in (0, 1):
        assert (traces / f"rank-{rank}.txt").read_text() == "deepspeed loaded: False\n"
    assert "Setting accelerator" not in proc.stderr
    rows = _check_rank0_outputs(out, 4, "model")
    # each rank on its own rows; the loss is the mean over ranks, the grad norm the global one over the shards
    per_rank, grad_norm = first_step_reference(tmp_path, *args)
    assert rows[0]["loss"] == pytest.approx(sum(per_rank) / 2, rel=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert rows[-1]["loss"] < rows[0]["loss"]

    # checkpoint and final model hold the whole (unsharded) model, gathered from the two shards
    weights = load_file(out / "checkpoints" / "step-4" / "weights.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)
    params = dict(model.named_parameters())
    assert weights.keys() == params.keys()
    for name, value in weights.items():
        assert torch.equal(params[name].detach(), value), name
    optim = torch.load(out / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    assert optim["state"]["lm_head.weight"]["exp_avg"].shape == params["lm_head.weight"].shape
    assert int(optim["fused_stable"]["istate"][0]) == 4  # FusedAdamW's counters ride along
    # the header's optimizer state is rank 0's shard: FSDP2 gives it the first ceil(rows / 2) rows of each param
    shard = sum(math.ceil(v.shape[0] / 2) * v[0].numel() for v in weights.values())
    mib = round((8 * shard + 4 * len(weights)) / 2**20, 3)
    assert outputs.read_manifest(str(out))["optimizer_state"] == {"precision": "fp32", "mib": mib}
    assert proc.stdout.count(f"optimizer state fp32 {mib:.1f} MiB on rank 0 (FSDP2 shards it over 2 ranks) |") == 1

    broken = _resumed_from_step_2(tmp_path, out, rows, weights)
    resumed_optim = torch.load(broken / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)
    assert torch.equal(resumed_optim["fused_stable"]["fstate"], optim["fused_stable"]["fstate"])


def test_fsdp2_full_muon_two_ranks_and_exact_resume(tmp_path):
    """`--optim muon --tuner full` under torchrun: FSDP2 shards the hidden matrices by rows, FusedMuon brings each
    whole to its owner rank for Newton-Schulz (it was refused here until FSDP2 Muon existed). The hidden matrices
    hold Muon's momentum_buffer (none went to AdamW), the first step is the ranks' mean loss and the global norm,
    and a resume from the step-2 checkpoint continues bit for bit."""
    out = tmp_path / "muon"
    args = [*RUN, "--tuner", "full", "--optim", "muon", "--lr", "1e-3"]
    proc, threads = torchrun_reporting_threads(tmp_path, *args, "--output_dir", out)
    _ok(proc)
    assert_group_freed(threads)
    assert "optim=muon (FusedMuon)" in proc.stdout
    rows = _check_rank0_outputs(out, 4, "model")
    per_rank, grad_norm = first_step_reference(tmp_path, *args)
    assert rows[0]["loss"] == pytest.approx(sum(per_rank) / 2, rel=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert rows[-1]["loss"] < rows[0]["loss"]
    state = torch.load(out / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)["state"]
    hidden = [name for name in state if name.endswith(("q_proj.weight", "down_proj.weight"))]
    assert hidden and all(set(state[name]) == {"momentum_buffer", "step"} for name in hidden), state.keys()
    assert "exp_avg" in state["lm_head.weight"]  # the head on AdamW, as muon_param_groups splits it

    _resumed_from_step_2(tmp_path, out, rows, load_file(out / "checkpoints" / "step-4" / "weights.safetensors"))


def _resumed_from_step_2(tmp_path, out, rows, weights):
    """The finished 2-rank run `out` without its step-4 checkpoint and final model, resumed with `--resume
    latest` (from step 2): its losses are `rows`' and its step-4 weights `weights`, bit for bit. Returns its
    folder."""
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    shutil.rmtree(broken / "checkpoints" / "step-4")
    shutil.rmtree(broken / "model")
    _ok(torchrun("--output_dir", broken, "--resume", "latest"))
    assert [r["loss"] for r in read_metrics(broken)] == [r["loss"] for r in rows]
    resumed = load_file(broken / "checkpoints" / "step-4" / "weights.safetensors")
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)
    return broken


def test_guard_rollback_takes_every_rank_back_together(tmp_path):
    # non-finite logits on 3 micro-batches in a row, on both ranks: a storm the guard answers with a rollback
    # to the step-10 checkpoint; if the ranks disagreed (decision or checkpoint) the run would hang or diverge
    out = tmp_path / "fault"
    proc = _ok(
        torchrun(
            "--model",
            "tiny",
            "--dataset",
            "arithmetic",
            "--arithmetic_examples",
            64,
            "--batch_size",
            2,
            "--grad_accum",
            1,
            "--max_length",
            96,
            "--tensorboard",
            "false",
            "--logging_steps",
            5,
            "--save_steps",
            10,
            "--max_steps",
            20,
            "--guard",
            "rollback",
            "--output_dir",
            out,
            program=(SCRIPT,),
            env={"FAULT_BATCHES": "12,13,14"},
        )
    )
    assert proc.stdout.count("done: steps 0->20") == 1
    rollbacks = [a for a in read_alerts(str(out)) if a["action"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["detected_at"] == 15  # written once, by rank 0
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 21))  # rewound to step 10, then 11..20 again
    state = json.loads((out / "checkpoints" / "step-20" / "trainer_state.json").read_text())
    assert state["rollbacks"] == 1 and state["micro_batches"] == 25  # the faulty window is not replayed
    assert all(math.isfinite(r["loss"]) for r in read_metrics(out)[10:])


def test_a_rank_killed_mid_run_stops_the_others_with_one_line_and_resume_continues_exactly(ddp_run, tmp_path):
    """Rank 1 is SIGKILLed after step 3 (an OOM kill, a lost node): rank 0 meets the dead peer in its next
    collective (or torchrun's SIGTERM first) and stops at once with one line naming the newest complete
    checkpoint; nothing it has not finished is taken for a checkpoint; `--resume latest` then gives the
    uninterrupted run's losses and weights."""
    straight, _ = ddp_run
    out, death = tmp_path / "killed", tmp_path / "death"
    proc = torchrun(*RUN, "--output_dir", out, program=(SCRIPT,), env={"KILL_RANK": "1:3", "DEATH_FILE": str(death)})
    ended = time.time()
    assert proc.returncode != 0
    # torchrun stops the group as soon as a worker dies and kills what is left 30 s later: rank 0 must have
    # ended on its own, with its line, well within that
    assert ended - float(death.read_text()) < 60
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fused-stable sft: error:")]
    step2 = out / "checkpoints" / "step-2"
    assert len(lines) == 1 and lines[0].startswith("fused-stable sft: error: rank 0: another rank stopped ("), lines
    assert lines[0].endswith(
        f"the newest complete checkpoint, {step2}, is intact; continue: "
        f"torchrun --standalone --nproc-per-node 2 -m fused_stable sft --output_dir {out} --resume latest"
    )
    # no worker traceback (a library's warning lines carry the same "[rankN]:" prefix: they are not errors)
    assert not [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]
    codes = {ln.split(":")[1].split()[0] for ln in proc.stderr.splitlines() if ln.strip().startswith("exitcode")}
    assert codes == {"1", "-9"}, proc.stderr[-3000:]  # rank 0 exited 1 by itself; rank 1 was SIGKILLed
    assert [step for step, _ in checkpoint.list_checkpoints(str(out))] == [2]

    proc = _ok(torchrun("--output_dir", out, "--resume", "latest"))
    assert f"resumed from {step2}" in proc.stdout
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(straight)]
    wa = load_file(straight / "checkpoints" / "step-4" / "weights.safetensors")
    wb = load_file(out / "checkpoints" / "step-4" / "weights.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bad_input_one_line_from_rank0_exit_2(tmp_path):
    # the `fused-stable` console script under torchrun; the output_dir holds another tool's file
    script = os.path.join(os.path.dirname(sys.executable), "fused-stable")
    assert os.path.isfile(script), "the package's console script is not installed next to this python"
    out = tmp_path / "taken"
    out.mkdir()
    (out / "run.yaml").write_text("lr: 0.1\n")
    proc = torchrun(*TINY, "--output_dir", out, program=(script,))
    assert proc.returncode != 0
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if ERROR_PREFIX in line]
    assert len(ours) == 1 and "is not a fused-stable run" in ours[0], proc.stderr[-3000:]
    # no worker traceback (a library's warning lines carry the same "[rankN]:" prefix: they are not errors)
    assert not [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]
    # torchrun's own summary: the workers exited with code 2 (one may instead show the SIGTERM torchrun sends
    # the rest of the group as soon as the first one has exited)
    codes = {line.split(":")[1].split()[0] for line in proc.stderr.splitlines() if line.strip().startswith("exitcode")}
    assert "2" in codes and codes <= {"2", "-15"}, (codes, proc.stderr[-6000:])
    assert os.listdir(out) == ["run.yaml"] and (out / "run.yaml").read_text() == "lr: 0.1\n"


def test_incomplete_torchrun_environment_is_one_line(sft, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    code, _, err = sft(*TINY, "--output_dir", tmp_path / "run")
    assert code == 2 and err.count("\n") == 1 and "MASTER_ADDR" in err and "torchrun" in err
    assert not (tmp_path / "run").exists()
