"""The fused step with torch's own multi-tensor ops (backend "torch", the default for CPU tensors).

`torch._foreach_norm` (fp32 accumulation) for the norm, the decision kernel's sections (`decide`: the functions
below it carry the names of kernels/decide.py's jit helpers, in the same order), `torch._foreach_add_` on the
step counters and `torch._fused_adamw_`, and no `_foreach_mul_` clip pass. On CPU tensors the decisions run on
host scalars with the kernel's rounding (a CPU tensor's value is host memory: the read waits for nothing), and
the update branches on them: no update on a skipped step, no `grad_scale` when the grads are not scaled (32
bytes per fp32 parameter instead of torch's 40; 36 when clipped, as torch's CPU kernel writes the scaled grads
back). Elsewhere (meta, CUDA) the same sections run as 0-dim tensor ops, with a device `grad_scale` (= loss
scale / clip coefficient) and `found_inf` (= skip) for `_fused_adamw_`: no host reads. docs/design.md, "The
torch backend", says where the CPU step's time goes.

`TorchLists` is this backend's side of a StepPlan, built once per plan: the per-dtype lists of the norm, the
index tensors that put per-tensor norms back in parameter order, and one update per (group, dtype, layout
class, state format), chosen then (updates.py: the rule's compiled CPU op, torch's `_fused_adamw_` for AdamW, or
the exact tensor reference).

torch's CPU `_fused_adamw_` walks every tensor of a call as flat memory in the param's order, so it is wrong
for a param that is not dense, or whose grad or state tensors are laid out differently (a transposed grad):
those tensors go through contiguous fp32 working copies (copied in and back around the same call), which is
exact, and costs a copy only for them.
"""

from __future__ import annotations

import numpy as np
import torch

from ...kernels.tables import upload_int64
from ...layout import StepBuffers, StepPolicy
from ...plan import StepPlan, is_dense
from ...state_format import FP32
from . import cpu_ops, host_decide
from .exact_reference import ExactUpdate
from .host_decide import HOST_READERS as HOST_READERS
from .torch_decide import advance_steps, decide, keep_worst, per_tensor_sums, show_next_lrs
from .updates import Update, implementations

DENSE_LAYOUTS = False  # tensors of any layout go through working copies (fused_stable.backends.Backend)


def compiled_cpu_ops() -> bool:
    """Whether the compiled CPU ops run (built, not switched off: cpu_ops.available; fused_stable.backends.Backend)."""
    return cpu_ops.available()


def layout_fits_fused_adamw(tensors: list[torch.Tensor | None]) -> bool:
    """Whether `_fused_adamw_` may walk these tensors (param first, then its grad and states) as flat memory."""
    param = tensors[0]
    if param.numel() <= 1:
        return True
    strides = param.stride()
    return is_dense(param) and all(t is None or t.stride() == strides for t in tensors[1:])


class TorchLists:
    """Per-plan lists for the torch backend (see the module doc)."""

    def __init__(self, plan: StepPlan, grads: list[torch.Tensor], device: torch.device) -> None:
        by_dtype: dict[torch.dtype, list[int]] = {}
        by_update: dict[tuple, list[int]] = {}
        for index, (group, param, fmt) in enumerate(zip(plan.groups, plan.local_params, plan.formats)):
            by_dtype.setdefault(param.dtype, []).append(index)
            if not plan.updated[index]:  # a group without a rule: measured and decided for, updated elsewhere
                continue
            if fmt != FP32:  # bf16 or 8-bit state: the compiled op or the exact reference (choose_update)
                # (masters or not, contiguous or not): one non-contiguous param keeps only itself off the compiled op
                key = (group, param.dtype, (plan.masters[index] is not None, param.is_contiguous()), fmt)
                by_update.setdefault(key, []).append(index)
                continue
            tensors = [param, grads[index], *plan.states[index], plan.masters[index]]
            relayout = not layout_fits_fused_adamw(tensors)
            by_update.setdefault((group, param.dtype, relayout, FP32), []).append(index)
        everything = list(range(len(plan.local_params)))
        # None stands for "all of them, in order": the usual single dtype and group needs no per-step gathering
        self.norm_indices = [None if indices == everything else indices for indices in by_dtype.values()]
        order = [i for indices in by_dtype.values() for i in indices]
        self.order = upload_int64(order, device) if len(by_dtype) > 1 else None
        self.positions = upload_int64(plan.positions, device)
        self.all_positions = plan.members is None  # the plan holds every param, in order: positions is the identity
        self.per_tensor_sumsq: torch.Tensor | None = None
        self.lrs_key: tuple | None = None  # the groups' lrs that `base_lrs` holds (floats by value, tensors by id)
        self.base_lrs: torch.Tensor | None = None
        self.steps = plan.steps
        self.meta = device.type == "meta"  # no values: nothing to compute, and nothing may be read
        self.cpu = device.type == "cpu"  # the decisions may run on host scalars (`on_host`)
        self.grad_divisor = torch.ones((), dtype=torch.float32, device=device)  # the host path's grad_scale
        self.host_views: tuple | None = None  # (fstate, istate, numpy arrays on them): host_scalars
        # the compiled CPU ops (backends/torch/cpu_ops.py), where built: the norm pass, and the rules' updates
        self.compiled = self.cpu and cpu_ops.available()
        self.sumsq_out = torch.empty(len(plan.local_params), dtype=torch.float32) if self.compiled else None
        # one implementation per update, chosen here once (updates.py); for bf16 / 8-bit state the key's third
        # item is (whether the params have masters, whether they are contiguous), not a layout class
        self.updates: list[Update] = [
            choose_update(plan, group, None if ids == everything else ids, ids, relayout, fmt, self.compiled)
            for (group, _, relayout, fmt), ids in by_update.items()
        ]
        # what the host path does besides the updates: the `step` counters they do not advance themselves (all
        # but the compiled update's), and whether any update takes the grad divisor
        pairs = zip(self.updates, by_update.values())
        self.uncompiled_steps = [plan.steps[i] for u, indices in pairs if not u.advances_steps for i in indices]
        self.uncompiled_steps += [step for step, updated in zip(plan.steps, plan.updated) if not updated]
        self.any_reads_grad_divisor = any(u.reads_grad_divisor for u in self.updates)


def choose_update(
    plan: StepPlan, group: int, indices: list[int] | None, all_indices: list[int], relayout: bool, fmt: int, compiled
) -> Update:
    """The update of one (group, dtype, layout class, state format): the first of the rule's implementations that
    fits (updates.implementations: the rule's compiled CPU op on contiguous CPU tensors where the ops are built;
    AdamW's `_fused_adamw_` for fp32 state otherwise), else the exact reference, which runs any rule in any state
    format."""
    for implementation in implementations(plan.rule):
        if implementation.fits(plan, group, all_indices, fmt, relayout, compiled):
            return implementation(plan, group, indices, all_indices, fmt, relayout)
    return ExactUpdate(plan, group, indices, all_indices, fmt)


def fused_step(
    plan: StepPlan,
    grads: list[torch.Tensor],
    buffers: StepBuffers,
    policy: StepPolicy,
    hparams: list,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    global_sumsq,
) -> None:
    """The norm, the decisions and the rule's update for every tensor of `plan`
    (`fused_stable.backends.Backend.fused_step`), in the order of the Triton path: norm pass, decision kernel,
    update. On CPU tensors the decisions run on host scalars (`on_host`); elsewhere (meta, or CUDA tensors given
    this backend) on 0-dim device tensors."""
    lists: TorchLists | None = plan.backend_cache
    if lists is None:
        lists = plan.backend_cache = TorchLists(plan, grads, buffers.fstate.device)
    host = lists.cpu and on_host(hparams, grad_scale)
    if lists.compiled and (grad_scale is None or grad_scale.numel() == 1):
        per_tensor_sumsq, sumsq = compiled_sums(lists.sumsq_out, grads, grad_scale)
        if not host:  # the 0-dim tensor decisions read it as a tensor
            sumsq = torch.tensor(sumsq, dtype=torch.float32)
    else:
        per_tensor_sumsq = per_tensor_sums(lists, grads, grad_scale)
        sumsq = per_tensor_sumsq.sum()
    if global_sumsq:
        sumsq = global_sumsq(per_tensor_sumsq, plan.params)
    lists.per_tensor_sumsq = per_tensor_sumsq

    if host:  # the same decisions on host scalars: a read of a CPU tensor waits for nothing
        fstate, istate, sumsq, grad_scale, found_inf = host_scalars(lists, buffers, sumsq, grad_scale, found_inf)
        with np.errstate(all="ignore"):  # inf and NaN are values here, as on the device: no numpy warnings
            grad_mul, skip, lr_factor, worse = host_decide.decide(
                sumsq, fstate, istate, policy, hparams[0].lr, grad_scale, found_inf
            )
    else:
        grad_mul, skip, lr_factor, worse = decide(
            sumsq, buffers.fstate, buffers.istate, policy, hparams[0].lr, grad_scale, found_inf
        )
    keep_worst(buffers.worst_sumsq, per_tensor_sumsq, worse, None if lists.all_positions else lists.positions)

    if lists.meta:  # no values to update (the state exists now, as after torch's step); the ops below read scalars
        return
    if policy.schedule is not None:
        show_next_lrs(lists, buffers, hparams, policy.schedule)
    if host:
        run_updates_host(lists, grads, hparams, grad_mul, skip, lr_factor)
    elif lists.compiled:  # CPU tensors, tensor decisions: the compiled update all the same (one update code)
        run_updates_host(lists, grads, *read_decisions(hparams, grad_mul, skip, lr_factor))
    else:
        advance_steps(lists.steps, skip)
        run_updates(lists, grads, hparams, grad_mul, skip, lr_factor)


def on_host(hparams: list, grad_scale: torch.Tensor | None) -> bool:
    """Whether a CPU step's decisions run on host scalars: all but a tensor lr (whose dtype the 0-dim ops would
    promote to) and a GradScaler scale that is not one fp32 value, which keep the 0-dim tensor ops."""
    if grad_scale is not None and (grad_scale.dtype != torch.float32 or grad_scale.numel() != 1):
        return False
    return not any(type(row.lr) is torch.Tensor for row in hparams)


def compiled_sums(
    per_tensor_sumsq: torch.Tensor, grads: list[torch.Tensor], grad_scale: torch.Tensor | None
) -> tuple[torch.Tensor, float]:
    """Per-tensor sums of squares of the (unscaled) grads, in plan order, into the plan's buffer, and their global
    sum as a float: the compiled norm pass (one call for every grad, fp64 accumulation; the loss scale, one fp32
    value on this path, divided out of both). The buffer is the last step's sums (readouts.py reads them)."""
    sumsq = cpu_ops.sum_squares(grads, per_tensor_sumsq)
    if grad_scale is not None:
        inverse = 1.0 / float(grad_scale.item())
        per_tensor_sumsq.mul_(inverse * inverse)
        sumsq *= inverse * inverse
    return per_tensor_sumsq, sumsq


def read_decisions(hparams: list, grad_mul, skip, lr_factor) -> tuple:
    """The 0-dim CPU tensor decisions as numpy fp32 scalars, and the rows' tensor lrs as floats, for the host
    update (`run_updates_host`'s arguments after the grads; a read of host memory)."""
    rows = [row._replace(lr=float(row.lr)) if type(row.lr) is torch.Tensor else row for row in hparams]
    return (rows, *(np.float32(x.item()) for x in (grad_mul, skip, lr_factor)))


def host_scalars(lists: TorchLists, buffers: StepBuffers, sumsq, grad_scale, found_inf) -> tuple:
    """The CPU step's host view of what the decisions read: numpy arrays on the memory of the buffers fstate and
    istate (made once per pair, ~4 us each), and the global sum of squares (a tensor, or the compiled norm's
    float), loss scale and found_inf flag as numpy fp32 scalars (None where not given)."""
    cached = lists.host_views
    if cached is None or cached[0] is not buffers.fstate or cached[1] is not buffers.istate:
        cached = lists.host_views = (buffers.fstate, buffers.istate, buffers.fstate.numpy(), buffers.istate.numpy())
    return (
        cached[2],
        cached[3],
        np.float32(sumsq if type(sumsq) is float else sumsq.item()),
        None if grad_scale is None else np.float32(grad_scale.item()),
        None if found_inf is None else np.float32(found_inf.item()),
    )


def run_updates(
    lists: TorchLists,
    grads: list[torch.Tensor],
    hparams: list,
    grad_mul: torch.Tensor,
    skip: torch.Tensor,
    lr_factor: torch.Tensor,
) -> None:
    """The rule's update with the 0-dim tensor decisions, one call per update (`Update.on_tensors`): a skipped step
    leaves everything untouched (`found_inf` = 1 for `_fused_adamw_`, the exact reference's own skip)."""
    grad_divisor = grad_mul.reciprocal()
    for update in lists.updates:
        indices = update.indices
        group_grads = grads if indices is None else [grads[i] for i in indices]
        update.on_tensors(group_grads, hparams[update.group], grad_mul, skip, lr_factor, grad_divisor)


def run_updates_host(
    lists: TorchLists,
    grads: list[torch.Tensor],
    hparams: list,
    grad_mul: np.float32,
    skip: np.float32,
    lr_factor: np.float32,
) -> None:
    """`run_updates` with the decisions as host scalars (`Update.on_host`): a skipped step runs nothing (what
    `found_inf` = 1 leaves: every tensor untouched, the `step` counters too). The compiled update
    (cpu_ops.update_op) advances its own `step` counters (cpu_ops.advance_steps) and reads the grads times
    `grad_mul`; `_fused_adamw_` gets `grad_scale` only when the grads are scaled (a clip,
    or a loss scale): given one, torch's CPU kernel writes the scaled grads back into the grads, 4 bytes per
    param more than the 32 of an update that only reads them; a factor of exactly 1 changes nothing."""
    if skip:
        return
    if lists.uncompiled_steps:  # the compiled update advances its own
        torch._foreach_add_(lists.uncompiled_steps, 1.0)
    grad_divisor = None
    if grad_mul != 1.0 and lists.any_reads_grad_divisor:
        grad_divisor = lists.grad_divisor
        grad_divisor.fill_(float(np.float32(1.0) / grad_mul))
    for update in lists.updates:
        indices = update.indices
        group_grads = grads if indices is None else [grads[i] for i in indices]
        update.on_host(group_grads, hparams[update.group], grad_mul, lr_factor, grad_divisor)
