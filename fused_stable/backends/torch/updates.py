"""The torch backend's update doors: one `Update` per (param group, dtype, layout class) of a plan, chosen once
when the plan's lists are built (torch_backend.TorchLists):

  NativeUpdate    torch's `_fused_adamw_`, on the params or on fp32 working copies (low-precision params, or
                  tensors `_fused_adamw_` cannot walk as flat memory);
  CompiledUpdate  the compiled CPU op (cpu_ops.adamw, rules/adamw/cpu.h): contiguous fp32, bf16 or fp16 params
                  (with or without fp32 masters) and fp32 moments on the CPU;
  LowbitUpdate    the compiled CPU op for bf16 and 8-bit state (cpu_ops.adamw_lowbit): contiguous CPU tensors,
                  the exact reference's arithmetic in one pass per chunk;
  CompiledLionUpdate  Lion's (rules/lion/torch.py lists it): the compiled CPU op (cpu_ops.lion) on contiguous CPU
                  tensors with fp32, bf16 or 8-bit exp_avg, the exact reference's update bit for bit;
  ExactUpdate     the exact tensor reference for bf16 and 8-bit state (exact_reference.py): any layout, any
                  device, and the CPU without the compiled ops.

A step calls each door once: `on_host` with the CPU step's host decisions (never on a skipped step), or
`on_tensors` with the 0-dim tensor decisions (meta and CUDA tensors, and CPU tensors without the compiled
ops; a plan with compiled doors reads the tensor decisions and takes `on_host`, torch_backend.fused_step).
"""

from __future__ import annotations

from importlib import import_module
from typing import Protocol

import numpy as np
import torch

from ... import state_format
from ...plan import StepPlan
from ...rules import RULES
from ...rules.adamw.torch import step_scalars
from ...state_format import BF16, FP32, Q8
from . import cpu_ops
from .exact_reference import ExactUpdate

adamw, lion = RULES["adamw"], RULES["lion"]

_COMPILED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Update(Protocol):
    """What torch_backend.py calls on a door (see the module doc)."""

    group: int  # the param group, whose hyper-parameters the door takes
    indices: list[int] | None  # the door's tensors in plan order; None: all of them, in order
    advances_steps: bool  # whether it advances its tensors' `step` counters itself (else the backend does)
    reads_grad_divisor: bool  # whether it takes the grads' divisor (1 / grad_mul) as a tensor

    def on_host(
        self,
        grads: list[torch.Tensor],
        hp: tuple,
        grad_mul: np.float32,
        lr_factor: np.float32,
        grad_divisor: torch.Tensor | None,
    ) -> None: ...

    # NativeUpdate and ExactUpdate only: a plan with compiled doors never takes the tensor decisions' update
    def on_tensors(
        self,
        grads: list[torch.Tensor],
        hp: tuple,
        grad_mul: torch.Tensor,
        skip: torch.Tensor,
        lr_factor: torch.Tensor,
        grad_divisor: torch.Tensor,
    ) -> None: ...


class NativeUpdate:
    """One `_fused_adamw_` call: the tensors of one param group and dtype (and layout class), the working
    copies it updates instead of the params when they need one, and the copies in and back."""

    advances_steps = False
    reads_grad_divisor = True

    __slots__ = (
        "group",
        "amsgrad",
        "indices",
        "params",
        "exp_avgs",
        "exp_avg_sqs",
        "max_exp_avg_sqs",
        "steps",
        "grads32",
        "copy_in",
        "copy_out",
    )

    @staticmethod
    def fits(plan: StepPlan, group: int, all_indices: list[int], fmt: int, relayout: bool, compiled: bool) -> bool:
        """fp32 moments, any layout (working copies where needed)."""
        return fmt == FP32

    def __init__(self, plan: StepPlan, group, indices: list[int] | None, all_indices: list[int], fmt, relayout: bool):
        params = [plan.local_params[i] for i in all_indices]
        masters = [plan.masters[i] for i in all_indices]
        self.group, self.indices = group, indices
        self.amsgrad = plan.group_options[group]
        self.steps = [plan.steps[i] for i in all_indices]
        self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs = _moments(plan, all_indices, self.amsgrad)
        self.params, self.grads32, self.copy_in, self.copy_out = params, None, None, None
        dtype = params[0].dtype
        if relayout:  # every tensor of the update as a contiguous fp32 copy, copied in before and back after
            # the param's value comes from its fp32 master when it has one
            sources = [m if m is not None else p for m, p in zip(masters, params)]
            states = self.exp_avgs + self.exp_avg_sqs + self.max_exp_avg_sqs
            work = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in sources + states]
            n = len(params)
            self.params = work[:n]
            self.grads32 = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in params]
            self.exp_avgs, self.exp_avg_sqs = work[n : 2 * n], work[2 * n : 3 * n]
            self.max_exp_avg_sqs = work[3 * n :]
            self.copy_in = (work, sources + states)
            targets = params + [m for m in masters if m is not None] + states
            self.copy_out = (targets, work[:n] + [w for w, m in zip(work[:n], masters) if m is not None] + work[n:])
        elif dtype != torch.float32:  # _fused_adamw_ wants one dtype: fp32 copies (or the masters) for the update
            # persistent buffers, filled with _foreach_copy_ each step: fresh .float() copies cost an
            # allocation and page faults per step (several times the update itself on CPU)
            copies = [m if m is not None else torch.empty_like(p, dtype=torch.float32) for m, p in zip(masters, params)]
            refill = [(c, p) for c, p, m in zip(copies, params, masters) if m is None]
            self.grads32 = [torch.empty_like(p, dtype=torch.float32) for p in params]
            self.copy_in = ([c for c, _ in refill], [p for _, p in refill]) if refill else None
            self.copy_out = (params, copies)
            self.params = copies

    def on_host(self, grads, hp: tuple, grad_mul, lr_factor, grad_divisor) -> None:
        """`grad_divisor` is None when the grads are not scaled (`_fused_adamw_` then only reads them)."""
        self._call(grads, float(lr_factor * hp.lr), hp, grad_divisor, None)

    def on_tensors(self, grads, hp: tuple, grad_mul, skip, lr_factor, grad_divisor) -> None:
        """It divides the grads by `grad_divisor` and leaves everything untouched when `skip` (found_inf) is 1."""
        self._call(grads, lr_factor * hp.lr, hp, grad_divisor, skip)

    def _call(self, grads: list[torch.Tensor], lr, hp: tuple, grad_divisor, found_inf) -> None:
        """One `_fused_adamw_` call, on the working copies when there are (see the class doc)."""
        if self.grads32 is not None:
            if self.copy_in is not None:
                torch._foreach_copy_(*self.copy_in)
            torch._foreach_copy_(self.grads32, grads)
            grads = self.grads32
        torch._fused_adamw_(
            self.params,
            grads,
            self.exp_avgs,
            self.exp_avg_sqs,
            self.max_exp_avg_sqs,
            self.steps,
            lr=lr,
            beta1=hp.betas[0],
            beta2=hp.betas[1],
            weight_decay=hp.weight_decay,
            eps=hp.eps,
            amsgrad=self.amsgrad,
            maximize=hp.maximize,
            grad_scale=grad_divisor,
            found_inf=found_inf,
        )
        if self.copy_out is not None:
            torch._foreach_copy_(*self.copy_out)


class CompiledUpdate:
    """One call of the compiled CPU op (cpu_ops.adamw) on contiguous CPU params and fp32 moments: it reads
    the grads times `grad_mul` without writing them back, and advances the `step` counters itself. Taken only
    on host decisions (see the module doc)."""

    advances_steps = True
    reads_grad_divisor = False

    __slots__ = ("group", "indices", "params", "masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps")

    def __init__(self, plan: StepPlan, group: int, indices: list[int] | None, all_indices: list[int], fmt, relayout):
        self.group, self.indices = group, indices
        self.params = [plan.local_params[i] for i in all_indices]
        masters = [plan.masters[i] for i in all_indices]
        self.masters = masters if masters[0] is not None else None
        self.steps = [plan.steps[i] for i in all_indices]
        self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs = _moments(plan, all_indices, plan.group_options[group])

    @staticmethod
    def fits(plan: StepPlan, group: int, all_indices: list[int], fmt: int, relayout: bool, compiled: bool) -> bool:
        """Whether the op is built and can update these tensors in place (fp32 moments): see `_fits_in_place`."""
        return compiled and fmt == FP32 and not relayout and _fits_in_place(plan, group, all_indices, False)

    def on_host(self, grads, hp: tuple, grad_mul, lr_factor, grad_divisor) -> None:
        cpu_ops.adamw(
            self.params,
            grads,
            self.exp_avgs,
            self.exp_avg_sqs,
            self.max_exp_avg_sqs,
            self.steps,
            masters=self.masters,
            lr=float(lr_factor * hp.lr),
            beta1=hp.betas[0],
            beta2=hp.betas[1],
            weight_decay=hp.weight_decay,
            eps=hp.eps,
            maximize=hp.maximize,
            grad_mul=float(grad_mul),
        )


class LowbitUpdate:
    """One call of the compiled CPU op for bf16 or 8-bit moments (cpu_ops.adamw_lowbit) on contiguous CPU
    tensors: the exact reference's update (exact_reference.ExactUpdate, the fallback and the tests' oracle) in
    one pass per chunk. Its per-tensor step scalars and stochastic-rounding keys come from the reference's own
    functions (rules/adamw/torch.py's `step_scalars`, state_format.random_key), one value per tensor, so the
    codes, scales, moments and params are the reference's bit for bit. Taken only on host decisions; the
    backend advances the `step` counters first, as for the reference."""

    advances_steps = False
    reads_grad_divisor = False

    __slots__ = ("group", "indices", "format", "params", "masters", "moments", "scales", "steps", "positions", "rows")

    def __init__(
        self, plan: StepPlan, group: int, indices: list[int] | None, all_indices: list[int], fmt: int, relayout
    ):
        self.group, self.indices, self.format = group, indices, fmt
        self.params = [plan.local_params[i] for i in all_indices]
        masters = [plan.masters[i] for i in all_indices]
        self.masters = masters if masters[0] is not None else None
        amsgrad = plan.group_options[group]
        self.moments = _moments(plan, all_indices, amsgrad)
        q8 = fmt == Q8
        self.scales = _moments(plan, all_indices, amsgrad, plan.scales) if q8 else ([], [], [])
        self.steps = [plan.steps[i] for i in all_indices]
        self.positions = torch.tensor([plan.positions[i] for i in all_indices], dtype=torch.int64)
        self.rows: dict[tuple, torch.Tensor] = {}  # the group's fp32 hyper-parameter row, per value

    @staticmethod
    def fits(plan: StepPlan, group: int, all_indices: list[int], fmt: int, relayout: bool, compiled: bool) -> bool:
        """Whether the op is built and can update these tensors in place (bf16 or 8-bit moments, the 8-bit scales
        contiguous too): see `_fits_in_place`."""
        return compiled and fmt != FP32 and _fits_in_place(plan, group, all_indices, fmt == Q8)

    def on_host(self, grads, hp: tuple, grad_mul, lr_factor, grad_divisor) -> None:
        steps = torch.stack(self.steps)
        decisions = [torch.tensor(float(x), dtype=torch.float32) for x in (grad_mul, lr_factor)]
        scalars = step_scalars(self._row(hp), steps[:, None], *decisions)
        columns = torch.broadcast_tensors(*(x.reshape(-1) for x in scalars))
        cpu_ops.adamw_lowbit(
            self.params,
            grads,
            self.moments,
            self.scales,
            masters=self.masters,
            scalars=torch.stack(columns, dim=1).contiguous(),
            keys=state_format.random_key(self.positions, steps),
            state_format=self.format,
        )

    def _row(self, hp: tuple) -> torch.Tensor:
        """The group's hyper-parameter row in fp32, as the kernels' table (and the reference) holds it; the host
        decisions give the lr as a float."""
        key = (float(hp.lr), *hp[1:])
        row = self.rows.get(key)
        if row is None:
            self.rows.clear()
            row = self.rows[key] = torch.tensor(adamw.hparam_row(*key), dtype=torch.float32)
        return row


def _moments(plan: StepPlan, all_indices: list[int], amsgrad: bool, tensors=None) -> tuple[list, list, list]:
    """AdamW's (exp_avgs, exp_avg_sqs, max_exp_avg_sqs) of these tensors from the plan's state slots (or from its
    scale slots, `tensors=plan.scales`); the last is empty without amsgrad."""
    slots = plan.states if tensors is None else tensors
    picked = [[slots[i][slot] for i in all_indices] for slot in range(2)]
    return picked[0], picked[1], [slots[i][2] for i in all_indices] if amsgrad else []


def _fits_in_place(plan: StepPlan, group: int, all_indices: list[int], with_scales: bool) -> bool:
    """Whether a compiled CPU op can update these tensors in place: CPU fp32, bf16 or fp16 params (the torch
    backend groups by dtype), every one with a master copy or none, and the params, states (max_exp_avg_sq with
    amsgrad), their 8-bit scales when `with_scales`, and the masters contiguous (a non-contiguous grad is read
    from a copy)."""
    first = plan.local_params[all_indices[0]]
    if first.dtype not in _COMPILED_PARAM_DTYPES or first.device.type != "cpu":
        return False
    tensors = [plan.local_params[i] for i in all_indices]
    for i in all_indices:
        tensors += plan.states[i]
        if with_scales:
            tensors += plan.scales[i]
    with_master = [plan.masters[i] is not None for i in all_indices]
    if any(with_master):
        if not all(with_master):
            return False
        tensors += [plan.masters[i] for i in all_indices]
    return all(t.is_contiguous() for t in tensors)


class CompiledLionUpdate:
    """One call of the compiled CPU op for Lion (cpu_ops.lion, rules/lion/cpu.h) on contiguous CPU tensors with
    fp32, bf16 or 8-bit exp_avg: the exact reference's update in one pass per chunk (24 bytes per fp32 param with
    fp32 exp_avg and the norm pass, where the reference gathers everything into padded flat copies), reading the
    grads times `grad_mul` without writing them. Its step scalars and stochastic-rounding keys are the reference's
    own (rules/lion/torch.py's `step_scalars` on the reference's fp32 row, state_format.random_key), so params,
    masters, exp_avg, codes and scales are the reference's bit for bit. Listed in rules/lion/torch.py's DOORS.
    Taken on host decisions; `on_tensors` (the 0-dim tensor decisions, never taken on a plan with compiled
    doors) is the exact reference's, built for the same tensors."""

    advances_steps = False  # the backend advances the counters first, as for the reference (bf16 keys read them)
    reads_grad_divisor = False

    __slots__ = ("group", "indices", "format", "params", "masters", "exp_avgs", "scales", "steps", "positions", "exact")

    def __init__(self, plan: StepPlan, group: int, indices: list[int] | None, all_indices: list[int], fmt, relayout):
        self.group, self.indices, self.format = group, indices, fmt
        self.params = [plan.local_params[i] for i in all_indices]
        masters = [plan.masters[i] for i in all_indices]
        self.masters = masters if masters[0] is not None else None
        self.exp_avgs = [plan.states[i][0] for i in all_indices]
        self.scales = [plan.scales[i][0] for i in all_indices] if fmt == Q8 else None
        self.steps = [plan.steps[i] for i in all_indices]
        self.positions = torch.tensor([plan.positions[i] for i in all_indices], dtype=torch.int64)
        # the reference for the same tensors: the 0-dim tensor decisions' update, and the row and step_scalars
        # this door computes its scalars with (one definition of them)
        self.exact = ExactUpdate(plan, group, indices, all_indices, fmt)

    @staticmethod
    def fits(plan: StepPlan, group: int, all_indices: list[int], fmt: int, relayout, compiled: bool) -> bool:
        """Whether the op is built and can update these Lion tensors in place: `_fits_in_place` (`relayout` is
        not read: the op reads a non-contiguous grad from a copy, and every other tensor must be contiguous)."""
        if not compiled or plan.rule.name != lion.name:
            return False
        return _fits_in_place(plan, group, all_indices, fmt == Q8)

    def on_host(self, grads, hp, grad_mul, lr_factor, grad_divisor) -> None:
        decisions = [torch.tensor(float(x), dtype=torch.float32) for x in (grad_mul, lr_factor)]
        scalars = self.exact.language.step_scalars(self.exact.hparam_row(hp), None, *decisions)
        # bf16 exp_avg's stochastic rounding: the reference's keys (each tensor's position and advanced step)
        keys = state_format.random_key(self.positions, torch.stack(self.steps)) if self.format == BF16 else None
        cpu_ops.lion(
            self.params,
            grads,
            self.exp_avgs,
            masters=self.masters,
            scalars=torch.stack(scalars),
            state_format=self.format,
            exp_avg_scales=self.scales,
            keys=keys,
        )

    def on_tensors(self, grads, hp, grad_mul, skip, lr_factor, grad_divisor) -> None:
        self.exact.on_tensors(grads, hp, grad_mul, skip, lr_factor, grad_divisor)


# the rules' own doors, tried in order before the exact reference (torch_backend.choose_update)
_RULE_DOORS = {adamw.name: (CompiledUpdate, LowbitUpdate, NativeUpdate)}


def doors_of(rule) -> tuple:
    """The doors a rule offers besides the exact reference: AdamW's above, and those a rule's torch.py lists in
    DOORS (a new rule needs no edit here)."""
    language = import_module(rule.package + ".torch")
    return _RULE_DOORS.get(rule.name, ()) + tuple(getattr(language, "DOORS", ()))
