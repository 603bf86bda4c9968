"""Under torchrun the trainer's logging step reads the device once: the rank-mean loss and the token total
come back in the same read as the rest of the interval's rows (two gloo ranks, spawned here)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import count_host_reads, group_threads

from fused_stable.integrations.distributed import destroy_distributed
from fused_stable.train.run import parallel


def rank_rows(rank: int) -> torch.Tensor:
    """Three steps of (loss, grad norm, lr, skipped, skipped total): the loss differs per rank, the rest not."""
    return torch.tensor(
        [
            [1.0 + rank, 5.0, 1e-3, 0.0, 0.0],
            [2.0 + 3 * rank, 6.0, 2e-3, 1.0, 1.0],
            [0.5 * (rank + 1), 7.0, 3e-3, 0.0, 1.0],
        ]
    )


def _rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        with count_host_reads() as counter:
            rows, tokens = parallel.read_for_logging(rank_rows(rank), tokens=100 + rank)
        torch.save(
            {"rows": rows, "tokens": tokens, "reads": [name for name, _ in counter.reads]},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        destroy_distributed()
    # freed, not only left: a group held past this point aborted this test's ranks now and then (issue 52)
    assert group_threads() == [], f"rank {rank}: the process group outlived destroy_distributed"


def test_one_device_read_per_logging_step_under_two_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    expected = rank_rows(0).double()
    expected[:, 0] = (rank_rows(0)[:, 0].double() + rank_rows(1)[:, 0].double()) / 2
    for result in results:
        assert result["reads"] == ["tolist"]  # the one read; the all-reduce itself reads nothing
        assert result["tokens"] == 201
        assert torch.tensor(result["rows"], dtype=torch.float64).allclose(expected, rtol=1e-7, atol=0)


def test_a_single_process_reads_once_and_changes_nothing():
    values = rank_rows(0)
    with count_host_reads() as counter:
        rows, tokens = parallel.read_for_logging(values, tokens=7)
    assert [name for name, _ in counter.reads] == ["tolist"] and tokens == 7 and rows == values.tolist()
