"""FusedMuon's whole step under FSDP2 against one process on the same params (issue 50 item 6): the Muon matrices
of a small Llama-like layer stack (muon_exchange.py's shapes) plus AdamW norms, as Shard(0) DTensors on gloo CPU
ranks (each matrix's direction to its owner rank, Newton-Schulz there, rows back: fused_stable/matrix_exchange.py),
against the same FusedMuon over whole tensors in one process. The same seeded grads every step (the clip active);
median step time of `--steps` after 2 warm-up steps, each rank timing between barriers (rank 0's printed).

The machine's cores are split fairly: `--threads` torch threads for the one process, `threads // ranks` for each
rank, so both sides use the same cores.

    python benchmarks/muon_fsdp2_step.py --ranks 2 --threads 2 --steps 9
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fused_stable import FusedMuon

# muon_exchange.py's layer stack (4 layers of q,k,v,o 512x512, gate/up 1376x512, down 512x1376) and 9 norms
SHAPES = [(512, 512)] * 16 + [(1376, 512)] * 8 + [(512, 1376)] * 4 + [(512,)] * 9


def _tensors(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * scale for shape in SHAPES]


def _optimizer(params: list[torch.Tensor]) -> FusedMuon:
    groups = [
        {"params": [p for p in params if p.ndim == 2], "use_muon": True, "lr": 2e-2},
        {"params": [p for p in params if p.ndim != 2], "use_muon": False, "lr": 1e-3},
    ]
    return FusedMuon(groups, max_grad_norm=1.0, backend="torch")


def _median_step(params, grads, steps: int, barrier=lambda: None) -> float:
    opt = _optimizer(params)
    times = []
    for step in range(steps + 2):
        for p, g in zip(params, grads):
            p.grad = g
        barrier()
        start = time.perf_counter()
        opt.step()
        barrier()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, ranks: int, port: int, threads: int, steps: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,))
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in _tensors(0)]
    grads = [distribute_tensor(g, mesh, [Shard(0)]) for g in _tensors(1, scale=3.0)]
    median = _median_step(params, grads, steps, dist.barrier)
    if rank == 0:
        print(json.dumps({"side": f"fsdp2-{ranks}-ranks", "threads_per_rank": threads, "median_ms": median * 1e3}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the one process (split by ranks)")
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = [torch.nn.Parameter(t) for t in _tensors(0)]
    one = _median_step(params, _tensors(1, scale=3.0), args.steps)
    print(json.dumps({"side": "one-process", "threads": args.threads, "median_ms": one * 1e3}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    per_rank = max(1, args.threads // args.ranks)
    mp.spawn(_rank, args=(args.ranks, port, per_rank, args.steps), nprocs=args.ranks)


if __name__ == "__main__":
    main()
