"""The step plan: what the optimizer's param groups and state amount to for one fused step, flattened once.

FusedAdamW (optim.py) builds a `StepPlan` (`build_plan`) from its param groups and state and keeps it; a backend
(fused_stable/backends) keeps its own device side of the plan (tables, prepared launches) in
`plan.backend_cache`. The plan is rebuilt only when something it encodes changes:
  - the param set: a group added, a group's params list replaced or edited, another set of params with grads;
  - a state tensor: created, loaded, replaced or removed in `opt.state` (the optimizer's state mapping reports
    every such change, see `ParamStates` in param_state.py, so no step has to look);
  - a param's size or dtype (`p.data = p.data[:n]`, even at the same address), seen through its grad: torch
    keeps a grad's shape and dtype equal to its param's;
  - a param's storage, checked whenever grad storage changes (docs/design.md, "What a step does not look at",
    says which two changes wait for that, and why no launch reaches freed memory meanwhile).
A step therefore only gathers the grads and checks that they are the very tensors of the last step (`SameGrads`,
one pass of id()) or else that their storage (address and size) is what the plan and the backend's tables were
built for (`current_grads`): two to four C-level `map`s over the params, not a rebuild of per-param lists.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any

import torch

from . import sharded_state, state_format
from .param_state import ParamStates, Version
from .sharding import element_offset, is_dtensor, local
from .state_format import FP32, Q8, SCALE_SUFFIX

# C-level accessors for map(): a pass over hundreds of params costs tens of microseconds, a Python loop hundreds
_grad_of = operator.attrgetter("grad")
_dtype_of = operator.attrgetter("dtype")
_nbytes_of = operator.attrgetter("nbytes")
_data_ptr = torch.Tensor.data_ptr
_stride_of = torch.Tensor.stride
_is_contiguous = torch.Tensor.is_contiguous
_storage_of = torch.Tensor.untyped_storage
_is = operator.is_


class SameGrads:
    """Whether this step's grads are the very tensors accepted before, from one pass of id() over them.

    Equal ids alone prove nothing (a new tensor can take a dead one's id), so the accepted grads are tracked by
    weak references whose callback notes any death: equal ids and no death mean the same living tensors, whose
    storage the address and size checks already accepted. Their storages are held meanwhile, so even a grad
    whose storage is swapped in place (`g.data = t`, `g.set_(t)`: not looked for) never sends a launch to freed
    memory; a death drops them. Arming costs a weak reference per grad, so it is done only while grads persist
    between steps: a loop that makes new grads every step (zero_grad(set_to_none=True)) goes back to the address
    check and retries arming every `RETRY` steps.
    """

    RETRY = 64

    __slots__ = ("ids", "refs", "storages", "alive", "hits", "cooldown", "__weakref__")

    def __init__(self) -> None:
        self.ids: list[int] | None = None
        self.refs: list | None = None
        self.storages: list | None = None
        self.alive = False
        self.hits = 0
        self.cooldown = 0

    def same(self, grads: list) -> bool:
        if not self.alive or list(map(id, grads)) != self.ids:
            return False
        self.hits += 1
        return True

    def seen(self, grads: list) -> None:
        """The grads were accepted by the address check: arm for the next step, unless arming does not pay."""
        if self.ids is not None and self.hits == 0:  # the last armed set was replaced before it was reused
            self.cooldown = self.RETRY
        self.ids = self.refs = self.storages = None
        self.alive = False
        if self.cooldown:
            self.cooldown -= 1
            return
        self.refs = list(map(weakref.ref, grads, repeat(_death_notice(weakref.ref(self)))))
        self.storages = list(map(_storage_of, grads))
        self.ids = list(map(id, grads))
        self.alive = True
        self.hits = 0


def _death_notice(tracker_ref):
    """The weak-reference callback for one armed set (it holds the tracker weakly: no reference cycle keeps the
    held storages alive)."""

    def notice(_) -> None:
        tracker = tracker_ref()
        if tracker is not None:
            tracker.alive = False
            tracker.storages = None

    return notice


@dataclass(eq=False)
class StepPlan:
    """The params taking part in a step (those with a grad when the plan was built), in the optimizer's flat
    parameter order, with their state; and the storage of the grads the backend's tables were last told about."""

    version: int  # the optimizer's Version.value when built
    group_params: list[list]  # each group's own params list object (identity, length and contents are checked)
    group_sizes: list[int]
    all_params: list[torch.Tensor]  # every param of every group, flat order: where grads are read from
    members: list[int] | None  # flat positions of the params taking part; None: all of them
    params: list[torch.Tensor]  # the optimizer's param objects taking part (DTensors under FSDP2)
    local_params: list[torch.Tensor]  # what the kernels update (a DTensor's local shard)
    # each local param's first element's index in its whole param (sharding.element_offset: 0 but for a row shard):
    # bf16 stochastic rounding hashes global element indices, the same bits on any mesh
    element_offsets: list[int]
    rule: Any  # the update rule (a fused_stable/rules declaration): its state names, codecs and option
    # each group's rule: `rule`, or None for a group the update pass leaves alone (its params take part in the norm
    # and the decisions only, and keep no rule state: FusedMuon's Muon groups, updated after the fused step)
    group_rules: list
    updated: list[bool]  # each param: whether the update pass updates it (its group has a rule)
    all_updated: bool  # every param is the update pass's: no matrix rule's param to step afterwards (matrix_step.py)
    # each param's state tensors, in the rule's order (rule.state_names(its group's option)): fp32 or bf16, or 8-bit
    # codes (state_format.py)
    states: list[tuple[torch.Tensor, ...]]
    scales: list[tuple[torch.Tensor | None, ...]]  # the 8-bit states' per-block scales, beside them (else None)
    masters: list[torch.Tensor | None]  # fp32 master copy of a low-precision param, or None
    group_options: list[bool]  # each group's rule option (AdamW's `amsgrad`) when built: it decides the states
    group_precisions: list[str]  # each group's `state_precision` when built: it decides the states' formats
    formats: list[int]  # each param's state format (state_format.FP32 / BF16 / Q8)
    steps: list[torch.Tensor]  # fp32 0-dim per-param step counters (torch.optim.AdamW's `step`)
    groups: list[int]  # param-group index of each param
    numels: list[int]
    nbytes: list[int]  # the params' (= their grads')
    param_ptrs: list[int]
    dtypes: list[torch.dtype]  # the params'
    strides: list[tuple[int, ...]]  # the params'
    contiguous: bool  # every param is contiguous (then a grad matches its layout when it is contiguous too)
    sharded: bool  # DTensor params: grads are read through to_local() every step
    dense_layouts: bool  # the backend walks memory linearly: grads must be dense with the params' strides
    storages: list  # the params' storages when built: kept alive, so no launch can touch freed memory
    grad_ptrs: list[int] | None = None  # storage of the grads last accepted
    # without dense_layouts: the grads' strides when built, if some differed from their param's (the torch backend
    # routes those tensors through working copies, so a change of grad layout rebuilds); None if none differed
    grad_strides: list[tuple[int, ...]] | None = None
    grads_version: int = 0  # bumped whenever grad storage changes: backends refresh their address tables
    backend_cache: Any = None  # the backend's device side of this plan
    same_grads: SameGrads = field(default_factory=lambda: SameGrads())

    @property
    def positions(self) -> list[int]:
        return self.members if self.members is not None else list(range(len(self.all_params)))

    # ------------------------------------------------------------------------------------------------
    # the per-step check

    def changed_group(self, param_groups: list[dict]) -> str | None:
        """What in the groups no longer matches this plan (the param set, the rule's option such as `amsgrad`,
        `state_precision`), or None.
        By content, not by list identity: a compiled step (compiled.py) holds the plan of its trace, and a list
        rebuilt with the same params changes nothing it holds."""
        if len(param_groups) != len(self.group_params):
            return f"{len(self.group_params)} param groups when traced, {len(param_groups)} now"
        start = 0
        for index, (group, size, option, precision, rule) in enumerate(
            zip(param_groups, self.group_sizes, self.group_options, self.group_precisions, self.group_rules)
        ):
            # all_params is a copy made at build time: a list edited in place is seen too
            now, built = group["params"], self.all_params[start : start + size]
            start += size
            if len(now) != size or not all(map(_is, now, built)):
                return f"group {index}'s params"
            if group_option(rule, group) != option or group["state_precision"] != precision:
                return f"group {index}'s {getattr(rule, 'option', None) or 'option'} or state_precision"
        return None

    def current_grads(self, param_groups: list[dict]) -> list[torch.Tensor] | None:
        """This step's grads (local tensors, plan order) if the plan still holds for them; None if it must be
        rebuilt (the param set, a param's storage or size, or which params have a grad changed)."""
        group_params = self.group_params
        if len(param_groups) != len(group_params):
            return None
        for group, params, size, option, precision, rule in zip(
            param_groups, group_params, self.group_sizes, self.group_options, self.group_precisions, self.group_rules
        ):
            if (
                group["params"] is not params
                or len(params) != size
                or (rule is not None and rule.option is not None and group[rule.option] != option)
                or group["state_precision"] != precision
            ):
                return None
        if self.sharded:
            return self._sharded_grads()
        # grads are read through the groups' own lists: a param replaced in a list shows up as new grad storage
        live = group_params[0] if len(group_params) == 1 else chain.from_iterable(group_params)
        grads = list(map(_grad_of, live))
        if self.members is not None:
            grads = self._member_grads(grads)
            if grads is None:
                return None
        if self.same_grads.same(grads):  # the very tensors of the last step: one pass of id()
            return grads
        try:
            ptrs = list(map(_data_ptr, grads))
        except (TypeError, RuntimeError):  # a missing grad (None), or one without storage (sparse)
            return None
        if ptrs != self.grad_ptrs:
            if not self.accept_grads(grads, ptrs):
                return None
        # same addresses: same storage only if the sizes are too. Torch keeps a grad's shape and dtype equal to its
        # param's, so this also sees a param resized or recast in place (`p.data = p.data[:n]`): new grads at an
        # address that happens to be reused
        elif list(map(_nbytes_of, grads)) != self.nbytes:
            return None
        elif not self.dense_layouts and not self.same_grad_layouts(grads):  # (torch backend: cheap beside its step)
            return None  # new grads at the old addresses, laid out otherwise: the backend's lists must follow
        self.same_grads.seen(grads)
        return grads

    def _member_grads(self, grads: list) -> list | None:
        present = [i for i, g in enumerate(grads) if g is not None]
        if present != self.members:
            return None
        return [grads[i] for i in present]

    def _sharded_grads(self) -> list[torch.Tensor] | None:
        """DTensor params (FSDP2): the same checks on the local shards, at Python speed."""
        grads = [p.grad for params in self.group_params for p in params]
        if any(p is not q for p, q in zip(chain.from_iterable(self.group_params), self.all_params)):
            return None
        if self.members is not None:
            grads = self._member_grads(grads)
        elif any(g is None for g in grads):
            return None
        if grads is None or any(g.is_sparse for g in grads):
            return None
        shards = [local(g) for g in grads]
        ptrs = [g.data_ptr() for g in shards]
        if ptrs != self.grad_ptrs:
            return shards if self.accept_grads(shards, ptrs) else None
        if [g.nbytes for g in shards] != self.nbytes or [p.data_ptr() for p in self.local_params] != self.param_ptrs:
            return None
        return shards

    def _layouts_match(self, grads: list[torch.Tensor]) -> bool:
        if self.contiguous:  # the usual case, and cheaper to ask than the strides
            return all(map(_is_contiguous, grads))
        return list(map(_stride_of, grads)) == self.strides

    def note_grad_layouts(self, grads: list[torch.Tensor]) -> None:
        """Records the grads' layouts the backend's lists are built for (backends without dense_layouts)."""
        self.grad_strides = None if self._layouts_match(grads) else list(map(_stride_of, grads))

    def same_grad_layouts(self, grads: list[torch.Tensor]) -> bool:
        if self.grad_strides is None:
            return self._layouts_match(grads)
        return list(map(_stride_of, grads)) == self.grad_strides

    def accept_grads(self, grads: list[torch.Tensor], ptrs: list[int]) -> bool:
        """New grad storage: checks it against the params (clear errors) and records it, so the backend
        refreshes its address table; False when something else changed too (the plan is rebuilt)."""
        params = chain.from_iterable(self.group_params)
        if not all(map(_is, params, self.all_params)) or list(map(_data_ptr, self.local_params)) != self.param_ptrs:
            return False
        if list(map(_nbytes_of, grads)) != self.nbytes:
            return False
        if list(map(_dtype_of, grads)) != self.dtypes or (self.dense_layouts and not self._layouts_match(grads)):
            check_grads(self.local_params, grads, self.dense_layouts)  # raises, unless only 1-element strides differ
        elif not self.dense_layouts and not self.same_grad_layouts(grads):
            return False
        self.grad_ptrs = ptrs
        self.grads_version += 1
        return True


def group_option(rule, group: dict) -> bool:
    """A group's value of the rule's option (AdamW's `amsgrad`); False for a rule without one (or no rule)."""
    return rule.group_option(group) if rule is not None else False


def build_plan(
    param_groups: list[dict],
    state: ParamStates,
    version: Version,
    *,
    group_rules: list,
    dense_layouts: bool,
    master_weights: bool,
    device: torch.device,
) -> tuple[StepPlan | None, list[torch.Tensor] | None]:
    """The plan for the params that have a grad now, with their state for their group's rule in `group_rules`
    (created where missing; one rule for every group but those with None, which keep only `step`), and those
    grads (local shards, plan order); (None, None) when no param has a grad. Validates every grad and state before
    a step runs; afterwards a step only checks that nothing the plan encodes moved (`StepPlan.current_grads`)."""
    group_params = [group["params"] for group in param_groups]
    all_params = [p for params in group_params for p in params]
    groups = [index for index, params in enumerate(group_params) for _ in params]
    rules = {id(rule): rule for rule in group_rules if rule is not None}
    if len(rules) > 1:
        raise ValueError("one fused step runs one update rule: the param groups name several")
    rule = next(iter(rules.values()), None)
    group_options = [group_option(rule, group) for rule, group in zip(group_rules, param_groups)]
    group_precisions = [
        state_format.check_precision(group["state_precision"], f"param_groups[{index}]['state_precision']")
        for index, group in enumerate(param_groups)
    ]
    grads = [p.grad for p in all_params]
    members = [i for i, g in enumerate(grads) if g is not None]
    if not members:
        return None, None
    params = [all_params[i] for i in members]
    local_params = [local(p) for p in params]
    local_grads = [local(grads[i]) for i in members]
    check_grads(local_params, local_grads, dense_layouts)
    member_groups = [groups[i] for i in members]
    # from the whole param (a DTensor's numel is global): the same format on every mesh (sharded_state.py)
    formats = [state_format.format_for(group_precisions[group], p.numel()) for p, group in zip(params, member_groups)]
    updated = [group_rules[group] is not None for group in member_groups]
    names = [rule.state_names(group_options[group]) if up else () for group, up in zip(member_groups, updated)]
    states = _ready_states(
        params, formats, names, state, [master_weights and up for up in updated], device, rule, updated
    )
    plan = StepPlan(
        version=version.value,  # after the states created above bumped it
        group_params=group_params,
        group_sizes=[len(params) for params in group_params],
        all_params=all_params,
        members=None if len(members) == len(all_params) else members,
        params=params,
        local_params=local_params,
        element_offsets=[element_offset(p) for p in params],
        rule=rule,
        group_rules=list(group_rules),
        updated=updated,
        all_updated=all(updated),
        states=[tuple(local(s[key]) for key in keys) for s, keys in zip(states, names)],
        scales=[tuple(_scale(s, key) for key in keys) for s, keys in zip(states, names)],
        masters=[local(s["master_param"]) if "master_param" in s else None for s in states],
        group_options=group_options,
        group_precisions=group_precisions,
        formats=formats,
        steps=[s["step"] for s in states],
        groups=[groups[i] for i in members],
        numels=[p.numel() for p in local_params],
        nbytes=[p.nbytes for p in local_params],
        param_ptrs=[p.data_ptr() for p in local_params],
        dtypes=[p.dtype for p in local_params],
        strides=[p.stride() for p in local_params],
        contiguous=all(p.is_contiguous() for p in local_params),
        sharded=any(is_dtensor(p) for p in params),
        dense_layouts=dense_layouts,
        storages=[p.untyped_storage() for p in local_params],
        grad_ptrs=[g.data_ptr() for g in local_grads],
    )
    if not plan.dense_layouts:
        plan.note_grad_layouts(local_grads)
    if not plan.sharded:
        plan.same_grads.seen(local_grads)
    return plan, local_grads


def _scale(state: dict, key: str) -> torch.Tensor | None:
    key += SCALE_SUFFIX
    return local(state[key]) if key in state else None


def _ready_states(params, formats, names, state, master_weights: list[bool], device, rule, updated) -> list[dict]:
    """Each param's state, created where missing and converted where its group's state_precision changed, then
    checked; a format a sharded param cannot hold is refused before any state is created or converted."""
    for p, fmt in zip(params, formats):
        if fmt == Q8 and is_dtensor(p):
            sharded_state.check_q8_layout(p)
    states = []
    first = rule.states[0].name if rule is not None else None
    for p, fmt, keys, master, up in zip(params, formats, names, master_weights, updated):
        param_state = state[p]
        if not param_state:
            init_state(p, param_state, keys, master, device, fmt)
        elif "step" not in param_state and all(key in param_state for key in keys):
            # loaded from an optimizer that keeps no `step` (lion-pytorch, torch.optim.Muon): counted from here
            loaded = float(rule.loaded_step) if rule is not None else 0.0
            param_state["step"] = torch.full((), loaded, dtype=torch.float32, device=device)
        if keys and first in param_state and state_format.format_of(param_state, first) != fmt:  # precision changed
            sharded_state.convert(param_state, fmt, p)
        # a matrix rule's param (not updated here) keeps its rule's states in its rule's dtypes (matrix_step.py)
        check_state(local(p), param_state, keys, fmt, rule if up else None, formats_checked=up)
        states.append(param_state)
    return states


def init_state(
    p: torch.Tensor, state: dict, keys: tuple[str, ...], master_weights: bool, device: torch.device, fmt: int = FP32
) -> None:
    """A param's first state, as torch's optimizers make it (zero states named `keys` and `step`) in the format
    `fmt` (state_format.py), plus the fp32 master copy of a low-precision param when asked for."""
    fresh = {"step": torch.zeros((), dtype=torch.float32, device=device)}
    for key in keys:
        fresh.update(sharded_state.zero_moment(p, key, fmt))  # may refuse the format: nothing stored yet
    if master_weights and p.dtype != torch.float32:
        fresh["master_param"] = p.detach().to(torch.float32, memory_format=torch.preserve_format).clone()
    state.update(fresh)


def check_grads(params: list[torch.Tensor], grads: list[torch.Tensor], dense_layouts: bool) -> None:
    """A grad must match its parameter: dtype and shape always; for the kernels, which walk memory linearly,
    also a dense layout with the parameter's strides."""
    for p, g in zip(params, grads):
        if g.is_sparse:
            raise RuntimeError(
                "FusedAdamW does not support sparse gradients (got one for a parameter of shape "
                f"{tuple(p.shape)}); use torch.optim.SparseAdam for sparse embeddings"
            )
        if g.dtype != p.dtype or g.shape != p.shape:
            raise ValueError(
                f"a gradient of dtype {g.dtype} and shape {tuple(g.shape)} belongs to a parameter of dtype {p.dtype} "
                f"and shape {tuple(p.shape)}: a .grad must match its parameter"
            )
        if not dense_layouts:
            continue
        if not is_dense(p):
            raise ValueError(
                f"fused_stable kernels need dense parameters; got a parameter of shape {tuple(p.shape)} with "
                f"strides {p.stride()}: make it contiguous (e.g. nn.Parameter(t.contiguous())), or use "
                "FusedAdamW(..., backend='torch'), which updates such tensors through contiguous working copies"
            )
        if g.stride() != p.stride() and p.numel() > 1:
            raise ValueError(
                f"a gradient's strides {g.stride()} differ from its parameter's {p.stride()} (shape {tuple(p.shape)}): "
                "fused_stable kernels need matching layouts; make the grad match (p.grad = g.contiguous() for a "
                "contiguous param), or use FusedAdamW(..., backend='torch'), which copies such grads first"
            )


def check_state(
    param: torch.Tensor, state: dict, keys: tuple[str, ...], fmt: int = FP32, rule=None, formats_checked: bool = True
) -> None:
    """The state a plan will point the kernels at must cover the parameter (a replaced or resized one may not), in
    the format `fmt` its group asks for: `keys`, the rule's states for the group (rule.state_names); with
    `formats_checked` False (a matrix rule's param) only its `step` and master copy."""
    required = ("step", *keys)
    missing = [key for key in required if key not in state]
    if fmt == Q8:
        missing += [key + SCALE_SUFFIX for key in keys if key + SCALE_SUFFIX not in state]
    if missing:
        why = saved = ""
        optional = [state.name for state in rule.states if state.option] if rule is not None else []
        if optional and optional[0] in keys:
            why, saved = f", and its group has {rule.option}=True", f" saved with {rule.option}=True"
        name = rule.title if rule is not None else "optimizer"
        raise ValueError(
            f"a parameter's optimizer state lacks {missing} (it has {sorted(state)}{why}): load a complete {name} "
            f"state{saved}, or clear that parameter's state (opt.state[p].clear()) to start it afresh"
        )
    # every state a rule keeps, where present (a stale one of another setting too): it is loaded and saved
    keys_checked = state_format.state_keys() if formats_checked else ()
    expected = {key: (state_format.moment_dtype(key, fmt), param.numel()) for key in keys_checked}
    expected["master_param"] = (torch.float32, param.numel())
    if fmt == Q8 and formats_checked:
        blocks = state_format.num_blocks(param.numel())
        expected.update({key: (torch.float32, blocks) for key in state_format.scale_keys()})
    for key, (dtype, numel) in expected.items():
        tensor = state.get(key)
        if tensor is None:
            continue
        tensor = local(tensor)
        if tensor.numel() != numel or tensor.dtype != dtype or tensor.device != param.device:
            raise ValueError(
                f"state {key!r} ({tensor.dtype}, {tuple(tensor.shape)}, {tensor.device}) does not fit its parameter "
                f"({tuple(param.shape)} on {param.device}, state format {state_format.FORMAT_NAMES[fmt]}: {dtype}, "
                f"{numel} elements): a parameter changed size or a state tensor was replaced by one that does not "
                "match; give it a matching tensor, or clear that parameter's state (opt.state[p].clear()) to start "
                "it afresh"
            )
    step = state.get("step")
    if step is not None and (not isinstance(step, torch.Tensor) or step.dtype != torch.float32 or step.numel() != 1):
        raise ValueError(f"state 'step' must be a 0-dim float32 tensor, got {step!r}")


def is_dense(t: torch.Tensor) -> bool:
    if t.is_contiguous() or t.numel() <= 1:
        return True
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return span == t.numel()
