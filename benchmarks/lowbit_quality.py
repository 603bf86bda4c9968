"""How much the 8-bit and bf16 state formats lose, measured on real Adam moments and in an optimizer-only run.

    python benchmarks/lowbit_quality.py            # both parts (~1-3 minutes on one idle core)
    python benchmarks/lowbit_quality.py --part maps

`maps`: trains a small model (the bag-of-tokens classifier of tests/core/test_lowbit.py's convergence test) for
300 steps with fp32 state, takes its Adam moments and quantises them with candidate code maps, all blockwise
with one absmax scale per QUANT_BLOCK elements: linear (round(127 m / s)), bitsandbytes' dynamic map (its
256-entry table, nearest entry), and the companded maps of state_format.py (signed square root for exp_avg;
sqrt(exp_avg_sq) companded by a second square root). It prints, per map, the median and 99th percentile relative
error of each moment over its non-zero elements and, what the update sees, the relative error of the Adam
direction m / (sqrt(v) + eps); and the fraction of elements that decode to zero (lost entirely).

`convergence`: the convergence test's run for fp32, bf16 and 8-bit state: mean training loss of the last 50 steps.

Results (quoted in docs/optimizer.md, "Low-precision state") depend only on the seeds, not on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "core"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from fused_stable import FusedAdamW, state_format  # noqa: E402
from fused_stable.state_format import QUANT_BLOCK  # noqa: E402


def _blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % QUANT_BLOCK
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, QUANT_BLOCK), flat.numel()


def linear(x: torch.Tensor, signed: bool) -> torch.Tensor:
    blocks, n = _blocks(x)
    scale = blocks.abs().amax(1, keepdim=True).clamp_min(1e-38)
    levels = 127.0 if signed else 255.0
    return (torch.round(blocks / scale * levels) / levels * scale).view(-1)[:n].view_as(x)


def dynamic(x: torch.Tensor, signed: bool) -> torch.Tensor:
    import bitsandbytes.functional as F

    table = F.create_dynamic_map(signed=signed).float()
    blocks, n = _blocks(x)
    scale = blocks.abs().amax(1, keepdim=True).clamp_min(1e-38)
    normed = blocks / scale
    index = (normed.reshape(-1, 1) - table.view(1, -1)).abs().argmin(1)  # nearest entry (bitsandbytes' search)
    return (table[index].view_as(blocks) * scale).view(-1)[:n].view_as(x)


def companded(x: torch.Tensor, key: str) -> torch.Tensor:
    return state_format.decode(*state_format.encode(x, key), key)


def adam_moments(steps: int = 300) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from test_lowbit import _BagOfTokens, _task

    x, y, gen = _task()
    torch.manual_seed(0)
    model = _BagOfTokens()
    opt = FusedAdamW(model.parameters(), lr=3e-3, max_grad_norm=1.0, backend="torch")
    for _ in range(steps):
        batch = torch.randint(0, len(y), (128,), generator=gen)
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        opt.step()
        opt.zero_grad()
    quantised = [p for p in model.parameters() if p.numel() >= state_format.MIN_QUANTISED_NUMEL]
    return [(opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()) for p in quantised]


def _relative(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    keep = exact != 0
    return ((approx - exact).abs() / exact.abs())[keep]


def maps() -> None:
    moments = adam_moments()
    m = torch.cat([a.reshape(-1) for a, _ in moments])
    v = torch.cat([b.reshape(-1) for _, b in moments])
    direction = m / (v.sqrt() + 1e-8)
    candidates = {
        "linear": (lambda t: linear(t, True), lambda t: linear(t, False)),
        "dynamic (bitsandbytes)": (lambda t: dynamic(t, True), lambda t: dynamic(t, False)),
        "linear on sqrt(v)": (lambda t: linear(t, True), lambda t: linear(t.sqrt(), False) ** 2),
        "companded (state_format)": (
            lambda t: companded(t, "exp_avg"),
            lambda t: companded(t, "exp_avg_sq"),
        ),
    }
    print(f"{m.numel():,} quantised elements of real Adam moments (300 fp32 steps), blocks of {QUANT_BLOCK}")
    print(
        "| map | exp_avg rel. err. median / p99 | exp_avg_sq median / p99 | v decoded to 0 | direction median / p99 |"
    )
    print("|---|---|---|---|---|")
    for name, (encode_m, encode_v) in candidates.items():
        m2 = torch.cat([encode_m(a).reshape(-1) for a, _ in moments])
        v2 = torch.cat([encode_v(b).reshape(-1) for _, b in moments])
        em, ev = _relative(m2, m), _relative(v2, v)
        ed = _relative(m2 / (v2.sqrt() + 1e-8), direction)
        zero = float(((v2 == 0) & (v != 0)).float().mean())
        q = lambda t: f"{float(t.median()):.4f} / {float(t.quantile(0.99) if t.numel() < 2**24 else t.max()):.3f}"  # noqa: E731
        print(f"| {name} | {q(em)} | {q(ev)} | {zero:.2%} | {q(ed.clamp(max=1e6))} |")


def convergence() -> None:
    from test_lowbit import _convergence

    results = {precision: _convergence(precision) for precision in ("fp32", "bf16", "8bit")}
    print("| state | mean loss, last 50 of 300 steps | vs fp32 |")
    print("|---|---|---|")
    for precision, loss in results.items():
        print(f"| {precision} | {loss:.4f} | {loss / results['fp32'] - 1:+.2%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["maps", "convergence", "all"], default="all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.part in ("maps", "all"):
        maps()
    if args.part in ("convergence", "all"):
        convergence()


if __name__ == "__main__":
    main()
