"""Test-run configuration: with no GPU, the Triton kernels are tested through Triton's interpreter.

Triton reads TRITON_INTERPRET once, when it is first imported, so it is set here, at the start of the
test run and before any test module imports triton; on a machine with CUDA the kernels run compiled.

The run's first lines name the versions of the packages a fresh environment resolves (`.ci/run` builds a
new one on every run), so a failure that comes from a new release of a dependency says which one.
"""

import importlib.metadata
import os
import platform

import pytest

# Newton-Schulz in bf16, torch.optim.Muon's dtype, on every machine: the suite compares FusedMuon with torch's
# bits, and on a CPU without native bf16 products FusedMuon would choose fp32 (rules/muon/newton_schulz.py, whose
# own tests set the choice). Set here, before any test starts, so the ranks the tests launch inherit it.
os.environ["FUSED_STABLE_NEWTON_SCHULZ"] = "bf16"

# the dependencies whose releases have changed what the tests see; add a new extra's packages here
REPORTED_PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "peft",
    "bitsandbytes",
    "accelerate",
    "lightning",
    "trl",
    "gradio",
    "selenium",
    "deepspeed",
)


def installed_versions(names=REPORTED_PACKAGES) -> str:
    """'python 3.11.9, torch 2.13.0+cpu, ..., trl not installed': from the installed distributions' metadata."""
    parts = [f"python {platform.python_version()}"]
    for name in names:
        try:
            parts.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
    return ", ".join(parts)


def pytest_report_header(config):
    return f"versions: {installed_versions()}"


def pytest_sessionstart(session):
    # `-q` (the README's command) hides pytest's header, and with it pytest_report_header: print the versions
    # anyway. Only the main process does; xdist's workers (which have `workerinput`) print nothing.
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(config, "workerinput") and config.option.verbose < 0:
        reporter.write_line(f"versions: {installed_versions()}")


def pytest_configure(config):
    config.addinivalue_line("markers", "interpret: runs the Triton kernels through Triton's interpreter")
    config.addinivalue_line(
        "markers", "torch_ops: the torch backend without its compiled CPU ops (torch's own ops do the step)"
    )
    config.addinivalue_line(
        "markers", "tensor_decisions: the torch backend's 0-dim tensor decisions on CPU tensors (not the host's)"
    )
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _torch_backend_variants(request, monkeypatch):
    """The torch backend's variants of helpers.CPU_BACKENDS / WITH_TENSOR_DECISIONS, for the optimizers the test
    builds: `torch_ops` without the compiled CPU ops (torch's ops do the norm and the update,
    fused_stable/backends/torch/cpu_ops.py); `tensor_decisions` with the 0-dim tensor decisions instead of the host
    ones (torch_backend.on_host off)."""
    if request.node.get_closest_marker("torch_ops") is not None:
        from fused_stable.backends.torch import cpu_ops

        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    if request.node.get_closest_marker("tensor_decisions") is not None:
        from fused_stable.backends.torch import torch_backend

        monkeypatch.setattr(torch_backend, "on_host", lambda *args: False)
