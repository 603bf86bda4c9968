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


class _FakeClock:
    """perf_counter / process_time for measure.py that advance only when a fake step runs: step counts and the
    time budget are checked exactly, with no real timing."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def step(self, seconds_per_step):
        calls = []

        def run():
            calls.append(1)
            self.now += seconds_per_step(len(calls)) if callable(seconds_per_step) else seconds_per_step

        return run, calls


@pytest.fixture
def clock(monkeypatch):
    from fused_stable.bench import measure

    fake = _FakeClock()
    monkeypatch.setattr(measure.time, "perf_counter", fake)
    monkeypatch.setattr(measure.time, "process_time", fake)
    return fake


BUDGET = dict(warmup=3, min_steps=15, min_time=1.0, max_time=6.0, max_steps=1000)


@pytest.mark.parametrize(
    "step_s, budget, timed, warmup_steps",
    [
        # (step times are binary fractions, so the fake clock's sums are exact)
        (2**-6, {}, 64, 3),  # a fast row: --min-time decides (1 s / 15.6 ms); warm-up settled after --warmup steps
        (2**-6, {"max_steps": 40}, 40, 3),  # --max-steps caps it
        (0.25, {}, 15, 3),  # --steps is the floor (15 x 0.25 s = 3.75 s, within --max-time)
        (1.0, {}, 6, 1),  # a step of seconds: as many as --max-time allows; one warm-up step fills --min-time
        (2.5, {}, 3, 1),  # never fewer than 3 (quartiles)
        (2.5, {"max_time": 60.0}, 15, 1),
    ],
)
def test_the_time_budget_per_row_is_honoured(clock, step_s, budget, timed, warmup_steps):
    from fused_stable.bench import measure

    run, calls = clock.step(step_s)
    (timing,) = measure.time_steps([[run]], torch.device("cpu"), **{**BUDGET, **budget})
    assert timing["steps"] == timed and timing["warmup_steps"] == warmup_steps
    assert len(calls) == warmup_steps + timed  # on CPU the host time is read from the timed steps themselves
    assert timing["host_cpu_s"] == pytest.approx(step_s) and timing["median_s"] == pytest.approx(step_s)


def test_warm_up_runs_until_the_step_time_settles(clock):
    from fused_stable.bench import measure

    # first uses: 50 ms, 40 ms, 30 ms, then steady at 10 ms: settled once the last three agree
    run, calls = clock.step(lambda i: {1: 0.05, 2: 0.04, 3: 0.03}.get(i, 0.01))
    warm = measure.warm_up([run], torch.device("cpu"), min_steps=1, budget_s=10.0)
    assert warm == {"warmup_steps": 6, "warmup_settled": True, "step_s": pytest.approx(0.01)}
    # a step time that never settles stops at the budget and says so
    run, calls = clock.step(lambda i: 0.01 * (1 + i % 2))
    warm = measure.warm_up([run], torch.device("cpu"), min_steps=1, budget_s=0.295)
    assert warm["warmup_settled"] is False and len(calls) == warm["warmup_steps"] == 20
    # no budget (--min-time 0): exactly --warmup steps, every input set once
    run, calls = clock.step(lambda i: 0.05 / i)
    warm = measure.warm_up([run, run], torch.device("cpu"), min_steps=3, budget_s=0.0)
    assert len(calls) == warm["warmup_steps"] == 3 and warm["warmup_settled"] is False
    assert measure.warm_up([run, run], torch.device("cpu"), min_steps=1, budget_s=0.0)["warmup_steps"] == 2
    # the step under allocator tracking (runner._memory_step) counts: a step of seconds fills the budget alone
    run, calls = clock.step(4.0)
    warm = measure.warm_up([run], torch.device("cpu"), min_steps=3, budget_s=1.0, done=[4.0])
    assert calls == [] and warm["warmup_steps"] == 1


def test_budget_options_reach_the_run():
    from fused_stable.bench.cli import build_options, build_parser

    def options(*argv, plan="cpu"):
        return build_options(build_parser().parse_args(list(argv)), torch.device("cpu"), plan, [], ())

    cpu = options()
    assert (cpu.min_steps, cpu.min_time, cpu.max_time, cpu.max_steps, cpu.isolation) == (15, 1.0, 6.0, 1000, "row")
    given = options("--min-time", "2.5", "--max-steps", "7", "--max-time", "30", "--isolation", "none")
    assert (given.min_time, given.max_steps, given.max_time, given.isolation) == (2.5, 7, 30.0, "none")
    assert options(plan="gpu").isolation == options(plan="smoke").isolation == "none"


def _timed(contender, median, q1, q3, base=None, **extra):
    """A recorded row (times in ms), with the baseline timed alongside it as (median, q1, q3)."""
    from fused_stable.bench.measure import too_wide

    row = {"set": "dense-fp32", "family": "dense", "contender": contender, "status": "ok", "baseline": "torch_fused"}
    row.update(median_s=median / 1e3, q1_s=q1 / 1e3, q3_s=q3 / 1e3, too_wide=too_wide(q1, median, q3), **extra)
    if base is not None:
        row.update(paired_baseline_median_s=base[0] / 1e3, paired_baseline_q1_s=base[1] / 1e3)
        row.update(paired_baseline_q3_s=base[2] / 1e3, paired_baseline_too_wide=too_wide(*sorted(base)))
        row["time_ratio"] = median / base[0]
    return row


# issue 41's figures (2 cores, idle, main dfaa6a0): fused_stable inside the default plan, bimodal, and alone
IN_PLAN = _timed("fused_stable", 73.4, 26.6, 81.6, base=(44.9, 44.1, 45.9))
ALONE = _timed("fused_stable", 23.6, 23.4, 23.9, base=(32.4, 32.1, 32.8))
ALONE_AGAIN = _timed("fused_stable", 23.7, 23.5, 24.1, base=(32.4, 32.0, 32.9))


def test_a_row_with_a_spread_too_wide_is_flagged_and_gets_no_verdict():
    from fused_stable.bench.report import cpu_goals, gpu_goals, row_cells

    assert IN_PLAN["too_wide"] and not ALONE["too_wide"]
    (goal,) = cpu_goals([IN_PLAN])
    assert goal["passed"] is None and goal["value"] == pytest.approx(73.4 / 44.9)
    assert "spread too wide to judge" in goal["detail"] and "not judged" in goal["detail"]
    (goal,) = cpu_goals([ALONE])
    assert goal["passed"] is True and goal["detail"].startswith("met")
    # the baseline timed alongside too wide: no verdict either
    (goal,) = cpu_goals([_timed("fused_stable", 23.6, 23.4, 23.9, base=(32.4, 20.0, 45.0))])
    assert goal["passed"] is None and "torch_fused timed alongside" in goal["detail"]
    # narrow rows whose ratio band holds the bar (0.92..0.98 around 0.95): no verdict; wholly above it: missed
    (goal,) = cpu_goals([_timed("fused_stable", 30.8, 30.4, 31.2, base=(32.4, 31.8, 33.0))])
    assert goal["passed"] is None and "within the spread" in goal["detail"]
    (goal,) = cpu_goals([_timed("fused_stable", 40.0, 39.8, 40.2, base=(32.4, 32.1, 32.8))])
    assert goal["passed"] is False
    lora = _timed("fused_stable", 10.0, 4.0, 16.0, speedup=5.0)
    lora["set"] = "lora-fp32"
    assert [g["passed"] for g in gpu_goals([lora]) if g["set"] == "lora-fp32"] == [None]
    cells = row_cells(
        {**IN_PLAN, "n_params": 25_000_000, "n_tensors": 21, "bytes_per_param": 32.0, "gbps": 1.0}
        | {"steps": 15, "iqr_s": 0.055, "peak_mem_bytes": 0, "host_cpu_s": 0.07}
    )
    assert "spread too wide to judge" in cells[-1] and cells[3] == "26.600..81.600"


def test_the_agreement_rule_on_recorded_rows():
    """A row alone and inside the plan agree when their time-ratio bands (quartiles over the baseline timed
    alongside) overlap; a row too wide to judge gives no answer; narrow bands apart disagree."""
    from fused_stable.bench.report import rows_agree

    assert rows_agree(ALONE, ALONE_AGAIN, [], []) is True
    assert rows_agree(IN_PLAN, ALONE, [], []) is None
    # the same row under twice the load (row and baseline slowed alike) still agrees: ratios, not times
    loaded = _timed("fused_stable", 47.2, 46.8, 47.8, base=(64.8, 64.2, 65.6))
    assert rows_agree(ALONE, loaded, [], []) is True
    slowed = _timed("fused_stable", 35.0, 34.8, 35.3, base=(32.4, 32.1, 32.8))  # only the row slowed
    assert rows_agree(ALONE, slowed, [], []) is False


def test_a_row_alone_and_inside_the_plan_agree(tmp_path, capsys):
    """Each row runs in a fresh worker with the set's baseline (--isolation row, the cpu plan's default): the
    job a row's worker runs holds nothing of the rest of the plan, so the amp-fp16 row measured after the
    dense-fp32 exact-reference row is the same job as the row alone, and the two agree by the bench's own rule
    (time-ratio bands, so a load that changed between the runs does not count; on a machine too loaded to judge
    either, the rule says so rather than guess). Tiny sets: three workers in all."""
    from fused_stable.bench.report import EXACT_REFERENCE_NOTE, rows_agree

    common = ["--isolation", "row", "--compile", "off", "--steps", "15", "--max-steps", "15", "--sets"]
    amp = "torch_scaler,fused_stable_scaler"
    rc, _, alone = _run(tmp_path / "alone", capsys, *common, "amp", "--contenders", amp)
    assert rc == 0
    rc, _, plan = _run(tmp_path / "plan", capsys, *common, "dense-fp32,amp", "--contenders", f"fused_stable_8bit,{amp}")
    assert rc == 0
    assert [r["contender"] for r in plan["rows"]] == ["fused_stable_8bit", "torch_scaler", "fused_stable_scaler"]
    a, b = _row(alone, "amp-fp16", "fused_stable_scaler"), _row(plan, "amp-fp16", "fused_stable_scaler")
    assert a["status"] == b["status"] == "ok" and a["steps"] == b["steps"] == 15
    assert a["job"] == b["job"]  # measured by a worker of its own, with the same job
    assert _row(plan, "amp-fp16", "torch_scaler")["job"] == b["job"]  # the baseline row: timed alongside it
    assert rows_agree(a, b, alone["rows"], plan["rows"]) is not False, (a, b)
    # the exact-reference row says so in the table; the fp32-state rows do not
    eight = _row(plan, "dense-fp32", "fused_stable_8bit")  # 8-bit state now takes the compiled CPU update: no note
    assert eight["exact_reference"] is False and b["exact_reference"] is False
    assert eight["paired_baseline_median_s"] > 0  # timed alongside torch_fused, whose row is not asked for
    lines = (tmp_path / "plan" / "r.md").read_text().splitlines()
    assert EXACT_REFERENCE_NOTE not in next(line for line in lines if "| fused_stable_8bit |" in line)
    assert EXACT_REFERENCE_NOTE not in next(line for line in lines if "| fused_stable_scaler |" in line)


def test_the_exact_reference_note_follows_the_doors_the_step_took():
    """A row is noted (`exact_reference`, the table's EXACT_REFERENCE_NOTE) when its optimizer's plan updates some
    tensors with the exact tensor reference: 8-bit state on a transposed (non-contiguous) param, or anywhere
    without the compiled ops; not on a contiguous one."""
    from fused_stable import FusedAdamW
    from fused_stable.backends.torch import cpu_ops
    from fused_stable.bench.contenders import runs_exact_reference

    def stepped(param):
        param.grad = torch.ones_like(param)
        opt = FusedAdamW([param], state_precision="8bit", backend="torch")
        opt.step()
        return opt

    gen = torch.Generator().manual_seed(0)
    contiguous = torch.nn.Parameter(torch.randn(64, 128, generator=gen))
    transposed = torch.nn.Parameter(torch.randn(128, 64, generator=gen).t())
    assert runs_exact_reference(stepped(transposed)) is True
    assert runs_exact_reference(stepped(contiguous)) is (not cpu_ops.available())
