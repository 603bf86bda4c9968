"""Smoke tests of `fused-stable bench` on CPU with tiny sizes: the table, the JSON and markdown it writes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fused_stable import state_format
from fused_stable.bench import main
from fused_stable.bench.contenders import CONTENDERS
from fused_stable.bench.measure import PASS_BYTES, bytes_per_step, quartiles
from fused_stable.bench.paramsets import lora_shapes, plan_sets
from fused_stable.cli import main as cli_main

FAST = [
    "--device",
    "cpu",
    "--threads",
    "1",
    "--warmup",
    "1",
    "--steps",
    "3",
    "--max-steps",
    "3",
    "--min-time",
    "0",
    "--input-sets",
    "2",
]


def _run(tmp_path, capsys, *extra):
    rc = cli_main(["bench", "--plan", "smoke", "--out", str(tmp_path), "--name", "r", *FAST, *extra])
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    return rc, out, result


def _row(result, set_name, contender):
    return next(r for r in result["rows"] if r["set"] == set_name and r["contender"] == contender)


def test_smoke_plan_table_json_and_markdown(tmp_path, capsys):
    rc, out, result = _run(tmp_path, capsys, "--compile", "off")
    assert rc == 0

    env = result["environment"]
    assert env["device_type"] == "cpu" and env["torch"] == torch.__version__
    assert env["date"] and env["triton"] and env["device"]
    assert result["copy_bandwidth_gbps"] > 0

    sets = {s["name"] for s in result["sets"]}
    assert {"dense-fp32", "dense-bf16", "lora-fp32", "amp-fp16"} <= sets
    assert any(name.startswith("sweep-") for name in sets)

    fused, base = _row(result, "dense-fp32", "fused_stable"), _row(result, "dense-fp32", "torch_fused")
    assert fused["status"] == base["status"] == "ok"
    assert fused["backend"] == "torch"  # CPU tensors take the torch path
    # the bytes model of issue 6 for fp32: 4 + 28 = 32 B/param fused, 40 with torch's foreach clip
    assert fused["bytes_per_param"] == pytest.approx(32.0)
    assert base["bytes_per_param"] == pytest.approx(40.0)
    assert _row(result, "dense-fp32", "torch_foreach")["bytes_per_param"] == pytest.approx(92.0)
    assert _row(result, "amp-fp16", "torch_scaler")["bytes_per_param"] == pytest.approx(48.0)
    assert _row(result, "amp-fp16", "fused_stable_scaler")["bytes_per_param"] == pytest.approx(32.0)
    assert base["speedup"] == pytest.approx(1.0)
    assert fused["speedup"] == pytest.approx(base["median_s"] / fused["median_s"])
    for r in (fused, base):
        assert r["steps"] == 3 and r["input_sets"] == 2
        assert r["q1_s"] <= r["median_s"] <= r["q3_s"]
        assert r["gbps"] == pytest.approx(r["bytes_per_step"] / r["median_s"] / 1e9)
        assert r["pct_copy_bw"] > 0 and r["host_cpu_s"] > 0 and r["copy_bw_gbps"] > 0
        assert r["pct_copy_bw"] == pytest.approx(100 * r["gbps"] / r["copy_bw_gbps"])
        assert r["launches_per_step"] is None and r["syncs_per_step"] is None  # CUDA-only figures
        assert r["peak_mem_bytes"] >= r["resident_bytes"] > 0
        # measured from the allocator: at least the two fp32 moments, and not far above them
        assert 8 * r["n_params"] <= r["optimizer_bytes"] <= 8.2 * r["n_params"]
    bf16 = _row(result, "dense-bf16", "torch_fused")
    assert 4 * bf16["n_params"] <= bf16["optimizer_bytes"] <= 4.2 * bf16["n_params"]  # torch: bf16 moments

    lora = _row(result, "lora-fp32", "fused_stable")
    assert lora["n_tensors"] == 56 and lora["status"] == "ok"
    apex = _row(result, "dense-fp32", "apex")
    assert apex["status"] == "skipped" and "CUDA" in apex["reason"]
    assert _row(result, "dense-fp32", "torch_compile")["status"] == "skipped"

    # one CPU goal line per fused_stable row, each with a measured ratio
    cpu_goals = [g for g in result["goals"] if g["goal"].startswith("CPU:")]
    assert len(cpu_goals) == len(sets) and all(g["value"] is not None for g in cpu_goals)

    # the printed table names every set and contender, and the CUDA-only columns read n/a
    for name in ("dense-fp32", "lora-fp32", "amp-fp16", "fused_stable_scaler", "torch_foreach", "median ms"):
        assert name in out
    assert "n/a" in out

    md = (tmp_path / "r.md").read_text()
    table_rows = [line for line in md.splitlines() if line.startswith("| dense-fp32 (")]
    assert len(table_rows) == len(CONTENDERS) - 2  # every non-AMP contender has a dense-fp32 row
    assert "## Goals" in md and env["torch"] in md and "copy bandwidth" in md


def test_compile_contender_is_time_boxed_and_reported_as_skipped(tmp_path, capsys):
    rc, _, result = _run(
        tmp_path,
        capsys,
        "--sets",
        "dense-fp32",
        "--contenders",
        "torch_fused,torch_compile",
        "--compile",
        "on",
        "--compile-timeout",
        "1",
    )
    assert rc == 0
    row = _row(result, "dense-fp32", "torch_compile")
    assert row["status"] == "skipped" and "time box" in row["reason"]
    assert _row(result, "dense-fp32", "torch_fused")["status"] == "ok"


def test_gpu_plan_logic_runs_on_cpu_with_a_size_scale(tmp_path, capsys):
    # the sets gpu_check.sh benchmarks, shrunk 10^4-fold so their code path runs here
    rc, _, result = _run(
        tmp_path,
        capsys,
        "--plan",
        "gpu",
        "--size-scale",
        "1e-4",
        "--compile",
        "off",
        "--contenders",
        "fused_stable,torch_fused,fused_stable_scaler,torch_scaler,fused_stable_bf16,fused_stable_8bit,bnb_8bit,"
        "torchao_8bit",
    )
    assert rc == 0 and result["plan"] == "gpu"
    names = [s["name"] for s in result["sets"]]
    assert names[:4] == ["dense-fp32", "dense-bf16", "lora-fp32", "amp-fp16"] and len(names) == 8
    assert _row(result, "lora-fp32", "fused_stable")["n_tensors"] == 448
    contenders = {"bnb_8bit": "bitsandbytes", "torchao_8bit": "torchao"}  # the GPU plan's 8-bit contenders
    for r in result["rows"]:
        if r["contender"] in contenders:
            assert r["status"] == "skipped" and f"{contenders[r['contender']]} AdamW8bit" in r["reason"]
        else:
            assert r["status"] == "ok", r
    # the precision axis on both param dtypes: the state bytes and the byte model follow the format
    for set_name, param_bytes in (("dense-fp32", 4), ("dense-bf16", 2)):
        spec = next(s for s in plan_sets("gpu", 1e-4) if s.name == set_name)
        numels = [math.prod(shape) for shape in spec.shapes]
        n = sum(numels)
        for contender, precision in (
            ("fused_stable", "fp32"),
            ("fused_stable_bf16", "bf16"),
            ("fused_stable_8bit", "8bit"),
        ):
            r = _row(result, set_name, contender)
            # (the measure leaves out 1-element state tensors: step counters, and the moments of the 1-element
            # params this 10^4-fold shrink makes)
            state = sum(state_format.planned_bytes(k, precision) for k in numels if k > 1) / n
            assert r["state_bytes_per_param"] == pytest.approx(state), (set_name, contender)
            # norm reads the grad; the update reads param, grad and state and writes param and state
            assert r["bytes_per_param"] == pytest.approx(param_bytes * 4 + 2 * state), (set_name, contender)
    # 24 B/param for fp32 params with bf16 moments (the 1-element params' uncounted state: 0.003 short)
    assert _row(result, "dense-fp32", "fused_stable_bf16")["bytes_per_param"] == pytest.approx(24.0, abs=0.01)


def test_the_8bit_goals_compare_like_with_like():
    from fused_stable.bench.report import lowbit_goals

    def row(set_name, contender, speedup, **extra):
        return {"set": set_name, "contender": contender, "status": "ok", "speedup": speedup, **extra}

    rows = [
        row("dense-fp32", "fused_stable", 1.4),
        row("dense-fp32", "fused_stable_8bit", 2.8, pct_copy_bw=91.0),
        row("lora-fp32", "fused_stable_8bit", 6.0),
        row("lora-fp32", "bnb_8bit", 2.5),
    ]
    goals = {g["goal"]: g for g in lowbit_goals(rows)}
    assert [g["value"] for g in goals.values()] == pytest.approx([2.0, 2.8, 91.0, 2.4])
    assert [g["passed"] for g in goals.values()] == [True, True, True, False]
    skipped = [r for r in rows if r["contender"] != "bnb_8bit"]
    skipped.append({"set": "lora-fp32", "contender": "bnb_8bit", "status": "skipped", "reason": "no"})
    lora = [g for g in lowbit_goals(skipped) if g["set"] == "lora-fp32"][0]
    assert lora["value"] is None and lora["passed"] is None and "bitsandbytes" in lora["detail"]


def test_speedups_use_the_set_baseline_or_the_one_timed_alongside():
    from fused_stable.bench.runner import add_speedups

    def row(contender, median, **extra):
        return {"set": "s", "family": "dense", "contender": contender, "status": "ok", "median_s": median, **extra}

    rows = [
        row("torch_fused", 2.0),
        row("fused_stable", 1.0),
        row("torch_compile", 3.0, paired_baseline_median_s=6.0),
        {"set": "s", "family": "dense", "contender": "apex", "status": "skipped"},
    ]
    add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 2.0, 2.0, None]
    assert rows[1]["time_ratio"] == 0.5 and rows[0]["baseline"] == "torch_fused"


def test_bad_arguments_exit_2_with_a_one_line_error(tmp_path, capsys):
    assert main(["--device", "cpu", "--sets", "nope", "--out", str(tmp_path)]) == 2
    assert "matches none of" in capsys.readouterr().err
    assert main(["--device", "cpu", "--contenders", "torch_fuse", "--out", str(tmp_path)]) == 2
    assert "unknown torch_fuse" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["--device", "cuda", "--out", str(tmp_path)]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_bytes_model_and_shapes():
    assert len(lora_shapes(4096, 11008, 32, 16)) == 448
    # the model counts bytes from the actual tensors: bf16 params with fp32 state
    p = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p], fused=True)
    opt.step()
    # torch keeps bf16 moments for bf16 params: norm reads G=2, update moves 2P + G + 2S = 4 + 2 + 2*4 B/param
    assert bytes_per_step(("norm", "fused_update"), [p], opt) == 10 * (2 + 4 + 2 + 8)
    assert PASS_BYTES["foreach_update"](4, 4, 8) == 4 * 4 + 2 * 4 + 7 * 8
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    with pytest.raises(ValueError, match="unknown plan"):
        plan_sets("huge")


def test_bench_is_quiet_unless_asked(tmp_path, capfd):
    """The profiler behind the memory figures writes ~60 `USDT ... profiler_start/stop` lines to file
    descriptor 2 per run: hidden by default, shown with --verbose; every other stderr line passes through."""
    import os

    from fused_stable.bench import measure

    rc = cli_main(
        [
            "bench",
            "--plan",
            "smoke",
            "--sets",
            "dense-fp32",
            "--contenders",
            "fused_stable,torch_fused",
            "--compile",
            "off",
            "--out",
            str(tmp_path),
            "--name",
            "q",
            *FAST,
        ]
    )
    out, err = capfd.readouterr()
    assert rc == 0 and "dense-fp32" in out
    assert err == ""

    chatter = b"USDT:2026-11-30 16:52:22 6365:6365 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    for quiet in (True, False):
        measure.QUIET_PROFILER = quiet
        try:
            with measure._quiet_profiler():
                os.write(2, chatter)
                os.write(2, b"a real warning\n")
        finally:
            measure.QUIET_PROFILER = True
        err = capfd.readouterr().err
        assert ("USDT" in err) is not quiet and "a real warning" in err


def test_a_loaded_machine_is_said_so():
    from fused_stable.bench.cli import load_warning

    line = load_warning(threads=4, cores=2, load=10.5)
    assert line.startswith("warning: load average 10.5 on 2 cores leaves about 0.0 free for 4 thread(s)")
    assert "--threads 1" in line
    assert load_warning(threads=2, cores=16, load=3.0) is None
    assert load_warning(threads=2, cores=4, load=2.5) is not None  # 1.5 free cores for 2 threads
