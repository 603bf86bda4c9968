"""The groups whose rule needs whole params (a matrix rule: `Rule.elementwise` False, e.g. Muon's Newton-Schulz),
stepped right after the fused step from its decisions.

Their grads take part in the norm pass and the decision kernel like every other group's (one global norm, one clip
coefficient, one skip, the schedule, their `step` counters); the update pass leaves them alone (the plan gives
them no kernel rule). Then each matrix rule's `build(...)` update (rules/<rule>/matrix.py) steps them with the
decisions as 0-dim device tensors: the clip multiplier (before the rule's momentum), the skip flag and the lr
factor. No host read; a skipped step leaves every param and state bit-identical. Rule-free: the rule's states,
update and state bytes are its matrix.py's. Under FSDP2 the params are DTensors and their grads too: a rule whose
matrix.py says `ROW_SHARDS = True` (Muon) brings each whole matrix to an owner rank itself (matrix_exchange.py);
any other matrix rule is refused there by FusedOptimizer.check_group. An engine that cuts the params otherwise
(DeepSpeed's flat partitions) brings its own update through engines.drive.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

import torch

from . import layout


def matrix_module(rule) -> ModuleType:
    """A matrix rule's interface (its package's matrix.py)."""
    return import_module(rule.package + ".matrix")


class MatrixSteps:
    """One plan's matrix-rule params, their states and the rules' updates, built for the groups' hyper-parameters
    of `key` (base lrs: the schedule's factor comes from the decisions); built anew when either changes (no tensor
    work but the states a param does not have yet). `compiled_ops`: the backend runs the compiled CPU ops
    (ops.compiled_cpu_ops), given to every rule's build (Adafactor's takes its own op then: cpu_matrix.cpp)."""

    def __init__(
        self,
        plan,
        key: tuple,
        param_groups: list[dict],
        rules: list,
        state,
        base_lrs: list,
        builds: dict | None = None,
        compiled_ops: bool = False,
    ) -> None:
        self.plan, self.key = plan, key
        by_rule: dict[str, list[int]] = {}
        for index, group in enumerate(plan.groups):
            rule = rules[group]
            if rule is not None and not rule.elementwise:
                by_rule.setdefault(rule.name, []).append(index)
        self.updates = []
        for members in by_rule.values():
            interface = matrix_module(rules[plan.groups[members[0]]])
            params = [plan.params[i] for i in members]
            groups = [{**param_groups[plan.groups[i]], "lr": base_lrs[plan.groups[i]]} for i in members]
            states = []
            for p, group in zip(params, groups):
                missing = {k: v for k, v in interface.init_state(p, group).items() if k not in state[p]}
                if missing:
                    state[p].update(missing)
                states.append(state[p])
            build = (builds or {}).get(rules[plan.groups[members[0]]].name)  # engines.drive's
            if build is not None:
                update = build(params, states, groups)
            else:
                update = interface.build(params, states, groups, compiled_ops=compiled_ops)
            self.updates.append((members, params, update))

    def step(self, fstate: torch.Tensor, grads: list[torch.Tensor] | None = None) -> None:
        """One step of every matrix rule, from the decisions in the step's fp32 buffer; `grads` in plan order (a
        compiled step's graph inputs), else each param's `.grad`."""
        grad_mul, skip, lr_factor = fstate[layout.F_GRAD_MUL], fstate[layout.F_SKIP], fstate[layout.F_LR_FACTOR]
        for members, params, update in self.updates:
            given = [p.grad for p in params] if grads is None else [grads[i] for i in members]
            update.step(given, grad_mul, skip, lr_factor)

    def states(self, state) -> list[tuple[int, dict]]:
        """(plan index, the param's state) of every matrix-rule param, in plan order."""
        return [(i, state[p]) for members, params, _ in self.updates for i, p in zip(members, params)]


def hyperparameter_key(param_groups: list[dict], rules: list, base_lrs: list) -> tuple:
    """The matrix groups' hyper-parameters (their rule's declared keys, the base lr first): a MatrixSteps holds
    while this stays equal."""
    return tuple(
        (index, base_lrs[index], *(group[h.name] for h in rule.hparams if h.name != "lr"))
        for index, (group, rule) in enumerate(zip(param_groups, rules))
        if rule is not None and not rule.elementwise
    )
