"""The compiled CPU update alone (AdamW's op, `fused_stable::update_adamw`), one thread, per state format: ns per
element with the tensors hot in the caches (6 x 16Ki elements) and from memory (6 x 4M), to tell arithmetic from
bytes (docs/benchmarks.md, "Low-precision state on the CPU: one pass per block").

    python benchmarks/cpu_update_alone.py
"""

from __future__ import annotations

import statistics
import time

import torch

from fused_stable.backends.torch import cpu_ops
from fused_stable.rules import RULES
from fused_stable.state_format import BF16, FP32, Q8

TENSORS = 6
ROW = torch.tensor([[1.0, 0.99999, 0.999, 0.1, 0.001, 1e-8, 1e-3, 0.03]])  # rules/adamw/cpu.h's Scalars order


def make_call(fmt: int, numel: int):
    """One op call over TENSORS seeded params, grads and states of `numel` elements in state format `fmt`."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(numel, generator=gen) * 0.02 for _ in range(TENSORS)]
    grads = [torch.randn(numel, generator=gen) * 1e-3 for _ in range(TENSORS)]
    scales = []
    if fmt == Q8:
        states = [torch.randint(-127, 128, (numel,), dtype=torch.int8, generator=gen) for _ in range(TENSORS)]
        states += [torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen) for _ in range(TENSORS)]
        scales = [torch.full(((numel + 127) // 128,), 1e-3) for _ in range(2 * TENSORS)]
    else:
        dtype = torch.bfloat16 if fmt == BF16 else torch.float32
        states = [(torch.rand(numel, generator=gen) * 1e-3).to(dtype) for _ in range(2 * TENSORS)]
    signed, stochastic = RULES["adamw"].slot_codes(False)
    keys, first_elements = torch.arange(TENSORS), torch.zeros(TENSORS, dtype=torch.int64)
    op = cpu_ops.update_op(RULES["adamw"])
    stochastic = stochastic if fmt == BF16 else 0
    return lambda: op(params, grads, states, scales, [], ROW, keys, first_elements, fmt, False, signed, stochastic)


def main() -> None:
    if not cpu_ops.available():
        raise SystemExit("the compiled CPU ops could not be built here")
    torch.set_num_threads(1)
    for where, numel, repeats in (("hot", 16384, 400), ("memory", 4_000_000, 3)):
        for name, fmt in (("fp32", FP32), ("bf16", BF16), ("8bit", Q8)):
            call = make_call(fmt, numel)
            call()
            times = []
            for _ in range(9):
                start = time.perf_counter()
                for _ in range(repeats):
                    call()
                times.append((time.perf_counter() - start) / repeats)
            print(f"{where:6s} {name:5s} {statistics.median(times) * 1e9 / (TENSORS * numel):.3f} ns/element")


if __name__ == "__main__":
    main()
