"""The engine matrix (issue 52 item 3): every rule x engine x state precision either follows its rule or is refused
in one line that says why. No cell may run another rule's update, or skip its rule, in silence.

Engines: a plain loop, `torch.compile(opt.step)` (dynamo, eager backend), the HF Trainer through
`fused_trainer_optimizers`, Lightning with `FusedStableCallback`, and on 2 gloo ranks DDP, FSDP2 and DeepSpeed
ZeRO-1/2/3 (each engine's cells in one pair of processes, shared by the pytest-xdist workers).
How a cell is judged: engine_cells.py's doc (record, then replay the rule's fused optimizer
and its reference from the recorded grads).

The table of docs/integrations.md ("The engine matrix") is `render()` of this module's cells; the test below fails
when they differ, printing the table to paste.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import engine_cells as cells
import pytest
import torch
import torch.multiprocessing as mp

ENGINES = ["plain", "compile", "hf", "lightning", "ddp", "fsdp2", "zero1", "zero2", "zero3"]
SPAWNED = ("ddp", "fsdp2", *cells.ZERO_STAGES)  # on 2 gloo ranks, each engine's cells in one pair of processes
# a refusal: (rule, engine or "*", precision or "*") -> the words its one line must hold
REFUSED = {
    ("adafactor", "*", "bf16"): "rows \\+ cols values per matrix",
    ("adafactor", "*", "8bit"): "rows \\+ cols values per matrix",
    ("adafactor", "compile", "fp32"): "does not run inside torch.compile",
    ("adafactor", "fsdp2", "*"): "Adafactor groups do not run under FSDP2 yet",
    ("muon", "fsdp2", "8bit"): "8-bit momentum is coded in blocks over each whole matrix",
    **{("adafactor", zero, "fp32"): "DeepSpeed ZeRO steps flat partitions" for zero in ("zero1", "zero2", "zero3")},
    ("muon", "zero1", "8bit"): "8-bit momentum in blocks over whole matrices, and ZeRO 1 steps flat partitions",
    ("muon", "zero2", "8bit"): "8-bit momentum in blocks over whole matrices, and ZeRO 2 steps flat partitions",
    ("muon", "zero3", "*"): "Muon groups do not run under ZeRO-3 yet",
}
# engines whose global norm is summed across ranks from each shard's sums: the clip coefficient may differ from
# one process's in its last fp32 bit, so the cell is held to the floor of the fused replay with that coefficient
# one ulp off (or every grad one ulp moved) instead of its bits
SHARD_NORMS = ("fsdp2",)
# the identity margin: a cell's update is this many times nearer to its rule's reference than to any other rule's
MARGIN = 10.0
DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def refusal(rule: str, engine: str, precision: str) -> str | None:
    for key in ((rule, engine, precision), (rule, engine, "*"), (rule, "*", precision)):
        if key in REFUSED:
            return REFUSED[key]
    return None


CELLS = [(r, e, p) for r in cells.RULES for e in ENGINES for p in cells.PRECISIONS]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """`records(engine)`: the folder of a multi-rank engine's cells, run once on 2 gloo ranks (one spawn for all
    its cells), rank 0's records by cell; under pytest-xdist the workers share the one run (a lock in their common
    temporary folder)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    # a worker's base is <session>/popen-gwN: the session's folder is the one the workers share
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def records(engine: str) -> Path:
        out = shared / f"engine-matrix-{engine}"
        with FileLock(str(out) + ".lock"):
            if not (out / "done").exists():
                out.mkdir(exist_ok=True)
                args = (2, str(out / "store"), str(out), engine)
                mp.start_processes(cells.spawned_rank, args=args, nprocs=2, start_method="spawn")
                (out / "done").touch()
        return out

    return records


def run(rule: str, engine: str, precision: str, tmp_path: Path, spawned) -> dict:
    """The cell's record, or {"refused": its line}."""
    if engine in SPAWNED:
        return torch.load(spawned(engine) / f"{rule}-{precision}.pt", weights_only=False)
    try:
        if engine in ("plain", "compile"):
            return cells.run_plain(rule, precision, compiled=engine == "compile")
        if engine == "hf":
            return cells.run_hf(rule, precision, str(tmp_path))
        return cells.run_lightning(rule, precision, str(tmp_path))
    except (ValueError, NotImplementedError) as exc:
        return {"refused": str(exc)}
    except Exception as exc:  # torch.compile wraps what the step raised (a refusal there is a RuntimeError)
        cause = exc.__cause__ or exc.__context__
        if engine == "compile" and isinstance(cause, (ValueError, NotImplementedError, RuntimeError)):
            return {"refused": str(cause).split("\n\nfrom user code:")[0]}  # dynamo appends where it was raised
        raise


def fused_replay(rule: str, precision: str, record: dict) -> dict:
    """The record's grads through the rule's fused optimizer as the test builds it, in the cell's param order."""
    return cells.replay(record, lambda net: [cells.fused(rule, precision, net, record["order"], backend="torch")])


def reference(rule: str, record: dict) -> dict:
    return cells.replay(record, lambda net: cells.references(rule, net))


def coefficient_floor(rule: str, precision: str, record: dict, fused: dict) -> float:
    """How far the fused replay moves with the clip coefficient one fp32 ulp either way, or every grad one ulp."""
    moved = [cells.scaled(record, 1 + 2**-23), cells.scaled(record, 1 - 2**-24), cells.moved(record, 1)]
    return max(cells.distance(fused_replay(rule, precision, grads), fused, record["first"]) for grads in moved)


def assert_its_rule(rule: str, precision: str, params: dict, record: dict, floor_check: bool = True) -> None:
    """`params` (after the record's steps) took its rule's update: MARGIN times nearer to the rule's reference
    replayed on the record than to any other rule's; in fp32 (`floor_check`) within 4x the reference's one-ulp
    floor."""
    first, own = record["first"], reference(rule, record)
    near = cells.distance(params, own, first)
    others = {other: cells.distance(params, reference(other, record), first) for other in cells.RULES if other != rule}
    nearest = min(others, key=others.get)
    assert near * MARGIN < others[nearest], f"{rule} {precision}: {near:.3g} from its reference, {others}"
    if precision == "fp32" and floor_check:
        floor = cells.distance(reference(rule, cells.moved(record, 1)), own, first)
        assert near <= 4 * floor + 1e-7, f"{rule}: {near:.3g} from torch's, floor {floor:.3g}"


def assert_follows_its_rule(rule: str, engine: str, precision: str, record: dict) -> None:
    """The engine's params are the plain-loop replay of the rule's fused optimizer bit for bit (SHARD_NORMS: within
    4x the replay's coefficient floor), and that replay took its rule's update (`assert_its_rule`)."""
    fused = fused_replay(rule, precision, record)
    if engine in SHARD_NORMS:
        off = cells.distance(record["last"], fused, record["first"])
        floor = coefficient_floor(rule, precision, record, fused)
        assert off <= 4 * floor, f"{engine} {rule} {precision}: {off:.3g} from the fused replay, floor {floor:.3g}"
    else:
        for name, value in record["last"].items():
            assert torch.equal(value, fused[name]), f"{name}: the engine's step is not its rule's ({rule}, {precision})"
    assert_its_rule(rule, precision, fused, record)


def assert_zero_follows_its_rule(rule: str, precision: str, result: dict, ddp: dict) -> None:
    """A ZeRO cell (no per-param grads to record: the optimizer sees flat partitions) against DDP's record of the
    same model, data and rule: the same first params, the engine's STEPS steps, and final params that took its
    rule's update on DDP's grads (`assert_its_rule`'s margin). Not held to a floor: its grads are not DDP's in the
    last bits (ZeRO's own reduction), which AdamW's update amplifies (ZeRO-3, fp32: 7.5e-6 from torch's on DDP's
    grads after 3 steps, against a 1.4e-7 floor); each engine's closeness to one process is its own tests'
    (test_integ_deepspeed.py)."""
    assert result["steps"] == cells.STEPS, f"{result['steps']} engine steps, not {cells.STEPS}"
    assert all(torch.equal(result["first"][n], ddp["first"][n]) for n in ddp["first"])
    assert_its_rule(rule, precision, result["last"], ddp, floor_check=False)


@pytest.mark.parametrize("rule, engine, precision", CELLS, ids=["-".join(c) for c in CELLS])
def test_a_cell_follows_its_rule_or_refuses_in_one_line(rule, engine, precision, tmp_path, request):
    spawned = request.getfixturevalue("spawned") if engine in SPAWNED else None
    result = run(rule, engine, precision, tmp_path, spawned)
    words = refusal(rule, engine, precision)
    if words is not None:
        assert "refused" in result, f"{rule} x {engine} x {precision} ran; the matrix says it is refused ({words})"
        line = result["refused"]
        assert "\n" not in line.strip() and re.search(words, line), line
        return
    assert "refused" not in result, f"{rule} x {engine} x {precision} refused: {result.get('refused')}"
    if engine in cells.ZERO_STAGES:
        assert_zero_follows_its_rule(rule, precision, result, run(rule, "ddp", "fp32", tmp_path, spawned))
        return
    assert len(result["grads"]) == cells.STEPS, f"{len(result['grads'])} optimizer steps, not {cells.STEPS}"
    assert_follows_its_rule(rule, engine, precision, result)


def render() -> str:
    """The docs table: one row per rule and engine, a column per precision (ok: tested against its rule; refused:
    the words of its one line)."""
    lines = ["| rule | engine | " + " | ".join(cells.PRECISIONS) + " |", "|---|---|" + "---|" * len(cells.PRECISIONS)]
    for rule in cells.RULES:
        for engine in ENGINES:
            marks = []
            for precision in cells.PRECISIONS:
                words = refusal(rule, engine, precision)
                marks.append("ok" if words is None else "refused: " + words.replace("\\", ""))
            lines.append(f"| {rule} | {engine} | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def test_the_docs_table_is_the_matrix():
    table = render()
    assert table in DOCS.read_text(), f"docs/integrations.md's engine matrix differs from the cells; paste:\n{table}"
