"""FusedAdamW.step() (every FusedOptimizer's, FusedMuon's too) inside torch.compile: the fused step as one torch
custom op that dynamo traces.

Eager steps never come here. When dynamo traces a function that calls `opt.step()` (`torch.compile`, with or
without `fullgraph=True`), `FusedAdamW.step` sees `torch.compiler.is_compiling()` and takes this route:

1. `FusedAdamW._init_group(tensors, grads, lrs)` (the name matters: dynamo's OptimizerVariable runs a method of
   that name eagerly, at trace time, and turns what it appends to the lists into graph inputs with guards, as
   for torch's own optimizers). It builds the optimizer's step plan (state created, every grad and state
   checked, exactly as an eager first step), records how the plan's tensors are laid out in a `TracedStep`,
   and returns that record's key, which the graph holds as a constant.
2. The graph calls `torch.ops.fused_stable.fused_step(key, tensors, grads, lrs, grad_scale, found_inf)`. It
   declares every tensor it writes (`tensors`: the step buffers, params, moments, step counters, master
   copies) and has a fake kernel (it returns nothing), so dynamo, AOTAutograd and inductor trace it without a
   graph break and order it correctly against the rest of the graph. It is an opaque op rather than a
   `torch.library.triton_op`: the kernels reach tensors through int64 address tables, which inductor's analysis
   of a wrapped Triton kernel cannot see, so the op states its mutations itself.
3. When the graph runs, the op's implementation runs the same backend as an eager step (Triton kernels on
   CUDA, torch's multi-tensor ops on CPU) on the tensors it is given: a compiled step computes exactly what an
   eager step computes. Its plan is cached by the tensors' addresses; new grad storage only rewrites the
   address table, as in an eager step.
4. A matrix rule that says so (`COMPILED_STEP` in its matrix.py: FusedMuon's Muon groups) is stepped inside the
   same op, right after the fused step, from its decisions (matrix_step.py). Its params' states are made at trace
   time and close the op's `tensors`; the op builds the rule's update over the tensors it is given, at the groups'
   hyper-parameters as they are when it runs (rebuilt when they change, as an eager step rebuilds it).

What a trace may hold and what it must read anew. The plan's structure (which params, their state tensors and
formats: the param set, `amsgrad`, `state_precision`) is fixed by the trace; dynamo guards every value of
`param_groups` and the state's keys, so a change to any of them retraces before the graph runs again (and the
op refuses to run a plan whose groups no longer match, should a change slip past the guards). The values a
scheduler or a loop writes between steps (every group's lr, betas, eps, weight_decay, maximize, and the
optimizer's `policy`) are read from the optimizer each time the op runs, as an eager step reads them: a trace
never freezes them. Dynamo still specialises on a float the first time it changes (one retrace per changed
key, then the key is a graph input and later changes cost nothing: docs/optimizer.md has the counts).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any

import torch

from . import ops
from .layout import StepBuffers
from .plan import SameGrads, StepPlan

OP_NAME = "fused_stable::fused_step"

# StepPlan fields that are per-tensor lists of the tensors the kernels read or write (None where absent, e.g.
# no master copy). `params` and `all_params` are left out: without DTensors a traced plan's params are its
# local params, and only the eager per-step check reads the full list.
_NOT_TENSOR_LISTS = ("params", "all_params", "group_params", "storages")


@dataclasses.dataclass(eq=False)
class TracedStep:
    """What one traced `opt.step()` call passes to the op, and how to rebuild a step plan from it."""

    optimizer: weakref.ref
    backend: str
    template: StepPlan  # the optimizer's plan at trace time: sizes, dtypes, groups, members
    tensor_lists: list[tuple[str, list[bool]]]  # StepPlan field -> which entries are tensors (the rest None)
    buffer_fields: list[str]  # StepBuffers fields, first in the op's `tensors`
    # per group, the tensor lr passed in `lrs` at trace time (None where the lr was a float); by identity: the op
    # takes the graph's input for a group whose lr is still that tensor (an in-graph write to it is then seen)
    traced_lrs: list[torch.Tensor | None]
    # a matrix rule's params (FusedMuon's Muon groups): (plan index, state keys) whose tensors close `tensors`
    matrix_states: list[tuple[int, tuple[str, ...]]] = dataclasses.field(default_factory=list)
    cached: tuple | None = None  # (addresses of `tensors`, plan, buffers, matrix states) of the latest call
    matrix: object = None  # the latest call's MatrixSteps (rebuilt when the groups' hyper-parameters change)


_traced: dict[tuple, int] = {}  # identity of a TracedStep's contents -> key (a retrace reuses its key)
_steps: dict[int, TracedStep] = {}
_keys = itertools.count()


def prepare(opt, tensors: list, grads: list, lrs: list) -> int:
    """Trace time (eager): fills the op's argument lists for `opt`'s next step; returns the TracedStep key, -1 when
    no parameter has a grad (nothing to do, as in an eager step)."""
    if getattr(opt, "norm_reducer", None) is not None:
        # the op would need the DTensors' local shards as graph inputs and an all-reduce inside it; refused
        # before anything is built, so the optimizer is left exactly as it was
        raise RuntimeError(
            "a compiled step with sharded (DTensor / FSDP2) parameters is not supported: compile the model and "
            "call opt.step() outside the compiled function"
        )
    plan, plan_grads = opt.build_step_plan()
    if plan is None:
        return -1
    buffers = opt.step_buffers
    buffer_fields = [f.name for f in dataclasses.fields(StepBuffers)]
    tensors.extend(getattr(buffers, name) for name in buffer_fields)
    tensor_lists = []
    for field in dataclasses.fields(StepPlan):
        values = getattr(plan, field.name)
        if field.name in _NOT_TENSOR_LISTS or not _is_tensor_list(values):
            continue
        tensor_lists.append((field.name, [v is not None for v in values]))
        tensors.extend(v for v in values if v is not None)
    matrix_states = _matrix_states(opt, plan)
    for index, keys in matrix_states:
        tensors.extend(opt.state[plan.params[index]][key] for key in keys)
    grads.extend(plan_grads)
    traced_lrs = [row.lr if isinstance(row.lr, torch.Tensor) else None for row in opt.hparam_rows()]
    lrs.extend(lr for lr in traced_lrs if lr is not None)
    step = TracedStep(
        optimizer=weakref.ref(opt),
        backend=opt.backend,
        template=plan,
        tensor_lists=tensor_lists,
        buffer_fields=buffer_fields,
        traced_lrs=traced_lrs,
        matrix_states=matrix_states,
    )
    identity = (id(opt), plan.version, tuple(map(id, tensors)), tuple(map(id, lrs)), opt.backend)
    key = _traced.get(identity)
    if key is None:
        key = _traced[identity] = next(_keys)
        weakref.finalize(opt, _forget, identity, key)  # the record holds the optimizer's tensors: drop it with it
    _steps[key] = step
    return key


def _matrix_states(opt, plan: StepPlan) -> list[tuple[int, tuple[str, ...]]]:
    """A matrix rule's params (updated after the fused step, from its decisions): their states made now, as an
    eager first step makes them, so that the graph holds them as inputs the op mutates."""
    if plan.all_updated:
        return []
    steps = opt.matrix_steps(plan)
    return [
        (index, tuple(key for key, value in state.items() if key != "step" and isinstance(value, torch.Tensor)))
        for index, state in steps.states(opt.state)
    ]


def _forget(identity: tuple, key: int) -> None:
    _traced.pop(identity, None)
    _steps.pop(key, None)


def _is_tensor_list(values: Any) -> bool:
    return (
        isinstance(values, list)
        and any(isinstance(v, torch.Tensor) for v in values)
        and all(v is None or isinstance(v, torch.Tensor) for v in values)
    )


@torch.library.custom_op(OP_NAME, mutates_args=("tensors",))
def fused_step(
    key: int,
    tensors: list[torch.Tensor],
    grads: list[torch.Tensor],
    lrs: list[torch.Tensor],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """One fused step (global norm, clip, skip, schedule, AdamW) over the tensors a trace laid out (see module doc)."""
    step = _steps.get(key)
    if step is None:
        raise RuntimeError(
            f"{OP_NAME} was called with key {key}, which no traced FusedAdamW step produced in this process"
        )
    opt = step.optimizer()
    if opt is None:
        raise RuntimeError(f"{OP_NAME} was called for a FusedAdamW that no longer exists (traced step {key})")
    _check_groups_unchanged(opt, step.template)
    plan, buffers, matrix_states = _plan_for(step, tensors, grads)
    hparams = _current_hparams(opt, step, lrs)
    ops.BACKENDS[step.backend].fused_step(plan, grads, buffers, opt.policy, hparams, grad_scale, found_inf, None)
    opt.last_tables = plan.backend_cache  # per_tensor_grad_norms() reads the latest step's tables
    if matrix_states:  # a matrix rule's groups, from the same decisions, at the groups' current hyper-parameters
        step.matrix = opt.matrix_steps(plan, matrix_states, step.matrix)
        step.matrix.step(buffers.fstate, grads)


@fused_step.register_fake
def _(key, tensors, grads, lrs, grad_scale, found_inf) -> None:
    return None


def _check_groups_unchanged(opt, template: StepPlan) -> None:
    """A loud error, never a step on a stale plan: the param set or a state format changed since the trace and
    dynamo did not retrace (its guards cover every such change seen so far; this is the net under them)."""
    changed = template.changed_group(opt.param_groups)
    if changed is not None:
        raise RuntimeError(
            f"FusedAdamW's param groups changed since this compiled step was traced ({changed}) and torch.compile "
            "did not retrace: the compiled step would update a stale set of tensors. Call torch._dynamo.reset() "
            "(or compile the step anew) after changing the param set, amsgrad or state_precision"
        )


def _current_hparams(opt, step: TracedStep, lrs: list[torch.Tensor]) -> list:
    """Every group's hyper-parameters as they are now, read as an eager step reads them (the same row objects
    while the values stay, so a backend's identity check still spares it a re-upload); a group whose lr is the
    tensor traced takes the graph's input for it."""
    rows = opt.hparam_rows()
    if not lrs:
        if any(isinstance(row.lr, torch.Tensor) for row in rows):
            _refuse_new_lr_kind()
        return rows
    inputs = iter(lrs)
    current = []
    for group, (row, traced) in enumerate(zip(rows, step.traced_lrs)):
        graph_lr = next(inputs) if traced is not None else None
        if isinstance(row.lr, torch.Tensor) != (traced is not None):
            _refuse_new_lr_kind(group)
        current.append(row._replace(lr=graph_lr) if row.lr is traced and traced is not None else row)
    return current


def _refuse_new_lr_kind(group: int | None = None) -> None:
    where = "a group's" if group is None else f"group {group}'s"
    raise RuntimeError(
        f"{where} lr changed between a float and a tensor since this compiled step was traced, and torch.compile did "
        "not retrace: call torch._dynamo.reset() (or compile the step anew) after changing the lr's kind"
    )


def _plan_for(step: TracedStep, tensors: list[torch.Tensor], grads: list[torch.Tensor]):
    """The step plan over these very tensors: the cached one while their addresses stay, else a new one."""
    addresses = tuple(t.data_ptr() for t in tensors)
    cached = step.cached
    if cached is not None and cached[0] == addresses:
        plan, buffers, matrix_states = cached[1], cached[2], cached[3]
    else:
        values = iter(tensors)
        buffers = StepBuffers(**{name: next(values) for name in step.buffer_fields})
        lists = {name: [next(values) if present else None for present in mask] for name, mask in step.tensor_lists}
        local = lists["local_params"]
        plan = dataclasses.replace(
            step.template,
            **lists,
            params=local,
            param_ptrs=[p.data_ptr() for p in local],
            storages=[p.untyped_storage() for p in local],
            grad_ptrs=None,
            grads_version=0,
            backend_cache=None,
            same_grads=SameGrads(),
        )
        matrix_states = {plan.params[index]: {key: next(values) for key in keys} for index, keys in step.matrix_states}
        step.cached = (addresses, plan, buffers, matrix_states)
    grad_ptrs = [g.data_ptr() for g in grads]
    if grad_ptrs != plan.grad_ptrs:  # new grad storage: the backend rewrites its address table
        plan.grad_ptrs = grad_ptrs
        plan.grads_version += 1
    return plan, buffers, matrix_states
