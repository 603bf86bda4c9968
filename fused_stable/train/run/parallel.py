"""The trainer under `torchrun --nproc-per-node N`: one process per rank, DDP for adapter tuners, FSDP2
(`fully_shard`) for `tuner=full`, every rank training on its own shard of the rows.

Everything rank-dependent that the loop and the CLI need lives here, as functions that do nothing special
in a single process (no process group, or a group of one), so the single-process path is unchanged:

- the process group comes from torchrun's environment and is left in a `finally` (`process_group`);
- every check on user input runs on every rank; `agree` makes a `UserError` on any rank an error on all of
  them (before anything is written), so the ranks exit together and rank 0 prints the one line;
- only rank 0 writes output_dir; collectives that gather sharded state (FSDP2's full model and optimizer
  state) run on every rank, and every rank waits for rank 0's checkpoint before going on, so a rollback on
  any rank finds the same newest checkpoint;
- the logged loss is the mean over ranks and the throughput counts every rank's tokens, one all-reduce and
  one device read per logging step (`read_for_logging`);
- an interrupt (SIGINT / SIGTERM) seen by any rank stops every rank after the same step (`agree_signal`:
  a tiny all-reduce on the CPU per step, never a device read).

Not supported, refused with a clear error: resuming a checkpoint with a different number of processes
(the data shards and per-rank RNG streams depend on it), `device=cuda:N` under torchrun (each rank takes
cuda:LOCAL_RANK), and `device=cpu` when the process group is NCCL.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from fused_stable.errors import UserError
from fused_stable.integrations import distributed

T = TypeVar("T")
_cpu_group = None  # a gloo group for host-side agreement when the main group is NCCL


# ------------------------------------------------------------------------------------------ process group
def active() -> bool:
    """True inside a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launch_rank() -> int:
    """The rank torchrun gave this process, also before (or without) the process group: who prints errors."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def process_group():
    """Join the process group torchrun describes (nothing without WORLD_SIZE > 1) and always leave it."""
    global _cpu_group
    try:
        distributed.init_distributed_from_env()
    except (ValueError, RuntimeError) as exc:
        raise UserError(str(exc)) from None
    try:
        if active() and str(dist.get_backend()) != "gloo":
            _cpu_group = dist.new_group(backend="gloo")  # collective: every rank creates it, in the same order
        yield
    finally:
        _cpu_group = None
        distributed.destroy_distributed()


def barrier() -> None:
    if active():
        dist.barrier()


def agree(fn: Callable[..., T], *args) -> T:
    """Run `fn` on every rank; if it raised `UserError` on any rank, raise it on every rank (the message of
    the lowest failing rank). Without this, a rank that passed its checks would go on into a collective
    and wait forever for one that had exited."""
    if not active():
        return fn(*args)
    result, error = None, None
    try:
        result = fn(*args)
    except UserError as exc:
        error = str(exc)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    if failed:
        raise UserError(failed[0])
    return result


def agree_signal(signum: int) -> int:
    """The interrupt every rank acts on: this rank's signal number (0: none) combined over the ranks, the
    largest winning (SIGTERM over SIGINT). Called once per optimizer step on every rank, so all of them stop
    after the same step. Host-side (a CPU all-reduce over gloo): no device read between logging steps."""
    if not active():
        return signum
    flag = torch.tensor([signum], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_cpu_group)
    return int(flag.item())


# what gloo and NCCL say when a peer process is gone (killed, crashed, or torchrun stopped it)
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "communicator was aborted",
    "Socket Timeout",
)


def lost_another_rank(exc: BaseException, signum: int = 0) -> bool:
    """Whether `exc`, raised in a process group, means that another rank is gone rather than a bug here: a
    distributed error, a collective that lost its peer, or any RuntimeError while a signal is pending (torchrun
    sends SIGTERM to every other rank as soon as one fails)."""
    if not active():
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and (bool(signum) or any(text in str(exc) for text in _PEER_GONE))


def describe_lost_rank(exc: BaseException) -> str:
    """One clause for the message: what the collective saw, without gloo's or NCCL's advice."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    seen = first.split("] ", 1)[-1].split(". This is typically", 1)[0].strip()[:160]
    return f"another rank stopped ({seen}), so this one cannot go on (torchrun's summary says which rank and why)"


def report_error(line: str) -> None:
    """Print `line` on rank 0 only; then wait for every rank, so that torchrun (which stops the other workers
    as soon as one exits) cannot end rank 0 before it has printed. Only for errors every rank raises."""
    if launch_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    barrier()


# ------------------------------------------------------------------------------------------ placement
def rank_device(device: str) -> torch.device:
    """This rank's device under torchrun: cuda:LOCAL_RANK under NCCL, the CPU under gloo."""
    backend = str(dist.get_backend())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        if device == "cpu":
            raise UserError(
                "device=cpu under torchrun on a machine with CUDA: the process group uses NCCL (GPU tensors); "
                "use device=auto or cuda, or hide the GPUs with CUDA_VISIBLE_DEVICES= to train on CPU with gloo"
            )
        if device not in ("auto", "cuda"):
            raise UserError(f"device={device} under torchrun: each rank uses cuda:LOCAL_RANK; use device=auto or cuda")
        return torch.device("cuda", local_rank)
    if device not in ("auto", "cpu"):
        raise UserError(
            f"device={device} under torchrun, but the process group is {backend} (CPU): use device=auto or cpu"
        )
    return torch.device("cpu")


def check_resume(path: str | None) -> None:
    """A checkpoint resumes only with the number of processes that wrote it: each rank's data shard and RNG
    stream depend on it, so another count could not continue the same run."""
    if path is None:
        return
    with open(os.path.join(path, "trainer_state.json")) as f:  # written by checkpoint.save_checkpoint
        saved = int(json.load(f).get("world_size", 1))
    if saved != world_size():
        launch = "a single process" if saved == 1 else f"torchrun --nproc-per-node {saved}"
        raise UserError(
            f"{path!r} was written by a run of {saved} process(es), this one has {world_size()}: "
            f"resume it with {launch} (the data shards and RNG streams depend on the process count)"
        )


def shard(items: list[T]) -> list[T]:
    """This rank's rows: every world_size-th row from its rank, the same count on every rank."""
    if not active():
        return items
    try:
        return distributed.shard_data(items)
    except ValueError as exc:
        raise UserError(f"too little data for {world_size()} processes: {exc}") from None


def wrap(model, tuner: str):
    """DDP around an adapter model, FSDP2 `fully_shard` of every block and the root for tuner=full.
    Build the optimizer after this: under FSDP2 the parameters are replaced by DTensor shards."""
    return distributed.wrap_model(model, tuner) if active() else model


def unwrap(model):
    """The user's module (its parameter names, `save_pretrained`) inside a DDP wrapper."""
    return distributed.unwrap_model(model)


def is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def set_grad_sync(model, sync: bool) -> None:
    """Gradient accumulation under DDP: all-reduce only on the window's last micro-batch (the local sum of the
    earlier ones rides along) instead of once per micro-batch. Set before the forward. FSDP2 keeps reducing
    (reduce-scatter) every micro-batch: skipping it would hold unsharded gradients of the whole model on every
    rank, the memory FSDP2 is there to save."""
    if active() and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.require_backward_grad_sync = sync  # what `DDP.no_sync()` toggles, without re-indenting the loop


# ------------------------------------------------------------------------------------------ logging
def read_for_logging(values: torch.Tensor, tokens: int) -> tuple[list[list[float]], int]:
    """The logging interval's rows on the host, read from the device once: `values` (one row per step, the loss
    in column 0) with the loss averaged over ranks, and `tokens` summed over ranks (one all-reduce). The other
    columns (grad norm, lr, skip flags) are the same on every rank already (DDP all-reduces the grads, FSDP2's
    norm is global), so every rank's callbacks see the same numbers and take the same decision."""
    if not active():
        return values.tolist(), tokens
    steps, width = values.shape
    reduced = torch.cat(
        [values[:, 0].double(), torch.tensor([float(tokens)], dtype=torch.float64, device=values.device)]
    )
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    # the reduced losses and tokens travel with this rank's other columns: one device read for everything
    host = torch.cat([reduced, values[:, 1:].double().flatten()]).tolist()
    losses, total_tokens, rest = host[:steps], host[steps], host[steps + 1 :]
    world = dist.get_world_size()
    other = width - 1
    rows = [[losses[i] / world, *rest[i * other : (i + 1) * other]] for i in range(steps)]
    return rows, int(total_tokens)


def save_final(model, tokenizer, cfg, output_dir: str) -> str:
    """The adapter (or, for tuner=full, the whole model gathered from its shards) saved by rank 0."""
    from fused_stable.train.saved.final_model import save_final as save_one

    if not active():
        return save_one(model, tokenizer, cfg, output_dir)
    state = distributed.full_model_state_dict(model) if is_fsdp(model) else None  # collective: every rank
    target = os.path.join(output_dir, "model" if cfg.tuner == "full" else "adapter")
    if rank() == 0:
        target = save_one(unwrap(model), tokenizer, cfg, output_dir, state_dict=state)
    barrier()
    return target
