"""Where the run executes: device, rank and precision, decided in this one place.

Under torchrun (see `fused_stable.train.parallel`) each process is one rank of the process group: it trains
on its own device (cuda:LOCAL_RANK, or the CPU under gloo), and only rank 0 writes files.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from fused_stable.train.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Runtime:
    device: torch.device
    precision: str               # resolved: bf16 | fp16 | fp32
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Only the main process writes metrics, plots, checkpoints and the final adapter."""
        return self.rank == 0

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


def resolve_runtime(device: str, precision: str) -> Runtime:
    from fused_stable.train import parallel

    if parallel.active():
        dev = parallel.rank_device(device)
    elif device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"device={device} but no CUDA device is available (use device=cpu or auto)")
    if precision == "auto":
        # bf16 where the hardware has it; on CPU fp32 is faster than emulated bf16 for small models
        precision = "bf16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return Runtime(device=dev, precision=precision, rank=parallel.rank(), world_size=parallel.world_size())
