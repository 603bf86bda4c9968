"""A Triton driver for machines without a GPU: kernels compile for a real GPU and launches are recorded, not run.

With it installed, Triton's compiled-kernel path runs for real on CPU tensors (argument binding,
specialisation, the kernel cache, on first use a full sm_90 compile with the bundled LLVM and ptxas, and
fused_stable's direct launches of cached kernels); only the final call into the CUDA driver is replaced by a
record of the launch. That makes two things measurable without a GPU:
  - the host time of a step: everything the host thread does before the GPU could start, which on a GPU is
    the floor under a step's time (benchmarks/host_time.py);
  - what the step really launches: which kernels, how many programs, and the PTX of the very kernels the
    dispatcher compiled for these arguments (tests/core/test_host_path.py).
Nothing runs on the device, so tensors' contents never change. Use in a process without TRITON_INTERPRET:

    with standin.installed() as launches:
        ...; opt.step(); print(launches.count, launches.names[-3:])
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver as triton_driver

# what a Hopper (H100 / H200) reports: the limits Triton checks a compiled kernel against
_HOPPER = {
    "max_shared_mem": 232448,
    "multiprocessor_count": 132,
    "max_num_regs": 65536,
    "warpSize": 32,
    "sm_clock_rate": 1980000,
    "mem_clock_rate": 2619000,
    "mem_bus_width": 6144,
}


@dataclass
class LaunchLog:
    """Launches seen since installation: a count, and (kernel name, programs) of the latest `keep` ones."""

    count: int = 0
    recent: list[tuple[str, int]] = field(default_factory=list)
    keep: int = 256

    def record(self, name: str, programs: int) -> None:
        self.count += 1
        self.recent.append((name, programs))
        if len(self.recent) > 2 * self.keep:
            del self.recent[: self.keep]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.recent]


class _Utils:
    """The driver utilities Triton calls while loading a compiled kernel."""

    def load_binary(self, name, binary, shared, device):
        return 0, 0, 0, 0, 1024  # module, function, registers, spills, max threads per block

    def get_device_properties(self, device):
        return dict(_HOPPER)

    def unload_module(self, module):
        pass


class StandInDriver(DriverBase):
    """Compiles for `GPUTarget("cuda", arch, 32)`; launches append to `log` instead of reaching a GPU."""

    def __init__(self, arch: int = 90) -> None:
        self.arch = arch
        self.log = LaunchLog()
        self.utils = _Utils()
        log = self.log

        class Launcher:
            def __init__(self, src, metadata):
                self.name = metadata.name

            def __call__(self, grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter, exit, *args):
                if enter is not None:  # as the CUDA launcher does: the hooks see every launch
                    enter(launch_metadata)
                log.record(self.name, grid_x * grid_y * grid_z)
                if exit is not None:
                    exit(launch_metadata)

        self.launcher_cls = Launcher

    @classmethod
    def is_active(cls):
        return False  # never picked on its own: only through `installed()`

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        return host_benchmarker

    def get_empty_cache_for_benchmark(self):
        return torch.empty(1)

    def clear_cache(self, cache):
        pass


def host_benchmarker(fn, warmup: float = 25, rep: float = 100, grad_to_none=None, quantiles=None, return_mode="mean"):
    """Triton's benchmarker interface (what an autotuner or `triton.testing.do_bench` calls), timed on the host's
    clock: under this driver a launch is only its host work, so that is the time there is to measure. `warmup`
    and `rep` are milliseconds of calls, the result is in milliseconds, as in Triton's."""
    if return_mode not in ("min", "max", "mean", "median", "all"):
        raise ValueError(f"return_mode must be min, max, mean, median or all, not {return_mode!r}")
    fn()
    warm_until = time.perf_counter() + warmup / 1e3
    while time.perf_counter() < warm_until:
        fn()
    times, stop_at = [], time.perf_counter() + rep / 1e3
    while not times or time.perf_counter() < stop_at:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    if quantiles is not None:
        found = torch.quantile(torch.tensor(times, dtype=torch.float64), torch.tensor(quantiles, dtype=torch.float64))
        return found.item() if len(quantiles) == 1 else found.tolist()
    if return_mode == "all":
        return times
    return {"min": min, "max": max, "mean": statistics.mean, "median": statistics.median}[return_mode](times)


@contextlib.contextmanager
def installed(arch: int = 90):
    """Makes a `StandInDriver` Triton's active driver for the block; yields its `LaunchLog`."""
    from triton import knobs

    if knobs.runtime.interpret:
        raise RuntimeError("the stand-in driver needs Triton's compiled path: run without TRITON_INTERPRET=1")
    previous = triton_driver._active
    standin = StandInDriver(arch)
    triton_driver.set_active(standin)
    try:
        yield standin.log
    finally:
        triton_driver._active = previous
