"""Helpers for the tests that step an optimizer over Shard(0) DTensor params on several meshes and compare with
one process (tests/integrations/test_integ_fsdp2_state.py, test_integ_fsdp2_muon.py): seeded full tensors (the
same on every mesh), steps from seeded grads, every state as a full tensor, and the run saved through
torch.distributed.checkpoint on one mesh and resumed on another."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def seeded(shapes: Sequence[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def grads_at(shapes: Sequence[tuple[int, ...]], step: int) -> list[torch.Tensor]:
    """Step `step`'s full grads: the same on every mesh."""
    return seeded(shapes, 10 + step)


def run_steps(opt, params, shapes, steps, to_param: Callable) -> None:
    """`opt.step()` for each of `steps`, the params' grads being that step's full grads as `to_param` places them."""
    for step in steps:
        for p, g in zip(params, grads_at(shapes, step)):
            p.grad = to_param(g)
        opt.step()


def full_state(opt, params) -> dict:
    """Every state tensor of every param as a full (global) tensor, by (param index, key)."""
    out = {}
    for index, p in enumerate(params):
        for key, value in opt.state[p].items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[(index, key)] = value.detach().clone()
    return out


def save_or_resume(opt, params, mode: str, path: str, advance: Callable, save_at: int) -> None:
    """mode "save": `advance(range(save_at))`, then a torch.distributed.checkpoint of params and optimizer state at
    `path`; mode "resume": one step (the state exists), then that checkpoint loaded over everything."""
    import torch.distributed.checkpoint as dcp

    def contents() -> dict:
        return {"params": {str(i): p for i, p in enumerate(params)}, "optim": opt.state_dict()}

    if mode == "save":
        advance(range(save_at))
        dcp.save(contents(), checkpoint_id=path)
    else:
        advance(range(1))
        loaded = contents()
        dcp.load(loaded, checkpoint_id=path)
        opt.load_state_dict(loaded["optim"])
