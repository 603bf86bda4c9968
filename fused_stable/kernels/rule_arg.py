"""The update kernel's one constexpr argument `RULE` (kernels/update.py), built from a rule's declaration and its
jit functions (rules/<rule>/triton.py): a tuple read by index inside the jit functions (a constexpr tuple cannot
be unpacked there):

  0 step_scalars, 1 element (rules/<rule>/triton.py), 2 the group option (AdamW's amsgrad), 3 the number of states,
  4 each slot's codec is signed (a tuple of MAX_STATES bools), 5 each slot rounds stochastically in bf16 (the same),
  6 the rule's row_layout and 7 its jit functions' source hash: Triton's cache key holds a constexpr function by its
  name only, so these make a changed rule recompile instead of reading a stale cached binary.
"""

from __future__ import annotations

from importlib import import_module

# A rule keeps up to MAX_STATES state tensors per param (AdamW: exp_avg, exp_avg_sq and amsgrad's max_exp_avg_sq;
# Lion: exp_avg): the kernel has that many state slots, of which a launch uses the first RULE[3].
MAX_STATES = 3


def rule_constexpr(rule, option: bool) -> tuple:
    """The update kernel's `RULE` argument for a rule (a rules/<rule> package, with a `triton.py` beside it) and a
    group option (`rule.option`'s value, e.g. AdamW's amsgrad)."""
    jit = import_module(rule.package + ".triton")
    names = rule.state_names(option)
    if len(names) > MAX_STATES:
        raise ValueError(f"rule {rule.name!r} keeps {len(names)} states; the update kernel has {MAX_STATES} slots")
    signed_bits, stochastic_bits = rule.slot_codes(option)  # one bit per slot
    slots = [k if k < len(names) else 0 for k in range(MAX_STATES)]  # unused slots: slot 0's settings, never read
    signed = tuple(not names or bool(signed_bits >> k & 1) for k in slots)  # (a rule keeping no state: signed)
    stochastic = tuple(bool(stochastic_bits >> k & 1) for k in slots)
    source = source_key(jit.step_scalars) + source_key(jit.element)
    return (jit.step_scalars, jit.element, bool(option), len(names), signed, stochastic, rule.row_layout, source)


def source_key(fn) -> str:
    """A jit function's hash of its source and its callees' (Triton's `cache_key`); "" under the interpreter, which
    compiles nothing and keeps no cache."""
    return getattr(fn, "cache_key", "")
