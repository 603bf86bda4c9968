"""The update rules: what makes each optimizer's update its own, one folder per rule, around one rule-free step.

The step's machinery (norm pass, decision kernel, skip, clip, schedule, chunking, master weights, state codecs)
knows no rule; a rule brings its hyper-parameter row, its state names (and torch's state-dict keys), and its
per-element math in each language the step runs in, side by side in its folder:

  <rule>/__init__.py  what the machinery reads (checked by `check_rule` below):
      NAME, TITLE (as messages spell it), STATE_NAMES (the states every param keeps, in the order the element
      takes them), OPTION and OPTIONAL_STATE (a group key whose True adds one more state, e.g. AdamW's amsgrad;
      None for none),
      `state_names(option)`, CODECS (each state's 8-bit codec kind, state_format.SIGNED / UNSIGNED),
      STOCHASTIC_BF16 (the states a bf16 store rounds stochastically), TORCH_STATE_KEYS, ROW_LAYOUT,
      HParams (a group's hyper-parameters, lr first), `group_hparams(group)` and `hparam_row(*hparams)`,
      `check_group(group, defaults)` and `normalize_group(group)` (for each added group), PICKLE_DEFAULTS.
  <rule>/triton.py    `step_scalars` and `element`, which the update kernel takes as arguments (kernels/update.py)
  <rule>/torch.py     the same two on fp32 tensors, for the torch backend's exact reference; and DOORS, the
                      rule's own faster doors of the torch backend, if any (backends/torch/updates.py)
  <rule>/cpu.h        (optional) the same two in C++, for a compiled CPU op

`RULES` is the registry of the update kernel's rules, by the name the optimizers take, filled from the folders
found here: a new rule is a new folder. muon/ is not one (`ELEMENTWISE = False`): Newton-Schulz needs whole
matrices, so FusedMuon (fused_stable/muon.py) runs it after the fused step, on the step's decisions.
Importing this package imports neither triton nor the language files (the kernels and backends import those
where they run).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

_REQUIRED = (
    "NAME",
    "TITLE",
    "STATE_NAMES",
    "OPTION",
    "OPTIONAL_STATE",
    "CODECS",
    "STOCHASTIC_BF16",
    "TORCH_STATE_KEYS",
    "ROW_LAYOUT",
    "HParams",
    "state_names",
    "group_hparams",
    "hparam_row",
    "check_group",
    "normalize_group",
    "PICKLE_DEFAULTS",
)


def check_rule(rule: ModuleType) -> ModuleType:
    """A rule package that declares everything the step reads, with a codec for each of its states."""
    missing = [name for name in _REQUIRED if not hasattr(rule, name)]
    if missing:
        raise TypeError(f"update rule {rule.__name__} lacks {missing} (fused_stable/rules/__init__.py lists them)")
    every_state = rule.state_names(True) if rule.OPTION else rule.state_names(False)
    if set(every_state) - set(rule.CODECS):
        raise TypeError(f"update rule {rule.NAME!r}: no codec for {sorted(set(every_state) - set(rule.CODECS))}")
    return rule


def _discover() -> dict[str, ModuleType]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.ispkg:
            module = importlib.import_module(f"{__name__}.{info.name}")
            if getattr(module, "ELEMENTWISE", True):  # Muon's folder is not the update kernel's (it says so)
                rule = check_rule(module)
                found[rule.NAME] = rule
    return found


RULES: dict[str, ModuleType] = _discover()


def _codecs() -> dict[str, int]:
    """Every rule's state names -> codec kind; a name two rules share must be stored the same way (a state dict
    saved by one loads into the other)."""
    codecs: dict[str, int] = {}
    for rule in RULES.values():
        for name, codec in rule.CODECS.items():
            if codecs.setdefault(name, codec) != codec:
                raise TypeError(f"state {name!r} has two codecs across the update rules")
    return codecs


CODECS = _codecs()


def codec_of(name: str) -> int:
    """The 8-bit codec kind of a state of that name (state_format.SIGNED or UNSIGNED)."""
    try:
        return CODECS[name]
    except KeyError:
        raise KeyError(f"no update rule keeps a state named {name!r} (known: {sorted(CODECS)})") from None
