"""Where the run executes: device, rank, precision and CPU threads, decided in this one place.

Under torchrun (see `fused_stable.train.run.parallel`) each process is one rank of the process group: it trains
on its own device (cuda:LOCAL_RANK, or the CPU under gloo), and only rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from fused_stable.argcheck import resolve_device

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Runtime:
    device: torch.device
    precision: str  # resolved: bf16 | fp16 | fp32
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
    from fused_stable.train.run import parallel

    dev = parallel.rank_device(device) if parallel.active() else resolve_device(device)
    if precision == "auto":
        # bf16 where the hardware has it; on CPU fp32 is faster than emulated bf16 for small models
        precision = "bf16" if dev.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return Runtime(device=dev, precision=precision, rank=parallel.rank(), world_size=parallel.world_size())


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads of one core count once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores, cpu = set(), None
    try:
        with open("/proc/cpuinfo") as f:
            fields = {}
            for line in f.read().splitlines() + [""]:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "processor":
                    cpu = int(value)
                elif key in ("physical id", "core id"):
                    fields[key] = value.strip()
                elif not line.strip() and cpu is not None:
                    if cpu in allowed:
                        cores.add((fields.get("physical id"), fields.get("core id", cpu)))
                    cpu, fields = None, {}
    except (OSError, ValueError):
        cores = set()
    return max(1, min(len(cores), len(allowed)) if cores else len(allowed))


def set_threads(threads: int) -> int:
    """Torch intra-op threads: `threads`, or for 0 one per physical core (shared between the processes of
    one node under torchrun), unless OMP_NUM_THREADS says otherwise (torch already follows it, and torchrun
    sets it to 1 per process). More threads than cores, or hyper-threads, make CPU training collapse as
    soon as anything else runs on the machine. Returns the number in use."""
    if threads <= 0:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        threads = max(1, physical_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    return threads


def quiet_third_party_noise() -> None:
    """Messages every run would print that say nothing about the run: bitsandbytes' notes on an optional
    hub-downloaded CPU kernel (missing, or not trust-checked: we are offline by design), and a transformers
    deprecation that peft triggers. (DeepSpeed's "Setting accelerator to CPU" is not silenced but avoided: a
    run without DeepSpeed never imports it, see `train.saved.final_model.deepspeed_left_alone`.)"""
    import logging
    import warnings

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # the same optional kernel, asked for by bitsandbytes' import on CPUs with AVX512-BF16: the `kernels` package
    # says on every run that it skips its publisher trust check offline (nothing is downloaded either way)
    logging.getLogger("kernels._internals.hf_hub").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars on every load: the run prints its own progress
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
