"""Helpers for the integration tests that run several real torch.distributed processes (gloo, CPU).

Each test spawns its ranks with torch.multiprocessing, on a port found by binding to port 0 (so
parallel runs do not collide), and every rank leaves its process group in a ``finally`` with the trainer's
destroy_distributed, which frees it. Ranks write their results to files that the test reads and asserts on
in the parent process; a rank whose group outlived it fails (helpers.group_threads: issue 52's abort at exit).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import group_threads

from fused_stable.integrations.distributed import destroy_distributed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, out_dir: str, args: tuple, timeout=None) -> None:
    # One thread per rank: the test machines have 2 cores and several ranks share them.
    torch.set_num_threads(1)
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
    finally:
        destroy_distributed()
    # DeepSpeed's own comm layer keeps the group: its ranks are checked by DeepSpeed's tests, not here
    if "deepspeed" not in sys.modules:
        assert group_threads() == [], f"rank {rank}: the process group outlived destroy_distributed"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn(fn: Callable, world_size: int, out_dir: Path, *args: Any, timeout: timedelta | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result. ``timeout``:
    the process group's (a rank left waiting alone in a collective fails the run instead of hanging it)."""
    port = free_port()
    mp.spawn(_entry, args=(world_size, port, fn, str(out_dir), args, timeout), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
