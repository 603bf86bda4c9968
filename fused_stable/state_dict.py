"""FusedAdamW's state dict and pickling: torch.optim.AdamW's layout, fp32 moments kept fp32, the device counters
under one extra key, and a `__setstate__` that fills what older pickles lack.

A mixin of FusedAdamW (optim.py), whose settings, buffers and helpers it uses: `policy`, `master_weights`,
`device`, `backend`, `_fstate`, `_istate`, `_worst_sumsq`, `_version`, `_show_lrs()`, `_new_worst_sumsq()`,
`_new_step_buffers()`, `_params_device()` and `reset_max_zscore()` / `_reset_worst_step()` (readouts.py).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from . import engines, layout, ops, sharded_state, state_format
from .layout import StepPolicy, check_not_differentiable
from .matrix_step import matrix_module
from .param_state import ParamStates, Version
from .sharding import is_dtensor, local


def _taken_keys() -> tuple[str, ...]:
    """The state taken out before torch's loader, which casts floating state to the param's dtype (8-bit codes
    are not floating, their fp32 scales are): every rule's states, their scales, the master weights."""
    return state_format.state_keys() + state_format.scale_keys() + ("master_param",)


_STATE_KEY = "fused_stable"
_LAYOUT_VERSION = 2  # of the counters saved under _STATE_KEY: 2 added the worst-step window (layout.F_WORST_*)


class SavedState:
    """state_dict / load_state_dict and pickling for FusedAdamW (see the module doc)."""

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["state"] = {key: dict(entry) for key, entry in state["state"].items()}  # plain dicts, like torch's
        for entry in state["state"].values():  # 8-bit codes say which code format they are in
            if state_format.holds_codes(entry):
                entry[state_format.CODES_KEY] = state_format.codes_tag()
        state[_STATE_KEY] = {"fstate": self._fstate.clone(), "istate": self._istate.clone(), "layout": _LAYOUT_VERSION}
        if self.policy.schedule is not None:  # the base lr, as before schedules were shown (see _show_lrs)
            for saved, group in zip(state["param_groups"], self.param_groups):
                saved["lr"] = group["initial_lr"]
        return state

    def torch_state_dict(self) -> dict[str, Any]:
        """This state as torch's optimizer of the rule saves it (FusedAdamW: torch.optim.AdamW's), from any
        state_precision: fp32 states (8-bit ones decoded, bf16 ones widened) under torch's keys (AdamW: `step`,
        `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`), no scales, master weights or device counters; param groups
        without `state_precision`. torch's load_state_dict takes it (and casts the moments to each param's dtype,
        as it always does)."""
        state = self.state_dict()
        state.pop(_STATE_KEY)
        for entry in state["state"].values():
            for key in state_format.state_keys():
                if key in entry:
                    entry[key] = state_format.to_fp32(entry, key)
            for key in state_format.scale_keys() + ("master_param", state_format.CODES_KEY):
                entry.pop(key, None)
        for group in state["param_groups"]:
            group.pop("state_precision", None)
        return state

    def state_fp32(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The state `name` the optimizer keeps for `param` (e.g. "exp_avg", "exp_avg_sq", "momentum_buffer") as a
        new fp32 tensor shaped like the param, whatever its precision (fp32, bf16, or 8-bit codes decoded with
        their block scales): one door to the stored state for users, tests and benchmarks. Under FSDP2 it is the
        local shard's. KeyError, naming what the param keeps, when it keeps no such state (yet)."""
        state = self.state.get(param) or {}
        if name not in state:
            raise KeyError(
                f"{type(self).__name__} keeps no state {name!r} for this param (it keeps {sorted(state)}; a param's "
                "state is made at its first step)"
            )
        stored = {key: local(state[key]) for key in (name, name + state_format.SCALE_SUFFIX) if key in state}
        return state_format.to_fp32(stored, name).clone()

    def state_bytes(self) -> int:
        """Bytes the optimizer's per-param state takes (or will take, before the first step): each rule's states in
        its group's state_precision (8-bit scales included; a matrix rule's as its matrix.py says), `step`, and
        master weights; from the param groups, and equal to what opt.state holds once every param has stepped."""
        total = 0
        for group in self.param_groups:
            rule = self.group_rule(group)
            if not rule.elementwise:
                interface = matrix_module(rule)
                # a DTensor's local shard: what this rank's opt.state holds, as for the elementwise rules
                total += sum(interface.state_bytes(local(p), group) + 4 for p in group["params"])
                continue
            states = len(rule.state_names(rule.group_option(group)))
            for p in group["params"]:
                numel = local(p).numel()
                total += state_format.planned_bytes(numel, group["state_precision"], states, p.numel()) + 4
                if self.master_weights and p.dtype != torch.float32:
                    total += 4 * numel
        return total

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop(_STATE_KEY, None)
        if extra is not None:
            _check_counters(extra)  # before anything changes
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, "
                f"this optimizer has {len(self.param_groups)}"
            )
        id_to_param = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
                )
            check_not_differentiable(saved.get("differentiable"), "a state dict saved with differentiable=True")
            id_to_param.update(zip(saved["params"], group["params"]))
        moments, versions, plain_state = _take_moments(state_dict["state"], id_to_param)
        precisions = [group["state_precision"] for group in self.param_groups]
        before = [dict(group) for group in self.param_groups]
        super().load_state_dict({**state_dict, "state": plain_state})
        for group, precision, own in zip(self.param_groups, precisions, before):
            for key, value in own.items():  # a key the saved group lacks (torch.optim.Muon's: use_muon) keeps ours
                group.setdefault(key, value)
            self.group_rule(group).normalize_group(group)  # e.g. torch may save tensor betas: the tables hold floats
            group["state_precision"] = precision  # this optimizer's, whatever the saved one: moments are converted
        formats = {
            id(p): state_format.format_for(group["state_precision"], p.numel())  # the whole param's: mesh-free
            for group in self.param_groups
            for p in group["params"]
        }
        for param_id, taken in moments.items():
            param = id_to_param[param_id]
            state = self.state[param]
            for key, value in taken.items():  # as saved: fp32, bf16, or 8-bit codes and their fp32 scales
                dtype = torch.float32 if key == "master_param" else None
                state[key] = value.to(device=param.device, dtype=dtype, copy=True)
            # e.g. torch's fp32 moments quantised, or 8-bit codes of an older code format re-encoded
            sharded_state.convert(state, formats[id(param)], param, versions[param_id])
            if "step" in state:
                step = state["step"]
                state["step"] = (
                    (step if isinstance(step, torch.Tensor) else torch.tensor(float(step)))
                    .to(device=self.device, dtype=torch.float32, copy=True)
                    .reshape(())
                )
            if self.master_weights and param.dtype != torch.float32 and "master_param" not in state:
                state["master_param"] = param.detach().to(torch.float32).clone()
        _say_converted(sum(version != state_format.CODES_VERSION for version in versions.values()))
        if extra is not None:
            self._load_counters(extra)
        else:  # a torch.optim.AdamW state: continue the schedule from the steps already taken
            self._fstate.zero_()
            self._istate.zero_()
            self._istate[layout.I_LAST_SPIKE_STEP] = -1
            self.reset_max_zscore()
            steps = [float(s["step"]) for s in self.state.values() if "step" in s]
            self._istate[layout.I_APPLIED_STEPS] = int(max(steps, default=0.0))
        self._keep_matrix_state_dtypes()
        self._plan = None
        self._version.bump()
        self._show_loaded_lrs()

    def _keep_matrix_state_dtypes(self) -> None:
        """A matrix rule's loaded states in the dtypes its matrix.py keeps them in (FusedMuon's momentum buffers: the
        param's dtype, or bf16 in a bf16 group), whatever the loader made of them (torch's casts to the param's
        dtype; a state name an elementwise rule shares is converted to the group's format): a resumed run holds
        what an uninterrupted one does."""
        for group in self.param_groups:
            rule = self.group_rule(group)
            if rule.elementwise:
                continue
            interface = matrix_module(rule)
            for p in group["params"]:
                state = self.state.get(p)
                for key, fresh in interface.init_state(p, group).items() if state else ():
                    if key in state and state[key].dtype != fresh.dtype:
                        state[key] = state[key].to(fresh.dtype)

    def _upgrade_pickled_codes(self, version: int) -> None:
        """Unpickling: 8-bit codes pickled in an older code format (a pickle without the tag: v1) re-encoded in
        the current one, as load_state_dict does."""
        if version == state_format.CODES_VERSION:
            return
        converted = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if state_format.holds_codes(state):
                    sharded_state.convert(state, state_format.Q8, p, version)
                    converted += 1
        _say_converted(converted)

    def _show_loaded_lrs(self) -> None:
        """After a state dict or a pickle was loaded: the saved base lrs (`initial_lr`, which torch's LR
        schedulers also save, else `lr`) shown at the loaded count of applied updates."""
        if self.policy.schedule is None:
            return
        for group in self.param_groups:
            group["lr"] = group.get("initial_lr", group["lr"])
        self._shown_lrs = []
        self._show_lrs()

    def _load_counters(self, extra: dict) -> None:
        """The saved device counters. A state saved before the worst-step window existed (layout 1: the same
        slots, fewer of them) loads into the leading slots. The worst-step window starts over either way (its
        per-tensor norms are not saved)."""
        _check_counters(extra)
        fstate, istate = extra["fstate"], extra["istate"]
        self._fstate[: fstate.numel()].copy_(fstate)
        self._istate[: istate.numel()].copy_(istate)
        self._reset_worst_step()

    # pickling / copy.deepcopy: torch's Optimizer keeps only defaults, state and param_groups; keep our
    # settings and device counters too, and rebuild the caches (they hold addresses) on the way back
    _PICKLED = (
        "policy",
        "master_weights",
        "capturable",
        "device",
        "backend",
        "_fstate",
        "_istate",
        "_worst_sumsq",
        "_param_names",
    )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._PICKLED if hasattr(self, name)})
        state["_codes_version"] = state_format.CODES_VERSION  # of the 8-bit codes in `state`
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_version" not in self.__dict__:  # unpickling: a fresh object
            self._version = Version()
        super().__setstate__(state)
        self.state = ParamStates(self._version, self.state)
        self._upgrade_pickled_codes(self.__dict__.pop("_codes_version", state_format.CODES_V1))
        for group in self.param_groups:
            rule = self.group_rule(group)
            for key, value in rule.pickle_defaults.items():
                group.setdefault(key, value)
            group.setdefault("state_precision", "fp32")
        self.defaults.setdefault("state_precision", "fp32")
        if isinstance(self.__dict__.get("rules"), StepPolicy):  # pickled before the step's policy had this name
            self.policy = self.__dict__.pop("rules")
        if not hasattr(self, "policy"):  # pickled by an older version or by a plain Optimizer
            self.policy, self.master_weights, self.capturable = StepPolicy(), False, False
        if not hasattr(self, "device"):
            self.device = self._params_device()
            self.backend = ops.resolve_backend(None, self.device)
        if not hasattr(self, "_fstate"):
            self._fstate, self._istate = layout.new_counters(self.device)
        if getattr(self, "_worst_sumsq", None) is None:  # pickled by an older version: no worst-step window yet
            self._worst_sumsq = self._new_worst_sumsq()
            saved = {"fstate": self._fstate, "istate": self._istate}
            self._fstate, self._istate = layout.new_counters(self.device)
            self._load_counters(saved)
        self._param_names = getattr(self, "_param_names", None)
        self.step_buffers = self._new_step_buffers()
        self._plan = None
        self.last_tables = None
        self._hparams = (None, [])
        self._version.bump()
        self.norm_reducer = engines.norm_reducer_of(self)
        self._show_loaded_lrs()


def _take_moments(saved_state: dict, id_to_param: dict) -> tuple[dict, dict, dict]:
    """A saved state split for loading: (the moments, scales and master weights by param id, each param's code
    format of its 8-bit codes, the rest for torch's loader). The moments are kept out of torch's loader, which
    would cast them to the param dtype (fp32 moments of a bf16 param would lose bits, 8-bit scales too); they are
    converted to each group's state_precision afterwards. Checks each param's moments first (raises before
    anything changes)."""
    moments: dict[Any, dict[str, torch.Tensor]] = {}
    versions: dict[Any, int] = {}
    plain_state = {}
    taken_keys = _taken_keys()
    for param_id, entry in saved_state.items():
        param = id_to_param.get(param_id)
        if param is not None:
            taken = {k: v for k, v in entry.items() if k in taken_keys}
            _check_saved_moments(taken, param)
            moments[param_id] = taken
            holds_codes = state_format.holds_codes(entry)
            versions[param_id] = state_format.saved_codes_version(entry) if holds_codes else state_format.CODES_VERSION
        plain_state[param_id] = {k: v for k, v in entry.items() if k not in taken_keys and k != state_format.CODES_KEY}
    return moments, versions, plain_state


def _say_converted(params: int) -> None:
    """The one line a load that converted old 8-bit codes says."""
    if params:
        warnings.warn(
            f"fused_stable: the optimizer state held 8-bit codes of {params} params in code format v1 (saved before "
            f"v{state_format.CODES_VERSION}); converted once: decoded as v1 decodes them, encoded in "
            f"v{state_format.CODES_VERSION} (save it again to skip this)",
            UserWarning,
            stacklevel=3,
        )


def _check_saved_moments(taken: dict, param: torch.Tensor) -> None:
    """A saved moment (or its codes) has its param's shape; 8-bit scales one value per block: else the state dict
    belongs to another model (refused before anything changes)."""
    for key, value in taken.items():
        # a DTensor's scales cover the whole param's blocks, a shard's its own
        if key.endswith(state_format.SCALE_SUFFIX):
            blocks = state_format.num_blocks((param if is_dtensor(value) else local(param)).numel())
            if value.dim() != 1 or value.numel() != blocks or value.dtype != torch.float32:
                raise ValueError(
                    f"state {key!r} holds {value.numel()} {value.dtype} values, but its parameter of shape "
                    f"{tuple(param.shape)} has {blocks} blocks of {state_format.QUANT_BLOCK} (one fp32 scale each): "
                    "this state dict belongs to another model"
                )
        elif tuple(value.shape) != tuple(local(param).shape) and tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"state {key!r} has shape {tuple(value.shape)} but its parameter has shape "
                f"{tuple(param.shape)}: this state dict belongs to another model"
            )
        elif key in state_format.state_keys() and not _loadable_moment(key, value, taken):
            raise ValueError(
                f"state {key!r} is {value.dtype}: a saved moment is floating point (converted to the group's "
                f"state_precision), or 8-bit codes ({state_format.moment_dtype(key, state_format.Q8)}) with "
                f"{key + state_format.SCALE_SUFFIX!r} beside them"
            )


def _loadable_moment(key: str, value: torch.Tensor, taken: dict) -> bool:
    if value.is_floating_point():
        return True
    return value.dtype == state_format.moment_dtype(key, state_format.Q8) and key + state_format.SCALE_SUFFIX in taken


def _check_counters(extra: dict) -> None:
    fstate, istate = extra["fstate"], extra["istate"]
    if fstate.numel() > layout.F_SIZE or istate.numel() > layout.I_SIZE:
        raise ValueError(
            f"this optimizer state was saved by a newer fused_stable (counter layout {extra.get('layout')}, this one "
            f"reads up to {_LAYOUT_VERSION}): upgrade fused_stable to load it"
        )
