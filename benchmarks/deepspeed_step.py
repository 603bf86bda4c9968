"""The cost of DeepSpeed's engine.step() with fused_stable's integration against DeepSpeed's own clip + check.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/deepspeed_step.py [--params 8e6] [--steps 15] [--ranks 1]

One process group (gloo, `--ranks` processes), ZeRO 1, 2 and 3, fp32, two param groups (decay / no decay) over an
MLP of `--params` parameters. Three contenders per stage, interleaved step by step so load changes hit all alike:
  - fused: fused_stable.integrations.deepspeed with FusedAdamW(max_grad_norm=1.0): DeepSpeed's norm, overflow check
    and clip off (ZeRO 1-2 by config; ZeRO-3 by the integration), one fused step;
  - torch+ds-clip: torch.optim.AdamW(fused=True) with DeepSpeed's gradient_clipping=1.0 (its fp64 norm, its host
    check, its mul_ pass): DeepSpeed's usual way;
  - fusedadamw+ds-clip: FusedAdamW without its clip as a plain client optimizer, DeepSpeed clipping.
Prints the median engine.step() time (ms) of each, rank 0, with `uptime` before and after. Forward and backward
are not timed (the same for all).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integrations"))


def make_model(params: float, seed: int = 0) -> torch.nn.Module:
    width = max(64, int((params / 4) ** 0.5))  # 4 square layers
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])


def groups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def build(kind: str, stage: int, params: float):
    import deepspeed

    from fused_stable import FusedAdamW
    from fused_stable.integrations import deepspeed as fs_deepspeed

    model = make_model(params)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
    if kind == "fused":
        opt = FusedAdamW(groups(model), lr=1e-4, max_grad_norm=1.0)
        engine, *_ = fs_deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        return engine, model
    if kind == "torch+ds-clip":
        opt = torch.optim.AdamW(groups(model), lr=1e-4, fused=True)
    else:
        opt = FusedAdamW(groups(model), lr=1e-4)
    cfg.update(gradient_clipping=1.0, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, model


def worker(rank: int, world: int, args) -> dict:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    kinds = ("fused", "torch+ds-clip", "fusedadamw+ds-clip")
    out = {}
    for stage in (1, 2, 3):
        engines = {kind: build(kind, stage, args.params) for kind in kinds}
        times: dict = {kind: [] for kind in kinds}
        width = engines["fused"][1][0].in_features
        x = torch.randn(4, width)
        for step in range(args.steps + 2):
            for kind in kinds:
                engine, _ = engines[kind]
                engine.backward(engine(x).pow(2).mean())
                start = time.perf_counter()
                engine.step()
                if step >= 2:  # the first steps build plans and states
                    times[kind].append(time.perf_counter() - start)
        out[stage] = {kind: 1e3 * statistics.median(t) for kind, t in times.items()}
        del engines
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=8e6)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()
    from integ_dist import spawn

    print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(worker, args.ranks, Path(tmp), args)[0]
    print("uptime after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"engine.step() median ms, {args.params:.3g} params, {args.ranks} rank(s), fp32, torch {torch.__version__}")
    for stage, row in results.items():
        print(f"ZeRO-{stage}: " + ", ".join(f"{kind} {ms:.2f}" for kind, ms in row.items()))


if __name__ == "__main__":
    main()
