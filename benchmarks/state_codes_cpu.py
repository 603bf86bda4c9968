"""The 8-bit codes' cost on the CPU, code format v1 against v2, in isolation from the rest of the step.

    python benchmarks/state_codes_cpu.py     # ~1 minute, one thread

Builds (torch's cpp_extension, the compiled op's flags) a loop over 1Mi elements in blocks of 128: decode both
AdamW moments, an EMA per element, encode both again; with v1's functions (as cpu_step.cpp had them at main
977f179: square roots in the encode) and with v2's (backends/torch/state_codes.h). Prints ns per element, the best
and the median of 5 interleaved runs of each. What it measures is arithmetic (the data stays in cache), not the
step's bytes: benchmarks/cpu_step.py times the whole step.
"""

from __future__ import annotations

import hashlib
import pathlib

import torch
from torch.utils import cpp_extension

from fused_stable.backends.torch import cpu_ops

HEADER_DIR = pathlib.Path(cpu_ops.__file__).parent

SOURCE = pathlib.Path(__file__).with_suffix(".cpp")  # the timed loop: v1's functions and v2's header


def main() -> None:
    torch.set_num_threads(1)
    module = cpp_extension.load_inline(
        name="fused_stable_state_codes_bench_" + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:8],
        cpp_sources=[SOURCE.read_text()],
        functions=["run_v1", "run_v2"],
        extra_include_paths=[str(HEADER_DIR)],
        extra_cflags=cpu_ops.CFLAGS,
        verbose=False,
    )
    n = 1 << 20
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(n, generator=gen)
    v = m * m
    results = {"v1": [], "v2": []}
    for _ in range(5):
        for name, run in (("v1", module.run_v1), ("v2", module.run_v2)):
            codes_m, codes_v = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
            scales_m, scales_v = torch.zeros(n // 128), torch.zeros(n // 128)
            results[name].append(run(m, v, codes_m, codes_v, scales_m, scales_v, 5))
    for name, times in results.items():
        times.sort()
        print(f"{name}: {times[0]:.3f} ns/element best, {times[2]:.3f} median (decode 2 moments + EMA + encode 2)")


if __name__ == "__main__":
    main()
