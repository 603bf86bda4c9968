"""What an update rule declares, once: its name, its states and its hyper-parameters. Everything the machinery
reads of a rule is derived from that one declaration (`Rule`): the states a param keeps for a group and their
codecs, torch's state-dict keys, the group defaults and checks, the rule's slots of the hyper-parameter row and
the row itself, the named tuple a step hands the backends.

A rule's `__init__.py` holds its algorithm as math (its docstring) and then `RULE = Rule(...)`; its per-element
math sits beside it (triton.py, torch.py, cpu.h). Plain Python: importing this imports no kernel or backend.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

from torch import Tensor

from ..layout import FIRST_RULE_SLOT, H_LR

# A state's 8-bit codec kind: SIGNED for a value of either sign (a momentum), UNSIGNED for a value >= 0 (a second
# moment). state_format.py stores codes by kind (int8 / uint8 and their maps).
SIGNED, UNSIGNED = 0, 1
# A state's bf16 rounding when stored in bf16: to nearest even, or stochastic (for an EMA that moves by less than
# half a bf16 ulp per step, which nearest rounding would freeze)
NEAREST, STOCHASTIC = "nearest", "stochastic"


def param_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of a state kept elementwise: the param's own."""
    return tuple(shape)


@dataclass(frozen=True)
class State:
    """One per-param state tensor of a rule."""

    name: str  # the key in opt.state[p], and in the element's order among the rule's states
    codec: int  # 8-bit codec kind: SIGNED or UNSIGNED
    bf16: str = NEAREST  # bf16 rounding: NEAREST or STOCHASTIC
    torch_key: str | None = None  # torch's state-dict key, when it differs from `name`
    # from the param's shape (factored states); None: the state does not apply to a param of that shape (Adafactor
    # keeps row_var / col_var for a >= 2-D param, variance below), and is not created for it
    shape: Callable[[Sequence[int]], tuple[int, ...] | None] = param_shape
    option: str | None = None  # the group key whose truth adds this state (AdamW's amsgrad); None: always kept

    @property
    def key(self) -> str:
        return self.torch_key or self.name


@dataclass(frozen=True)
class HParam:
    """One hyper-parameter: a param-group key with its default, the torch keyword it answers to, and its check
    (raises ValueError with torch's words) and normalisation (e.g. tensor betas as floats) for a given value."""

    name: str
    default: Any
    check: Callable[[Any], None] | None = None
    normalize: Callable[[Any], Any] | None = None
    torch_keyword: str | None = None  # when torch's optimizer spells it otherwise

    @property
    def keyword(self) -> str:
        return self.torch_keyword or self.name


@dataclass(frozen=True)
class Rule:
    """An update rule's one declaration (see the module doc). `row` names the rule's slots of the fp32
    hyper-parameter row, in order, and `fill_row` computes them (in float64 on the host) from the group values
    named by `row_inputs`; the slots are numbered from layout.FIRST_RULE_SLOT, so a rule with more of them changes
    no machinery file (rules.H_SIZE sizes the table from every rule)."""

    name: str
    title: str
    package: str  # the rule's package (its triton.py / torch.py / cpu.h sit there)
    states: tuple[State, ...]
    hparams: tuple[HParam, ...]
    row: tuple[str, ...]
    row_inputs: tuple[str, ...]
    fill_row: Callable[..., Sequence[float]]
    check_across: Callable[[dict], None] | None = None  # a check between keys (the group's values, defaults filled)
    torch_keeps_step: bool = True  # whether torch's optimizer keeps a `step` per param (lion-pytorch does not)
    # the `step` a param's state loaded without one starts from (a rule that reads it: SGD's first buffer update)
    loaded_step: int = 0
    elementwise: bool = True  # False: a matrix rule (needs the whole param), stepped outside the update kernel
    _hparams_type: type = field(init=False, repr=False, compare=False)
    _slot_module: ModuleType = field(init=False, repr=False, compare=False)
    # read every step (plan.current_grads, optimizer.hparam_rows): derived once here, not per call
    _option: str | None = field(init=False, repr=False, compare=False)
    _row_values: Callable[[dict], tuple] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        options = {state.option for state in self.states} - {None}
        if len(options) > 1:
            raise TypeError(f"rule {self.name!r}: at most one group option may add states, got {sorted(options)}")
        names = [h.name for h in self.hparams]
        if names[:1] != ["lr"] or len(set(names)) != len(names):
            raise TypeError(f"rule {self.name!r}: hyper-parameters must start with lr and be unique, got {names}")
        if set(self.row_inputs) - set(names) or (options and next(iter(options)) not in names):
            raise TypeError(f"rule {self.name!r}: the row or an option reads an undeclared hyper-parameter")
        hparams_type = NamedTuple(f"{self.title}HParams", [("lr", Any)] + [(name, Any) for name in self.row_inputs])
        object.__setattr__(self, "_hparams_type", hparams_type)
        # the slots as a module of H_<NAME> ints: Triton's jit functions read a module's attributes (a dict's items
        # or another object's they do not), so triton.py and torch.py read the row as `SLOT.H_BETA2`
        slot_module = ModuleType(f"{self.package}.slots", f"{self.title}'s slots of the hyper-parameter row")
        for name in self.row:
            setattr(slot_module, "H_" + name.upper(), FIRST_RULE_SLOT + self.row.index(name))
        object.__setattr__(self, "_slot_module", slot_module)
        object.__setattr__(self, "_option", next((state.option for state in self.states if state.option), None))
        inputs = self.row_inputs
        getter = operator.itemgetter(*inputs) if inputs else (lambda group: ())
        object.__setattr__(self, "_row_values", getter if len(inputs) != 1 else (lambda group: (getter(group),)))

    # ---------------------------------------------------------------------------------------- states

    @property
    def option(self) -> str | None:
        """The group key whose truth adds a state (AdamW's amsgrad), or None."""
        return self._option

    def state_names(self, option: bool = False) -> tuple[str, ...]:
        """The states a param of a group with this option value keeps, in the element's order."""
        return tuple(state.name for state in self.states if state.option is None or option)

    def group_option(self, group: dict) -> bool:
        return bool(group[self.option]) if self.option is not None else False

    @property
    def codecs(self) -> dict[str, int]:
        return {state.name: state.codec for state in self.states}

    @property
    def stochastic_bf16(self) -> frozenset[str]:
        return frozenset(state.name for state in self.states if state.bf16 == STOCHASTIC)

    def slot_codes(self, option: bool = False) -> tuple[int, int]:
        """The states' codes per slot in the element's order, one bit each: (the slots with the SIGNED 8-bit
        codec, the slots stored in bf16 with stochastic rounding); the compiled CPU update's SlotCodes."""
        states = [state for state in self.states if state.option is None or option]
        signed = sum(1 << slot for slot, state in enumerate(states) if state.codec == SIGNED)
        return signed, sum(1 << slot for slot, state in enumerate(states) if state.bf16 == STOCHASTIC)

    @property
    def torch_state_keys(self) -> tuple[str, ...]:
        """What torch's optimizer keeps per param (`step` first where it keeps one)."""
        return ("step",) * self.torch_keeps_step + tuple(state.key for state in self.states)

    # ---------------------------------------------------------------------------------------- hyper-parameters

    def defaults(self, **given: Any) -> dict[str, Any]:
        """The param-group defaults: each declared hyper-parameter at its default unless given, checked and
        normalised; a keyword the rule does not declare is refused."""
        unknown = set(given) - {h.name for h in self.hparams}
        if unknown:
            raise TypeError(f"{self.title} takes no hyper-parameter {sorted(unknown)}")
        values = {h.name: given.get(h.name, h.default) for h in self.hparams}
        self.check_group(values, values)
        self.normalize_group(values)
        return values

    def check_group(self, group: dict, defaults: dict) -> None:
        """A param group's hyper-parameters (those it sets; the rest are the defaults, checked once)."""
        for h in self.hparams:
            if h.check is not None and h.name in group:
                h.check(group[h.name])
        if self.check_across is not None:
            self.check_across({**defaults, **group})

    def normalize_group(self, group: dict) -> None:
        """The group's values as the step's tables hold them (e.g. tensor betas as floats), in place."""
        for h in self.hparams:
            if h.normalize is not None and h.name in group:
                group[h.name] = h.normalize(group[h.name])

    @property
    def pickle_defaults(self) -> dict[str, Any]:
        """What a group pickled by an older version (or by torch's optimizer) may lack: the declared defaults."""
        return {h.name: h.default for h in self.hparams if h.name != "lr"}

    # ---------------------------------------------------------------------------------------- the row

    @property
    def HParams(self) -> type:  # noqa: N802 (a class: the group's values a step hands the backends, lr first)
        return self._hparams_type

    def group_hparams(self, group: dict) -> tuple:
        """A group's values after the lr, in HParams' order."""
        return self._row_values(group)

    def slot(self, name: str) -> int:
        """The row index of the rule's slot `name`."""
        return FIRST_RULE_SLOT + self.row.index(name)

    @property
    def slots(self) -> ModuleType:
        """The rule's slots as module attributes, `H_<NAME>` = its row index (what triton.py and torch.py read the
        row with)."""
        return self._slot_module

    @property
    def row_end(self) -> int:
        return FIRST_RULE_SLOT + len(self.row)

    @property
    def row_layout(self) -> str:
        """The rule's slots as one string, for the update kernel's cache key (a slot that moves recompiles)."""
        return ";".join(f"{name}={self.slot(name)}" for name in self.row)

    def hparam_row(self, lr, *values, size: int | None = None) -> list[float]:
        """One group's row of the hyper-parameter table as every backend computes with it (fp32 on the device):
        the lr (0.0 for a tensor lr, copied in on the device) and the rule's slots."""
        row = [0.0] * (size or self.row_end)
        row[H_LR] = 0.0 if isinstance(lr, Tensor) else float(lr)
        filled = self.fill_row(*values)
        if len(filled) != len(self.row):
            raise TypeError(f"rule {self.name!r}: fill_row gave {len(filled)} values for {len(self.row)} slots")
        row[FIRST_RULE_SLOT : self.row_end] = [float(v) for v in filled]
        return row


# ------------------------------------------------------------------------------------------------ checks
# Shared by the rules' declarations; each raises ValueError in torch's words.


def learning_rate(lr) -> None:
    """A float or a 1-element tensor, >= 0."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        value = float(lr.detach().reshape(()).cpu())
    else:
        value = float(lr)
    if not value >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")


def at_least_zero(what: str, finite: bool = False) -> Callable[[Any], None]:
    """A number >= 0 (and finite, where asked): `Invalid {what} value: ...` as torch says it."""

    def check(value) -> None:
        if not value >= 0.0 or (finite and not math.isfinite(value)):
            bound = "a finite number >= 0" if finite else ">= 0"
            raise ValueError(f"Invalid {what} value: {value} (must be {bound})")

    return check


def float_pair(betas) -> tuple[float, float]:
    """Tensor betas (torch accepts 1-element ones) as floats: the step's tables hold floats."""
    return tuple(float(b.detach().reshape(())) if isinstance(b, Tensor) else b for b in betas)


def beta_pair(closed: bool, meaning: str = "") -> Callable[[Any], None]:
    """Two betas, both floats or both 1-element tensors, each in [0, 1) (or [0, 1] when `closed`)."""

    def check(betas) -> None:
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair{meaning}, got {betas}")
        if isinstance(betas[0], Tensor) != isinstance(betas[1], Tensor):
            raise ValueError("betas must be either both floats or both Tensors")  # torch's words
        for index, beta in enumerate(betas):
            if isinstance(beta, Tensor) and beta.numel() != 1:
                raise ValueError(f"Tensor betas[{index}] must be 1-element")
        for index, beta in enumerate(float_pair(betas)):
            if not (0.0 <= beta < 1.0 or (closed and beta == 1.0)):
                raise ValueError(
                    f"Invalid beta parameter at index {index}: {beta} (must be in [0, 1{']' if closed else ')'})"
                )

    return check
