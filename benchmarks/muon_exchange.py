"""FusedMuon's exchange under FSDP2: `all_to_all_single` (MatrixExchange.apply, what the package uses) against
gather / scatter per owner rank, on gloo CPU ranks: the time of one step's exchange of a small Llama-like set of
row-sharded matrices in bf16 (an identity function at the owners: the exchange alone, not Newton-Schulz), median
of 7, each way twice; the two are first checked to give the same rows back.

    python benchmarks/muon_exchange.py --ranks 2 4
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fused_stable.matrix_exchange import MatrixExchange

# a small Llama-like layer stack: 4 layers of q,k,v,o (512x512), gate/up (1376x512), down (512x1376)
SHAPES = [(512, 512)] * 16 + [(1376, 512)] * 8 + [(512, 1376)] * 4


def gather_scatter(ex, indices, shards, fn):
    """The same exchange as `ex.apply` by one gather and one scatter per owner (pieces padded to the longest)."""
    route = ex.route(indices)
    rows, cols = ex.shapes[indices[0]]
    top = max(route.rows)
    out = shards.new_empty(shards.shape)
    for owner in range(ex.ranks):
        js = route.by_owner[owner]
        if not js:
            continue
        mine = torch.zeros(len(js), top, cols, dtype=shards.dtype)
        mine[:, : route.rows[ex.rank]] = shards[js]
        bucket = [torch.empty_like(mine) for _ in range(ex.ranks)] if ex.rank == owner else None
        dist.gather(mine, bucket, dst=owner, group=ex.group)
        pieces = None
        if ex.rank == owner:
            whole = torch.cat([b[:, :n] for b, n in zip(bucket, route.rows)], dim=1)
            result = fn(whole)
            pieces = []
            for s, e in zip(route.starts, route.starts[1:]):
                piece = torch.zeros(len(js), top, cols, dtype=result.dtype)
                piece[:, : e - s] = result[:, s:e]
                pieces.append(piece)
        back = torch.empty(len(js), top, cols, dtype=shards.dtype)
        dist.scatter(back, pieces, src=owner, group=ex.group)
        out[js] = back[:, : route.rows[ex.rank]]
    return out


def _medians(ex, batches, local, fn) -> dict[str, float]:
    ways = {"all_to_all": ex.apply, "gather_scatter": lambda b, x, fn: gather_scatter(ex, b, x, fn)}
    results: dict[str, list[float]] = {name: [] for name in ways}
    for name, way in list(ways.items()) * 2:
        times = []
        for _ in range(7):
            dist.barrier()
            start = time.perf_counter()
            for b in batches:
                way(b, local[b], fn)
            times.append(time.perf_counter() - start)
        results[name].append(sorted(times)[len(times) // 2])
    return {name: min(values) for name, values in results.items()}


def worker(rank, ws, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    group = dist.group.WORLD
    ex = MatrixExchange(dict(enumerate(SHAPES)), group, rank, ws)
    batches = {}
    for i, s in enumerate(SHAPES):
        batches.setdefault(s, []).append(i)
    batches = [tuple(v) for v in batches.values()]
    gen = torch.Generator().manual_seed(rank)
    local = {}
    for b in batches:
        r = ex.route(b).rows[rank]
        local[b] = torch.randn(len(b), r, ex.shapes[b[0]][1], generator=gen).bfloat16()

    def fn(whole):
        return whole

    for b in batches:  # the two agree, and give every rank its own rows back
        assert torch.equal(ex.apply(b, local[b], fn), gather_scatter(ex, b, local[b], fn))
        assert torch.equal(ex.apply(b, local[b], fn), local[b])
    results = _medians(ex, batches, local, fn)
    if rank == 0:
        print(f"{ws} ranks: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in results.items()), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    for ranks in parser.parse_args().ranks:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(ranks, port), nprocs=ranks)


if __name__ == "__main__":
    main()
