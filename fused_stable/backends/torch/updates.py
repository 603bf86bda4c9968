"""The torch backend's update implementations: one `Update` per (param group, dtype, layout class, state format)
of a plan, chosen once when the plan's lists are built (torch_backend.TorchLists, `choose_update`), the first of a
rule's `implementations` that fits, else the exact reference:

  CompiledUpdate  the rule's compiled CPU op (cpu_ops.update_op: backends/torch/cpu_update.h over the rule's
                  rules/<rule>/cpu.h), for every rule with a cpu.h: contiguous fp32, bf16 or fp16 params (with or
                  without fp32 masters) and fp32, bf16 or 8-bit state on the CPU, the grads read times the step's
                  multiplier and never written; its step scalars computed on the host by the rule's torch.py;
  NativeUpdate    torch's `_fused_adamw_`, for a rule whose torch.py declares TORCH_FUSED = "adamw" (AdamW): fp32
                  state that the compiled op does not take (no compiled ops, a layout it does not walk), on the
                  params or on fp32 working copies;
  ExactUpdate     the exact tensor reference (exact_reference.py): any rule, format, layout and device.

On an applied step the compiled update advances its tensors' `step` counters itself (cpu_ops.advance_steps: one
compiled call, which also gives their values to its scalars; `torch._foreach_add_` costs ~1.7 us per 0-dim
counter on the CPU, 0.75 ms for a 448-tensor LoRA step); the backend advances the others first (torch_backend.py).
A step calls each update once: `on_host` with the CPU step's host decisions (never on a skipped step), or
`on_tensors` with the 0-dim tensor decisions (meta and CUDA tensors, and CPU tensors without the compiled ops; a
plan with compiled updates reads the tensor decisions and takes `on_host`, torch_backend.fused_step).
"""

from __future__ import annotations

import functools
from importlib import import_module
from types import ModuleType
from typing import Protocol

import numpy as np
import torch

from ... import state_format
from ...plan import StepPlan
from ...state_format import BF16, FP32, Q8
from . import cpu_ops
from .host_decide import read_steps

_COMPILED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Update(Protocol):
    """What torch_backend.py calls on an update (see the module doc); `hp` is the group's hyper-parameters as the
    optimizer gives them (lr first)."""

    group: int  # the param group, whose hyper-parameters the update takes
    indices: list[int] | None  # the update's tensors in plan order; None: all of them, in order
    advances_steps: bool  # whether it advances its tensors' `step` counters itself (else the backend does, first)
    reads_grad_divisor: bool  # whether it takes the grads' divisor (1 / grad_mul) as a tensor

    def on_host(
        self,
        grads: list[torch.Tensor],
        hp: tuple,
        grad_mul: np.float32,
        lr_factor: np.float32,
        grad_divisor: torch.Tensor | None,
    ) -> None: ...

    # NativeUpdate and ExactUpdate only: a plan with compiled updates never takes the tensor decisions' update
    def on_tensors(
        self,
        grads: list[torch.Tensor],
        hp: tuple,
        grad_mul: torch.Tensor,
        skip: torch.Tensor,
        lr_factor: torch.Tensor,
        grad_divisor: torch.Tensor,
    ) -> None: ...


@functools.cache
def language_of(rule) -> ModuleType:
    """The rule's torch.py: its `step_scalars` and element, and what it declares for this backend."""
    return import_module(rule.package + ".torch")


def implementations(rule) -> tuple:
    """The updates a rule offers before the exact reference, in the order tried: the compiled CPU op (every rule
    with a cpu.h: `CompiledUpdate.fits` asks), then torch's `_fused_adamw_` where the rule's torch.py declares
    TORCH_FUSED = "adamw". A new rule needs no edit here."""
    if getattr(language_of(rule), "TORCH_FUSED", None) == "adamw":
        return (CompiledUpdate, NativeUpdate)
    return (CompiledUpdate,)


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
        """fp32 moments, any layout (working copies where needed); offered only for a rule whose torch.py
        declares TORCH_FUSED = "adamw" (`implementations`)."""
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
    """One call of the rule's compiled CPU op (cpu_ops.update_op) on contiguous CPU tensors, any state format:
    states in place, in the rule's order; bf16 to nearest or stochastically and 8-bit with each state's codec, as
    the rule declares (`codecs`, `stochastic_bf16`). Its scalars are the rule's torch.py `step_scalars` on the
    group's fp32 row (the exact reference's function, so bf16 / 8-bit codes, scales and params are the reference's
    bit for bit, and so is Lion in every format), or for fp32 state the function the rule declares as
    FP32_STATE_SCALARS (AdamW: torch.optim.AdamW's fp64 scalars, `float64_step_scalars`); computed once per distinct
    `step` value of the call (a group's tensors usually share one), not per tensor. It advances its tensors' `step`
    counters itself, first, as torch's AdamW does. Taken only on host decisions (see the module doc)."""

    advances_steps = True
    reads_grad_divisor = False

    __slots__ = (
        "group", "indices", "format", "option", "op", "params", "masters", "states", "scales", "signed_slots",
        "stochastic_slots", "steps", "step_values", "positions", "first_elements", "no_keys", "step_scalars",
        "fp32_state_scalars",
        "hparam_row", "row",
    )  # fmt: skip

    @staticmethod
    def fits(plan: StepPlan, group: int, all_indices: list[int], fmt: int, relayout, compiled: bool) -> bool:
        """Whether the ops are built, the rule has one, and it can update these tensors in place
        (`_fits_in_place`; a non-contiguous grad is read from a copy). fp32 state whose grads are laid out unlike
        their params (`relayout`) stays with torch's `_fused_adamw_` where the rule offers it, as before the
        compiled op took every rule: the same bits (the op reading the grad from a copy would move fewer)."""
        if not compiled or cpu_ops.update_op(plan.rule) is None:
            return False
        if fmt == FP32 and relayout and NativeUpdate in implementations(plan.rule):
            return False
        return _fits_in_place(plan, group, all_indices, fmt == Q8)

    def __init__(self, plan: StepPlan, group: int, indices: list[int] | None, all_indices: list[int], fmt, relayout):
        rule, language = plan.rule, language_of(plan.rule)
        self.group, self.indices, self.format = group, indices, fmt
        self.option = bool(plan.group_options[group])
        self.op = cpu_ops.update_op(rule)
        self.params = [plan.local_params[i] for i in all_indices]
        masters = [plan.masters[i] for i in all_indices]
        self.masters = masters if masters[0] is not None else []
        names = rule.state_names(self.option)
        self.states = [plan.states[i][slot] for slot in range(len(names)) for i in all_indices]  # slot by slot
        self.scales = [plan.scales[i][slot] for slot in range(len(names)) for i in all_indices] if fmt == Q8 else []
        self.signed_slots, stochastic = rule.slot_codes(self.option)
        self.stochastic_slots = stochastic if fmt == BF16 else 0
        self.steps = [plan.steps[i] for i in all_indices]
        self.step_values = torch.empty(len(all_indices), dtype=torch.float32)  # the counters after this step's +1
        self.positions = torch.tensor([plan.positions[i] for i in all_indices], dtype=torch.int64)
        # each tensor's first element's index in its whole param (a shard's offset): the random bits' element index
        self.first_elements = torch.tensor([plan.element_offsets[i] for i in all_indices], dtype=torch.int64)
        self.no_keys = torch.zeros(len(all_indices), dtype=torch.int64)  # keys are read by stochastic bf16 only
        self.step_scalars = language.step_scalars
        self.fp32_state_scalars = getattr(language, "FP32_STATE_SCALARS", None) if fmt == FP32 else None
        self.hparam_row = rule.hparam_row
        self.row: tuple = (None, None)  # (hyper-parameters, their fp32 row)

    def on_host(self, grads, hp: tuple, grad_mul, lr_factor, grad_divisor) -> None:
        cpu_ops.advance_steps(self.steps, self.step_values)  # each counter + 1 (fp32), and its new value
        scalars = self._scalars(hp, grad_mul, lr_factor, read_steps(self.step_values))
        # bf16 stochastic rounding: the reference's keys (each tensor's position and advanced step)
        keys = state_format.random_key(self.positions, self.step_values) if self.stochastic_slots else self.no_keys
        self.op(
            self.params,
            grads,
            self.states,
            self.scales,
            self.masters,
            scalars,
            keys,
            self.first_elements,
            self.format,
            self.option,
            self.signed_slots,
            self.stochastic_slots,
        )

    def _scalars(self, hp: tuple, grad_mul, lr_factor, steps: np.ndarray) -> torch.Tensor:
        """The op's scalars: one row for all tensors when they share one step count (the usual case), else one
        row per tensor, each distinct step's row computed once."""
        if (steps == steps[0]).all():
            return self._rows(hp, grad_mul, lr_factor, steps[:1])
        distinct, inverse = np.unique(steps, return_inverse=True)
        return self._rows(hp, grad_mul, lr_factor, distinct)[torch.from_numpy(inverse.reshape(-1))].contiguous()

    def _rows(self, hp: tuple, grad_mul, lr_factor, steps: np.ndarray) -> torch.Tensor:
        """[len(steps), number of scalars] fp32: the rule's scalars for each of these (advanced) step values."""
        if self.fp32_state_scalars is not None:
            rows = [self.fp32_state_scalars(hp, float(step), grad_mul, lr_factor) for step in steps]
            return torch.from_numpy(np.stack(rows))
        decisions = [torch.tensor(float(x), dtype=torch.float32) for x in (grad_mul, lr_factor)]
        scalars = self.step_scalars(self._row(hp), torch.from_numpy(steps)[:, None], *decisions)
        columns = torch.broadcast_tensors(*(x.reshape(-1) for x in scalars))
        return torch.stack(columns, dim=1).contiguous()

    def _row(self, hp: tuple) -> torch.Tensor:
        """The group's hyper-parameter row in fp32, as the kernels' table (and the exact reference) holds it; the
        host decisions give the lr as a float."""
        key = (float(hp[0]), *hp[1:])
        if self.row[0] != key:
            self.row = (key, torch.tensor(self.hparam_row(*key), dtype=torch.float32))
        return self.row[1]


def _moments(plan: StepPlan, all_indices: list[int], amsgrad: bool) -> tuple[list, list, list]:
    """AdamW's (exp_avgs, exp_avg_sqs, max_exp_avg_sqs) of these tensors from the plan's state slots (NativeUpdate's
    `_fused_adamw_` arguments); the last is empty without amsgrad."""
    picked = [[plan.states[i][slot] for i in all_indices] for slot in range(2)]
    return picked[0], picked[1], [plan.states[i][2] for i in all_indices] if amsgrad else []


def _fits_in_place(plan: StepPlan, group: int, all_indices: list[int], with_scales: bool) -> bool:
    """Whether the compiled CPU op can update these tensors in place: CPU fp32, bf16 or fp16 params (the torch
    backend groups by dtype), every one with a master copy or none, and the params, states, their 8-bit scales
    when `with_scales`, and the masters contiguous (a non-contiguous grad is read from a copy)."""
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
