"""The update rules: what makes each optimizer's update its own, one folder per rule, around one rule-free step.

The step's machinery (norm pass, decision kernel, skip, clip, schedule, chunking, master weights, state codecs)
knows no rule. A rule is a folder:

  <rule>/__init__.py  the algorithm as math (its docstring), then ONE declaration, `RULE = Rule(...)`
                      (declaration.py): its name, its states (codec, bf16 rounding, torch's key, shape, the option
                      that adds one) and its hyper-parameters (default, check); the row slots, defaults, checks
                      and torch's keys the machinery reads are derived from it
  <rule>/triton.py    `step_scalars` and `element`, which the update kernel takes as arguments (kernels/update.py)
  <rule>/torch.py     the same two on fp32 tensors, for the torch backend's exact reference (and, as plain data,
                      TORCH_FUSED / FP32_STATE_SCALARS where torch's own kernel or other scalars apply: AdamW)
  <rule>/cpu.h        (optional) `Rule`: its Scalars and element in C++, the template argument of the one compiled
                      CPU update (backends/torch/cpu_update.h): the fast CPU path in every state format
  <rule>/matrix.py    (a matrix rule only, instead of the three above) its states and update over whole params

`RULES` is the registry of rules by the name the optimizers take, filled from the folders found here: a new rule
is a new folder. A matrix rule (`elementwise=False`: Muon's Newton-Schulz, Adafactor's factored moments need the
whole param) has `matrix.py` instead of the element files: the fused step calls it with its decisions
(fused_stable/matrix_step.py). `H_SIZE` sizes the hyper-parameter table from every rule's row. Importing this
package imports neither triton nor the language files (the kernels and backends import those where they run).
"""

from __future__ import annotations

import importlib
import pkgutil

from ..layout import FIRST_RULE_SLOT
from .declaration import Rule


def _discover() -> dict[str, Rule]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if not info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        rule = getattr(module, "RULE", None)
        if not isinstance(rule, Rule) or rule.package != module.__name__:
            raise TypeError(f"{module.__name__}.RULE must be a rules.declaration.Rule with package=__name__")
        found[rule.name] = rule
    return found


RULES: dict[str, Rule] = _discover()
ELEMENTWISE = {name: rule for name, rule in RULES.items() if rule.elementwise}  # the update kernel's rules

# the hyper-parameter table's width: the step's slots, then the widest rule's (layout.FIRST_RULE_SLOT)
H_SIZE = max([FIRST_RULE_SLOT, *(rule.row_end for rule in RULES.values())])


def _codecs() -> dict[str, int]:
    """Every elementwise rule's state names -> codec kind (the states state_format.py stores in each format; a
    matrix rule keeps its own); a name two rules share must be stored the same way (a state dict saved by one loads
    into the other)."""
    codecs: dict[str, int] = {}
    for rule in ELEMENTWISE.values():
        for name, codec in rule.codecs.items():
            if codecs.setdefault(name, codec) != codec:
                raise TypeError(f"state {name!r} has two codecs across the update rules")
    return codecs


CODECS = _codecs()


def codec_of(name: str) -> int:
    """The 8-bit codec kind of a state of that name (declaration.SIGNED or UNSIGNED)."""
    try:
        return CODECS[name]
    except KeyError:
        raise KeyError(f"no update rule keeps a state named {name!r} (known: {sorted(CODECS)})") from None
