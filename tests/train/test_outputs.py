"""What a run owns in output_dir: the manifest, --overwrite removing exactly that and nothing else, a folder
that was never a run never called one, strict-JSON metrics, and nothing written by a start that fails."""

import hashlib
import json
import math
import os
import shutil

import pytest
from sft_helpers import REPO_ROOT, TINY, fit, read_metrics, setup_run

from fused_stable.train.run import outputs

RUN = ["--model", "tiny", *TINY, "--max_steps", "2"]


def snapshot(folder):
    """Every file and folder under `folder` with its content hash: equal snapshots = nothing changed."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), folder) + "/"] = None
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def _one_error_line(code, err):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fused-stable sft: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run with TensorBoard events; tests copy it before changing anything."""
    from fused_stable.train.run import sft as sft_command

    out = tmp_path_factory.mktemp("outputs") / "run"
    assert sft_command.main([str(a) for a in (*RUN, "--tensorboard", "true", "--output_dir", out)]) == 0
    return out


def _copy(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_a_run_records_what_it_creates(finished):
    manifest = outputs.read_manifest(str(finished))
    assert manifest["created_by"] == "fused-stable sft"
    assert set(manifest["entries"]) == {
        "run.yaml",
        "metrics.jsonl",
        "alerts.jsonl",
        "curves.png",
        "checkpoints",
        "adapter",
        "tensorboard",
    }
    # everything in the folder is either the manifest or named in it
    assert set(os.listdir(finished)) - {outputs.MANIFEST_FILE} <= set(manifest["entries"])


def test_tensorboard_is_a_dependency_and_a_run_writes_events(finished):
    """README's first command promises TensorBoard events: `pip install -e .` installs tensorboard (a plain
    dependency, not an extra), and a run writes the events."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert any(d.startswith("tensorboard") for d in dependencies)
    assert [n for n in os.listdir(finished / "tensorboard") if n.startswith("events.out.tfevents")]


def test_project_folder_is_never_called_a_run_and_never_overwritten(sft, tmp_path):
    """The reported case: a project folder with a base model in model/ and another tool's file in
    checkpoints/. It is not a run; --overwrite must not delete a thing."""
    project = tmp_path / "project"
    (project / "model").mkdir(parents=True)
    (project / "model" / "config.json").write_text('{"model_type": "llama"}\n')
    (project / "checkpoints").mkdir()
    (project / "checkpoints" / "other-tool.bin").write_bytes(b"\x00weights")
    before = snapshot(project)
    line = _one_error_line(*sft(*RUN, "--output_dir", project)[::2])
    assert "is not a fused-stable run" in line and "checkpoints/, model/" in line and "already holds a run" not in line
    line = _one_error_line(*sft(*RUN, "--output_dir", project, "--overwrite")[::2])
    assert "is not a fused-stable run" in line and "--overwrite never removes" in line
    assert snapshot(project) == before


def test_overwrite_refuses_when_the_run_folder_holds_foreign_files(sft, finished, tmp_path):
    out = _copy(finished, tmp_path)
    (out / "notes.txt").write_text("my notes\n")
    (out / "merged").mkdir()
    before = snapshot(out)
    line = _one_error_line(*sft(*RUN, "--output_dir", out, "--overwrite")[::2])
    assert "also holds files the run did not create (merged/, notes.txt)" in line and "nothing was removed" in line
    assert snapshot(out) == before


def test_overwrite_removes_exactly_the_previous_run(sft, finished, tmp_path):
    out = _copy(finished, tmp_path)
    # without --overwrite: refused, with both ways on
    line = _one_error_line(*sft(*RUN, "--output_dir", out)[::2])
    assert "already holds a run" in line and "--resume latest" in line and "--overwrite" in line
    code, _, err = sft(*RUN, "--max_steps", "1", "--save_steps", "1", "--output_dir", out, "--overwrite")
    assert code == 0, err
    # the old run's entries are gone (its step-2 checkpoint, its TensorBoard folder), the new run's are there
    assert sorted(os.listdir(out / "checkpoints")) == ["step-1"]
    assert not (out / "tensorboard").exists()
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert "tensorboard" not in outputs.read_manifest(str(out))["entries"]


def test_run_that_saved_no_checkpoint_suggests_overwrite(sft, tmp_path):
    out = tmp_path / "run"
    setup = setup_run(*RUN, "--output_dir", out)
    setup.start()  # the run began writing, then died before its first checkpoint
    setup.trainer.reporter.close()
    setup.release()  # as its death would
    line = _one_error_line(*sft(*RUN, "--output_dir", out)[::2])
    assert "saved no checkpoint" in line and "--overwrite" in line
    line = _one_error_line(*sft("--output_dir", out, "--resume", "latest")[::2])
    assert "no complete checkpoint" in line and "start it again with --overwrite" in line


def test_damaged_manifest_is_refused_not_guessed(sft, finished, tmp_path):
    out = _copy(finished, tmp_path)
    (out / outputs.MANIFEST_FILE).write_text('{"entries": "everything"}')
    before = snapshot(out)
    line = _one_error_line(*sft(*RUN, "--output_dir", out, "--overwrite")[::2])
    assert outputs.MANIFEST_FILE in line and "damaged" in line
    assert snapshot(out) == before


def refuse_constant(constant):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_metrics_are_strict_json_with_nonfinite_numbers_as_strings(tmp_path):
    """Steps whose loss and grad norm are not finite (logits forced to inf on two micro-batches): the rows are
    valid JSON for a strict parser, the non-finite values the strings "NaN" / "Infinity" (docs/trainer.md), and
    the reader gives the floats back."""
    out = tmp_path / "nan"
    setup = setup_run(*RUN, "--max_steps", "3", "--logging_steps", "1", "--output_dir", out)
    trainer = setup.trainer

    def poison(module, inputs, output):
        return output * float("inf") if trainer.state.micro_batches in (2, 3) else output

    setup.model.get_output_embeddings().register_forward_hook(poison)
    fit(setup)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=refuse_constant) for line in lines]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert math.isfinite(rows[0]["loss"]) and math.isfinite(rows[2]["loss"])
    assert rows[1]["loss"] in ("NaN", "Infinity") and rows[1]["grad_norm"] in ("NaN", "Infinity")
    assert rows[1]["skipped"] is True
    read = read_metrics(out)
    assert not math.isfinite(read[1]["loss"]) and not math.isfinite(read[1]["grad_norm"])
    assert read[0]["loss"] == rows[0]["loss"] and read[2] == rows[2]


def test_a_run_resumed_after_the_upgrade_reads_the_old_metrics_encoding(sft, finished, tmp_path):
    """metrics.jsonl written by an earlier version (null + a `nonfinite` object) is continued by a resume:
    its rows are kept, rewritten in the current encoding, with the non-finite value where it was."""
    out = _copy(finished, tmp_path)
    path = out / "metrics.jsonl"
    old = [json.loads(line) for line in path.read_text().splitlines()]
    old[0] = {**old[0], "loss": None, "nonfinite": {"loss": "nan"}}
    old[1] = {**old[1], "grad_norm": None, "nonfinite": {"grad_norm": "inf"}}
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    code, _, err = sft("--output_dir", out, "--resume", "latest", "--max_steps", "3")
    assert code == 0, err
    rows = [json.loads(line, parse_constant=refuse_constant) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and not any("nonfinite" in r for r in rows)
    assert rows[0]["loss"] == "NaN" and rows[1]["grad_norm"] == "Infinity"
    read = read_metrics(out)
    assert math.isnan(read[0]["loss"]) and read[1]["grad_norm"] == math.inf and math.isfinite(read[2]["loss"])


def test_failed_resume_writes_nothing(sft, finished, tmp_path):
    """A resume that fails when the checkpoint is loaded (here: the trainable tensors of another model)
    leaves the folder exactly as it was, run.yaml included."""
    out = _copy(finished, tmp_path)
    weights = out / "checkpoints" / "step-2" / "weights.safetensors"
    from safetensors.torch import load_file, save_file

    renamed = {k.replace("q_proj", "k_proj"): v for k, v in load_file(weights).items()}
    save_file(renamed, weights)
    _rewrite_marker(out / "checkpoints" / "step-2")  # the file is "intact" as recorded: only loading can tell
    before = snapshot(out)
    line = _one_error_line(*sft("--output_dir", out, "--resume", "latest", "--max_steps", "4")[::2])
    assert "does not match this model" in line or "cannot be loaded" in line
    assert snapshot(out) == before


def _rewrite_marker(ckpt):
    from fused_stable.train.run.checkpoint import COMPLETE_MARKER, _file_records

    marker = json.loads((ckpt / COMPLETE_MARKER).read_text())
    os.remove(ckpt / COMPLETE_MARKER)
    marker["files"] = _file_records(str(ckpt))
    (ckpt / COMPLETE_MARKER).write_text(json.dumps(marker))


def test_resume_into_a_foreign_folder_is_refused(sft, finished, tmp_path):
    """Continuing a checkpoint in another output_dir follows the rules of a new run: never into a folder
    that holds someone else's files (a metrics.jsonl there would be rewritten)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "metrics.jsonl").write_text('{"theirs": 1}\n')
    before = snapshot(project)
    line = _one_error_line(*sft("--resume", finished / "checkpoints" / "step-2", "--output_dir", project)[::2])
    assert "is not a fused-stable run" in line
    assert snapshot(project) == before
