"""`fused-stable stress --output-dir` protects what is there as sft and export do: a new or empty folder, or
earlier stress results replaced only with `--overwrite` (and only the files a stress run wrote); a folder of
anything else (results of an earlier version without a manifest, a sft run, a user's files) is refused with one
line and left as it was."""

import json
import os

import pytest

from fused_stable import stress
from fused_stable.train.run import outputs

# the shortest suite: the clean reference only, with both recipes, on the random tiny model
QUICK = ["--scenarios", "clean", "--steps", "20", "--pretrain-steps", "0", "--log-every", "5", "--threads", "1"]
PREFIX = "fused-stable stress: error: "


def _snapshot(folder):
    return {
        os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
        for d, _, names in os.walk(folder)
        for n in names
    }


def _refused(argv, capsys, *needles):
    assert stress.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(PREFIX), err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A folder holding the results of one real stress run."""
    out = tmp_path_factory.mktemp("stress") / "results"
    assert stress.main([*QUICK, "--output-dir", str(out)]) == 0
    return out


def test_a_stress_run_records_what_it_wrote(earlier):
    manifest = outputs.read_manifest(str(earlier))
    assert manifest["created_by"] == "fused-stable stress"
    assert sorted(os.listdir(earlier)) == ["run_manifest.json", "stress.json", "stress.png"]
    assert {"stress.json", "stress.png"} <= set(manifest["entries"])


def test_earlier_results_are_refused_without_overwrite_and_replaced_with_it(earlier, tmp_path, capsys):
    import shutil

    out = tmp_path / "again"
    shutil.copytree(earlier, out)
    before = _snapshot(out)
    _refused([*QUICK, "--output-dir", str(out)], capsys, "already holds stress results", "--overwrite")
    assert _snapshot(out) == before
    (out / "stress.json").write_text('{"stale": true}\n')  # replaced, not kept or merged
    assert stress.main([*QUICK, "--output-dir", str(out), "--overwrite"]) == 0
    assert "stale" not in json.loads((out / "stress.json").read_text())
    assert sorted(os.listdir(out)) == ["run_manifest.json", "stress.json", "stress.png"]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_folders_that_are_not_stress_results_are_never_written(earlier, tmp_path, capsys, overwrite):
    import shutil

    # results of a version without manifests, a stress folder with the user's notes added, a sft run
    old = tmp_path / "old"
    old.mkdir()
    (old / "stress.json").write_text("{}\n")
    noted = tmp_path / "noted"
    shutil.copytree(earlier, noted)
    (noted / "notes.txt").write_text("mine\n")
    run = tmp_path / "run"
    run.mkdir()
    outputs.claim(str(run), ["metrics.jsonl"])
    for folder, needle in ((old, "is not a fused-stable stress result"), (run, "holds a fused-stable sft run")):
        before = _snapshot(folder)
        _refused([*QUICK, "--output-dir", str(folder), *overwrite], capsys, needle)
        assert _snapshot(folder) == before
    before = _snapshot(noted)
    needle = "also holds files the stress suite did not create (notes.txt)" if overwrite else "already holds"
    _refused([*QUICK, "--output-dir", str(noted), *overwrite], capsys, needle)
    assert _snapshot(noted) == before


def test_a_folder_another_command_is_writing_is_refused(tmp_path, capsys):
    out = tmp_path / "busy"
    with outputs.FolderLock(str(out), outputs.SFT):
        _refused([*QUICK, "--output-dir", str(out), "--overwrite"], capsys, "is in use by fused-stable sft (pid")
    assert not out.exists()  # the lock made the folder, and took it away again: it holds nothing
