"""A seeded fingerprint of the optimizers' results, to show that a restructuring changed no bit.

Runs FusedAdamW, FusedLion and FusedMuon for a few seeded steps over many configurations (param dtypes x state
precisions, two groups with different hyper-parameters, master weights, amsgrad, maximize, fixed and z-score
clipping, a spike skip, a non-finite step, a device lr schedule, a GradScaler-style grad_scale, a transposed
grad) on each CPU backend, and prints one sha256 per (backend, rule) over every param, every state tensor and the
step's counters. Run it on two commits and compare the lines:

    python benchmarks/fingerprint.py                      # every backend
    python benchmarks/fingerprint.py --backends torch     # torch (compiled ops), torch-ops, torch-tensor, interpret

Backends: "torch" (compiled CPU ops), "torch-ops" (torch's ops: cpu_ops.available() off), "torch-tensor" (the
0-dim tensor decisions and torch's ops), "interpret" (the Triton kernels through Triton's interpreter;
TRITON_INTERPRET=1 is set here before triton is imported). Only the public API and those two switches are used,
so the script runs unchanged on older commits.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (the interpret backend)

import torch  # noqa: E402

import fused_stable  # noqa: E402
from fused_stable import FusedAdamW, FusedLion, FusedMuon, schedules  # noqa: E402

BACKENDS = ("torch", "torch-ops", "torch-tensor", "interpret")
SHAPES = [(37, 53), (5000,), (3,), (64, 65), (4096,), (1,)]  # odd sizes, an 8-bit-sized one, a tiny one
STEPS = 6
NONFINITE_STEP = 2  # its grads hold an inf: skipped
SPIKE_STEP = 4  # its grads are 50x: a spike (skipped where spike_skip_threshold is set)


def _switch_backend(name: str) -> str:
    """Sets the torch backend's variant switches for `name` and returns the backend to pass."""
    from fused_stable.backends.torch import cpu_ops, torch_backend

    cpu_ops.available.cache_clear() if hasattr(cpu_ops.available, "cache_clear") else None
    if not hasattr(_switch_backend, "saved"):
        _switch_backend.saved = (cpu_ops.available, torch_backend.on_host)
    available, on_host = _switch_backend.saved
    cpu_ops.available = available if name == "torch" else (lambda: False)
    torch_backend.on_host = (lambda *args: False) if name == "torch-tensor" else on_host
    return "interpret" if name == "interpret" else "torch"


def _params(dtype: torch.dtype, seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in SHAPES]


def _grads(params, step: int, seed: int, transposed: bool) -> None:
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    for index, p in enumerate(params):
        g = torch.randn(p.shape, generator=generator) * (50.0 if step == SPIKE_STEP else 1.0)
        if step == NONFINITE_STEP and index == 1:
            g[7] = float("inf")
        if transposed and index == 3:  # a grad laid out otherwise than its param
            g = g.t().contiguous().t()
        p.grad = g.to(p.dtype)


def _digest(opt, params, hasher) -> None:
    for p in params:
        hasher.update(p.detach().float().contiguous().numpy().tobytes())
        for key in sorted(opt.state[p]):
            value = opt.state[p][key]
            if isinstance(value, torch.Tensor):
                hasher.update(key.encode())
                hasher.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for name in ("grad_norm", "skipped_steps", "applied_steps", "last_lr", "spike_skips"):
        value = getattr(opt, name, None)
        if isinstance(value, torch.Tensor):
            hasher.update(value.detach().float().reshape(-1).numpy().tobytes())


def _run(make, params, steps_options: dict, hasher, transposed: bool, seed: int) -> None:
    opt = make(params)
    for step in range(STEPS):
        _grads(params, step, seed, transposed)
        if steps_options.get("grad_scale"):
            for p in params:
                p.grad.mul_(1024.0)
            opt.grad_scale = torch.tensor(1024.0)
            opt.found_inf = torch.tensor(0.0)
        opt.step()
        opt.__dict__.pop("grad_scale", None)
        opt.__dict__.pop("found_inf", None)
        if step == 3:  # a state round trip mid-run (through bytes, as a checkpoint)
            saved = opt.state_dict()
            opt = make(params)
            opt.load_state_dict(saved)
    _digest(opt, params, hasher)


def _step_options(extra: dict) -> dict:
    options = dict(
        max_grad_norm=1.0, zscore_warmup=2, lr_schedule=schedules.warmup_cosine(total_steps=20, warmup_steps=2)
    )
    options.update({k: v for k, v in extra.items() if k != "grad_scale"})
    return options


EXTRAS = [
    {},
    {"clip": "zscore", "spike_skip_threshold": 3.0},
    {"grad_scale": True},
    {"master_weights": True},
]


def _adamw_configs():
    for dtype, precision, extra, variant in itertools.product(
        (torch.float32, torch.bfloat16, torch.float16), ("fp32", "bf16", "8bit"), EXTRAS, ("plain", "amsgrad")
    ):
        if extra.get("master_weights") and dtype == torch.float32:
            continue
        yield dtype, precision, extra, variant


def _adamw_maker(precision, extra, variant):
    def make(params):
        groups = [
            {"params": params[:3]},
            {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0, "amsgrad": variant == "amsgrad"},
        ]
        return FusedAdamW(
            groups,
            lr=1e-2,
            weight_decay=0.1,
            maximize=variant == "amsgrad",
            state_precision=precision,
            backend=make.backend,
            **_step_options(extra),
        )

    return make


def _lion_maker(precision, extra):
    def make(params):
        groups = [{"params": params[:3]}, {"params": params[3:], "lr": 3e-4, "weight_decay": 0.0}]
        return FusedLion(
            groups, lr=1e-3, weight_decay=0.1, state_precision=precision, backend=make.backend, **_step_options(extra)
        )

    return make


def _muon_maker(precision, extra):
    def make(params):
        matrices = [p for p in params if p.ndim == 2]
        rest = [p for p in params if p.ndim != 2]
        groups = [
            {"params": matrices, "use_muon": True, "lr": 2e-2, "state_precision": precision},
            {"params": rest, "use_muon": False, "lr": 1e-2},
        ]
        return FusedMuon(groups, backend=make.backend, **_step_options(extra))

    return make


def fingerprint(backend_name: str) -> dict[str, tuple[int, str]]:
    backend = _switch_backend(backend_name)
    results = {}
    hasher, count = hashlib.sha256(), 0
    for seed, (dtype, precision, extra, variant) in enumerate(_adamw_configs()):
        make = _adamw_maker(precision, extra, variant)
        make.backend = backend
        _run(make, _params(dtype, seed), extra, hasher, transposed=backend_name != "interpret", seed=seed)
        count += 1
    results["adamw"] = (count, hasher.hexdigest())
    hasher, count = hashlib.sha256(), 0
    for seed, (dtype, precision, extra) in enumerate(
        itertools.product((torch.float32, torch.bfloat16), ("fp32", "bf16", "8bit"), EXTRAS)
    ):
        if extra.get("master_weights") and dtype == torch.float32:
            continue
        make = _lion_maker(precision, extra)
        make.backend = backend
        _run(make, _params(dtype, 500 + seed), extra, hasher, transposed=False, seed=500 + seed)
        count += 1
    results["lion"] = (count, hasher.hexdigest())
    hasher, count = hashlib.sha256(), 0
    for seed, (precision, extra) in enumerate(itertools.product(("fp32", "bf16"), EXTRAS[:3])):
        make = _muon_maker(precision, extra)
        make.backend = backend
        _run(make, _params(torch.float32, 900 + seed), extra, hasher, transposed=False, seed=900 + seed)
        count += 1
    results["muon"] = (count, hasher.hexdigest())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"# fused_stable {fused_stable.__file__}, torch {torch.__version__}", file=sys.stderr)
    for name in args.backends:
        for rule, (count, digest) in fingerprint(name).items():
            print(f"{name:13s} {rule:6s} {count:3d} configs  {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
