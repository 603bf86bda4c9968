"""What a checkpoint holds and how every kind of run writes and reads it: the one place the trainer's checkpoints
are made of the live model, optimizer, scaler, RNGs and trainer state, and put back.

- `save` / `load`: what the loop calls (a save, a resume, a rollback), for the three kinds of run: one process,
  torchrun (DDP, FSDP2: the state gathered into full tensors on rank 0, every rank's RNG stream) and DeepSpeed
  (every rank writes its partitions through the engine into the checkpoint's temporary directory, rank 0 adds
  the trainer's files and commits).
- The folder itself (atomic rename, the COMPLETE marker over every file, verification, listing, `--resume`) is
  `checkpoint`'s; this module decides what goes in it.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch
import torch.distributed as dist

from fused_stable import state_format
from fused_stable.errors import UserError
from fused_stable.integrations import distributed
from fused_stable.train.run import checkpoint, parallel

ENGINE_DIR = "deepspeed"  # the engine's files inside checkpoints/step-N/ (DeepSpeed's checkpoint tag)


def save(loop) -> str | None:
    """Every rank: the checkpoint of the loop's current step (`Trainer`: model, optimizer, scaler, engine, state,
    config, output_dir, save_total_limit); rank 0 writes it. Returns its path on rank 0, None elsewhere."""
    trainer_state = {**asdict(loop.state), "elapsed_s": loop.elapsed(), "world_size": loop.runtime.world_size}
    if loop.guard is not None:
        trainer_state["guard"] = loop.guard.state_dict()
    if loop.engine is not None:  # DeepSpeed: every rank writes its partitions, rank 0 commits
        path = save_engine(
            loop.engine,
            loop.output_dir,
            loop.state.step,
            trainer_state=trainer_state,
            config=loop.config,
            keep=loop.save_total_limit,
        )
        parallel.barrier()
        return path
    # torchrun: every rank takes part in gathering the state (FSDP2 shards, each rank's RNG); rank 0 writes
    model_state, optimizer_state, rng = checkpoint_state(loop.model, loop.optimizer)
    path = None
    if loop.runtime.is_main:
        path = checkpoint.save_checkpoint(
            loop.output_dir,
            loop.state.step,
            model_state=model_state,
            optimizer=loop.optimizer,
            scaler=loop.scaler,
            trainer_state=trainer_state,
            config=loop.config,
            keep=loop.save_total_limit,
            optimizer_state=optimizer_state,
            rng=rng,
        )
    parallel.barrier()  # no rank goes on (or rolls back) before the checkpoint is complete
    return path


def load(loop, path: str) -> dict:
    """Every rank: the checkpoint at `path` into the loop's live model, optimizer, scaler (or engine) and RNGs;
    returns the saved trainer state."""
    if loop.engine is not None:
        return load_engine(loop.engine, path)
    return load_ranks(path, model=loop.model, optimizer=loop.optimizer, scaler=loop.scaler)


# ------------------------------------------------------------------------------------------ torchrun (DDP, FSDP2)
_OPT_EXTRA = "fused_stable"  # FusedAdamW's counters (skips, z-score statistics): dropped by torch's DCP helpers


def checkpoint_state(model, optimizer) -> tuple[dict, dict | None, dict | None]:
    """(trainable weights, optimizer state, RNG states) to save; a collective under FSDP2, so every rank
    calls it. The trainable weights carry the user's names (no DDP `module.` prefix) and, under FSDP2, are
    gathered into full tensors on rank 0; the optimizer state likewise (None = `optimizer.state_dict()`).
    The RNG states are every rank's (None in a single process = this process's)."""
    if not parallel.active():
        return checkpoint.trainable_state(model), None, None
    rng = rank_rngs()
    if not parallel.is_fsdp(model):
        return checkpoint.trainable_state(parallel.unwrap(model)), None, rng
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    full = distributed.full_model_state_dict(model)  # rank 0: every tensor; other ranks: empty
    model_state = {k: v for k, v in full.items() if k in trainable}
    optim_state = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    extra = optimizer.state_dict().get(_OPT_EXTRA)
    if extra is not None:  # global counters: the same on every rank
        optim_state[_OPT_EXTRA] = {k: v.cpu() if torch.is_tensor(v) else v for k, v in extra.items()}
    return model_state, optim_state, rng


def rank_rngs() -> dict | None:
    """Every rank's RNG states (a collective): rank 0's at the top level, as a single-process checkpoint has them,
    and the list of all under "ranks"; None in a single process (the checkpoint takes this process's)."""
    if not parallel.active():
        return None
    rngs: list = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, checkpoint.rng_state())
    return {**rngs[0], "ranks": rngs}


def load_ranks(path: str, *, model, optimizer, scaler) -> dict:
    """Every rank loads the checkpoint rank 0 wrote: weights, optimizer, scaler and its own RNG stream.
    Returns the trainer state, as `checkpoint.load_checkpoint` does."""
    if not parallel.active():
        return checkpoint.load_checkpoint(path, model=model, optimizer=optimizer, scaler=scaler)
    fsdp = parallel.is_fsdp(model)
    saved = checkpoint.load_checkpoint(
        path,
        model=None if fsdp else parallel.unwrap(model),
        optimizer=None if fsdp else optimizer,
        scaler=scaler,
        restore_rng=False,
    )
    if fsdp:
        _load_sharded(path, model, optimizer)
    rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)  # python/numpy states: not weights-only
    ranks = rng.get("ranks")
    checkpoint.set_rng_state(ranks[parallel.rank()] if ranks else rng)
    return saved


def _load_sharded(path: str, model, optimizer) -> None:
    """FSDP2: every rank reads the full tensors and keeps its shards of them."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    weights = load_file(os.path.join(path, "weights.safetensors"))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, unknown = sorted(trainable - weights.keys()), sorted(weights.keys() - trainable)
    if missing or unknown:
        raise UserError(
            f"the checkpoint does not match this model ({len(missing)} trainable tensors missing, "
            f"{len(unknown)} unknown, e.g. {(missing + unknown)[0]!r}): resume with the run's own config"
        )
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    optim_state = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)
    # DCP's loader merges the saved state over the live one's: an untagged (v1) 8-bit state must say so itself
    state_format.tag_untagged_codes(optim_state)
    extra = optim_state.pop(_OPT_EXTRA, None)
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
    if extra is not None:
        # the DCP loader drops FusedAdamW's counters (and recovers the applied steps from the per-param step
        # counts); put them back exactly through FusedAdamW's own loader
        optimizer.load_state_dict({**optimizer.state_dict(), _OPT_EXTRA: extra})


# ------------------------------------------------------------------------------------------ DeepSpeed
def save_engine(engine, output_dir: str, step: int, *, trainer_state: dict, config: dict, keep: int):
    """Every rank: its partitions through the engine (`deepspeed_run.Engine`) into the checkpoint's temporary
    directory; then rank 0 commits it with the trainer's files. Returns the path on rank 0."""
    staged = [checkpoint.staging_dir(output_dir, step) if parallel.rank() == 0 else None]
    if parallel.active():
        dist.broadcast_object_list(staged, src=0)
    rng = rank_rngs()
    engine.ds.save_checkpoint(staged[0], tag=ENGINE_DIR, save_latest=False, exclude_frozen_parameters=engine.adapter)
    parallel.barrier()  # every rank's partitions are written before rank 0 commits
    if parallel.rank() != 0:
        return None
    return checkpoint.save_checkpoint(
        output_dir,
        step,
        model_state=None,
        optimizer=None,
        trainer_state={**trainer_state, "zero_stage": engine.stage},
        config=config,
        keep=keep,
        rng=rng,
        staged=staged[0],
    )


def load_engine(engine, path: str) -> dict:
    """Every rank: the engine's state (weights, FusedAdamW's state and counters) and its own RNG stream."""
    if not os.path.isdir(os.path.join(path, ENGINE_DIR)):
        raise UserError(f"{path} was not written through DeepSpeed (no {ENGINE_DIR}/): resume it without DeepSpeed")
    loaded, _ = engine.ds.load_checkpoint(
        path, tag=ENGINE_DIR, load_module_strict=not engine.adapter, load_lr_scheduler_states=False
    )
    if loaded is None:
        raise UserError(f"{os.path.join(path, ENGINE_DIR)}: DeepSpeed could not load it")
    rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)  # python/numpy states: not weights-only
    ranks = rng.get("ranks")
    checkpoint.set_rng_state(ranks[parallel.rank()] if ranks else rng)
    return checkpoint.read_trainer_state(path)
