"""How much the 8-bit and bf16 state formats lose, measured on real Adam moments and in an optimizer-only run.

    python benchmarks/lowbit_quality.py            # all parts (~1-3 minutes on one idle core)
    python benchmarks/lowbit_quality.py --part maps
    python benchmarks/lowbit_quality.py --part stale

`maps`: code maps for the 8-bit state, all blockwise with one absmax scale per QUANT_BLOCK elements, on two sets
of moments: real ones (the small model of tests/core/test_lowbit.py's convergence test, the bag-of-tokens
classifier, after 300 fp32 Adam steps) and synthetic wide-spread blocks (per block a lognormal sqrt(v) of spread
sigma = 1, 2, 3 around a random block level, m = sqrt(v) * N(0, 1/4)). Maps: linear (round(127 m / s)),
bitsandbytes' dynamic map (its 256-entry table, nearest entry), v1 (state_format's square-root companding: sqrt
for exp_avg, sqrt of sqrt(v)), v2 (state_format's current maps: the pseudo square root on the bit pattern for
exp_avg, the pseudo fourth root of v), the pseudo square root of v alone, and FP8-like minifloats with a
power-of-two block scale (e4m3 for m; e5m3 or e4m4 for v, no sign bit). Per map: the median and 99th percentile
relative error of each moment over its non-zero elements, of the Adam direction m / (sqrt(v) + eps) (what the
update sees), the fraction of v decoded to 0 where v1 keeps it (the zero point), and of m decoded to 0.

`stale`: a moment that should move by less than half a code per step. One block: element 0 keeps grad 1 (the
block's max, so its scale stays); the others' grads fall from 1 to 0.1 (v should fall 100x) or rise from 0.1 to
0.3 (9x), beta2 = 0.999, and m decays (beta1 = 0.9, grad 0). Prints v and m after 100 / 1000 / 3000 steps per
format.

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


def current(x: torch.Tensor, key: str) -> torch.Tensor:
    """state_format's maps (code format v2)."""
    return state_format.decode(*state_format.encode(x, key), key)


def version1(x: torch.Tensor, key: str) -> torch.Tensor:
    """state_format's code format v1 (square-root companding)."""
    kind = state_format.codec_of(key)
    blocks, n = _blocks(x)
    codes, scale = state_format.ENCODERS_BY_VERSION[state_format.CODES_V1][kind](blocks)
    return state_format.DECODERS_BY_VERSION[state_format.CODES_V1][kind](codes, scale).view(-1)[:n].view_as(x)


def pseudo_sqrt_of_v(x: torch.Tensor) -> torch.Tensor:
    """v through the pseudo square root only (255 levels): too little range for a second moment."""
    blocks, n = _blocks(x)
    scale = blocks.amax(1)
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))[:, None]
    code = torch.floor(state_format.pseudo_root(blocks * inverse, 1, state_format.ROOT2) * 255.0 + 0.5)
    decoded = state_format.pseudo_square(code * (1.0 / 255.0), 1, state_format.ROOT2) * scale[:, None]
    return decoded.view(-1)[:n].view_as(x)


def minifloat(x: torch.Tensor, signed: bool, exponent_bits: int, mantissa_bits: int) -> torch.Tensor:
    """An FP8-like code (a sign bit when signed, then exponent and mantissa, subnormals, round to nearest) of x
    over a power-of-two block scale that puts the block's largest in the top octave; computed in fp64."""
    blocks, n = _blocks(x)
    magnitude = blocks.abs().double()
    top = torch.floor(torch.log2(magnitude.amax(1, keepdim=True).clamp_min(1e-300)))
    ratio = magnitude / 2.0**top  # the largest in [1, 2)
    lowest = -(2**exponent_bits - 2)  # the smallest normal octave (one exponent code for zero and subnormals)
    octave = torch.floor(torch.log2(ratio.clamp_min(1e-300))).clamp(min=lowest)
    step = 2.0 ** (octave - mantissa_bits)
    largest = 2.0 - 2.0**-mantissa_bits
    decoded = (torch.round(ratio / step) * step).clamp(max=largest) * 2.0**top
    decoded = torch.where(blocks < 0, -decoded, decoded).float()
    return decoded.view(-1)[:n].view_as(x)


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


def _candidates() -> dict:
    candidates = {
        "linear": (lambda t: linear(t, True), lambda t: linear(t, False)),
        "v1: sqrt / sqrt of sqrt(v)": (lambda t: version1(t, "exp_avg"), lambda t: version1(t, "exp_avg_sq")),
        "**v2: pseudo sqrt / pseudo 4th root**": (lambda t: current(t, "exp_avg"), lambda t: current(t, "exp_avg_sq")),
        "pseudo sqrt / pseudo sqrt of v": (lambda t: current(t, "exp_avg"), pseudo_sqrt_of_v),
        "FP8 e4m3 / e5m3, 2^k scale": (lambda t: minifloat(t, True, 4, 3), lambda t: minifloat(t, False, 5, 3)),
        "FP8 e4m3 / e4m4, 2^k scale": (lambda t: minifloat(t, True, 4, 3), lambda t: minifloat(t, False, 4, 4)),
    }
    try:
        import bitsandbytes.functional  # noqa: F401

        candidates["dynamic (bitsandbytes)"] = (lambda t: dynamic(t, True), lambda t: dynamic(t, False))
    except ImportError:
        pass
    return candidates


def _table(m: torch.Tensor, v: torch.Tensor) -> None:
    direction = m / (v.sqrt() + 1e-8)
    v1 = version1(v, "exp_avg_sq")
    header = "| map | exp_avg median / p99 | exp_avg_sq median / p99 | v to 0 where v1 keeps it | m to 0 |"
    print(header + " direction median / p99 |")
    print("|---|---|---|---|---|---|")
    for name, (encode_m, encode_v) in _candidates().items():
        m2, v2 = encode_m(m), encode_v(v)
        em, ev = _relative(m2, m), _relative(v2, v)
        ed = _relative(m2 / (v2.sqrt() + 1e-8), direction)
        zero = float(((v2 == 0) & (v1 != 0) & (v != 0)).float().mean())
        zero_m = float(((m2 == 0) & (m != 0)).float().mean())
        q = lambda t: f"{float(t.median()):.4f} / {float(t.quantile(0.99) if t.numel() < 2**24 else t.max()):.3f}"  # noqa: E731
        print(f"| {name} | {q(em)} | {q(ev)} | {zero:.3%} | {zero_m:.3%} | {q(ed.clamp(max=1e6))} |")


def synthetic(sigma: float, blocks: int = 1024, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Wide-spread blocks: per block a level N(0, 2) and lognormal sqrt(v) of spread sigma; m = sqrt(v) N(0, 1/4)."""
    gen = torch.Generator().manual_seed(seed)
    level = torch.randn(blocks, 1, generator=gen) * 2
    root = torch.exp(level + sigma * torch.randn(blocks, QUANT_BLOCK, generator=gen))
    m = root * torch.randn(blocks, QUANT_BLOCK, generator=gen) * 0.5
    return m.reshape(-1), (root * root).reshape(-1)


def maps() -> None:
    moments = adam_moments()
    m = torch.cat([a.reshape(-1) for a, _ in moments])
    v = torch.cat([b.reshape(-1) for _, b in moments])
    print(f"real: {m.numel():,} quantised elements of Adam moments (300 fp32 steps), blocks of {QUANT_BLOCK}")
    _table(m, v)
    for sigma in (1.0, 2.0, 3.0):
        m, v = synthetic(sigma)
        print(f"\nsynthetic, sigma = {sigma}: {m.numel():,} elements")
        _table(m, v)


def stochastic_v2(x: torch.Tensor, key: str, gen: torch.Generator) -> torch.Tensor:
    """v2's maps with the code rounded stochastically (floor(y * levels + u), u uniform in [0, 1)) instead of to
    nearest: the same decode, so not a format change; what a moment moving under half a code per step needs."""
    signed = key == "exp_avg"
    levels, shift, constant = (127.0, 1, state_format.ROOT2) if signed else (255.0, 2, state_format.ROOT4)
    blocks, n = _blocks(x)
    magnitude, scale = state_format.magnitude_and_scale(blocks)
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))[:, None]
    y = state_format.pseudo_root(magnitude * inverse, shift, constant) * levels
    code = torch.floor(y + torch.rand(y.shape, generator=gen)).clamp(max=levels)
    decoded = state_format.pseudo_square(code * (1.0 / levels), shift, constant) * scale[:, None]
    return torch.where(blocks < 0, -decoded, decoded).view(-1)[:n].view_as(x)


def _round_trip(x: torch.Tensor, key: str, name: str, gen: torch.Generator) -> torch.Tensor:
    if name == "fp32":
        return x
    if name == "v2, stochastic rounding":
        return stochastic_v2(x, key, gen)
    if name == "v1":
        return version1(x, key)
    if name == "v2":
        return current(x, key)
    return minifloat(x, key == "exp_avg", 4 if key == "exp_avg" else 5, 3)  # "FP8"


def stale() -> None:
    print("| format | v, falling 100x: after 100 / 1000 / 3000 steps | v, rising 9x | m, decaying |")
    print("|---|---|---|---|")
    for name in ("fp32", "v1", "v2", "FP8", "v2, stochastic rounding"):
        gen = torch.Generator().manual_seed(0)
        falling, rising, m = torch.ones(QUANT_BLOCK), torch.full((QUANT_BLOCK,), 0.01), torch.full((QUANT_BLOCK,), 0.5)
        rising[0] = 1.0
        g_fall, g_rise = torch.full((QUANT_BLOCK,), 0.1), torch.full((QUANT_BLOCK,), 0.3)
        g_fall[0] = g_rise[0] = 1.0
        seen = {"fall": [], "rise": [], "m": []}
        for step in range(1, 3001):
            falling = _round_trip(0.999 * falling + 0.001 * g_fall * g_fall, "exp_avg_sq", name, gen)
            rising = _round_trip(0.999 * rising + 0.001 * g_rise * g_rise, "exp_avg_sq", name, gen)
            m = 0.9 * m
            m[0] = 0.5
            m = _round_trip(m, "exp_avg", name, gen)
            if step in (100, 1000, 3000):
                seen["fall"].append(f"{float(falling[1]):.4g}")
                seen["rise"].append(f"{float(rising[1]):.4g}")
                seen["m"].append(f"{float(m[1]):.3g}")
        print(f"| {name} | {' / '.join(seen['fall'])} | {' / '.join(seen['rise'])} | {' / '.join(seen['m'])} |")


def convergence() -> None:
    from test_lowbit import _convergence

    results = {precision: _convergence(precision) for precision in ("fp32", "bf16", "8bit")}
    print("| state | mean loss, last 50 of 300 steps | vs fp32 |")
    print("|---|---|---|")
    for precision, loss in results.items():
        print(f"| {precision} | {loss:.4f} | {loss / results['fp32'] - 1:+.2%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["maps", "stale", "convergence", "all"], default="all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.part in ("maps", "all"):
        maps()
    if args.part in ("stale", "all"):
        stale()
    if args.part in ("convergence", "all"):
        convergence()


if __name__ == "__main__":
    main()
