"""Engines that call FusedAdamW.step() on pieces of the model (DeepSpeed ZeRO), and the refusal outside the
integration that makes that right.

DeepSpeed's ZeRO 1-3 hand the client optimizer one flat fp32 partition per param group and rank (ZeRO-3: per
sub-group) and call step() once per group, with `param_groups` swapped to that group. Each call then sees one
rank's partition of one group: a clip or a spike rule would act on that partition's norm, an inf on one rank
would skip there and be applied on the others, and the counters and the lr schedule would advance once per call.
FusedAdamW with any of those settings (max_grad_norm, clip="zscore", spike_skip_threshold, lr_schedule) therefore
refuses to step under DeepSpeed's ZeRO wrappers, unless fused_stable.integrations.deepspeed drives it: the
integration owns the engine's step (one global norm across ranks, groups and sub-groups, one decision per engine
step) and marks the optimizer with `DRIVEN_BY_ENGINE`.

The check runs when a step plan is built (the first step, and every call under ZeRO with several groups, since
each call swaps the groups), never on the per-step fast path. Without those settings FusedAdamW is an AdamW, and
DeepSpeed's own clip and overflow check are right under ZeRO (measured: issue 27), so it is left alone.
"""

from __future__ import annotations

import sys

from .layout import CLIP_ZSCORE, StepPolicy
from .sharding import norm_reducer

# set by `drive` on the optimizer an integration drives: the reducer of its sum of squares across ranks
DRIVEN_BY_ENGINE = "_fused_stable_engine_sumsq"
# set by `drive` where the engine cuts a matrix rule's params (DeepSpeed's flat partitions of FusedMuon's
# matrices): {rule name: build(params, states, groups)}, used instead of the rule's matrix.py `build`
ENGINE_MATRIX_BUILDS = "_fused_stable_engine_matrix_builds"
# the modules of DeepSpeed's optimizer wrappers that step the client optimizer on flat rank partitions
ZERO_WRAPPER_MODULES = ("deepspeed.runtime.zero.", "deepspeed.runtime.bf16_optimizer")
# frames looked at above step(): FusedAdamW.step -> _plain_step / hooks -> _fused_step -> build_step_plan, plus a
# GradScaler or a profiler wrapper between the wrapper and step()
_MAX_DEPTH = 16


def drive(optimizer, global_sumsq, matrix_builds: dict | None = None) -> None:
    """Marks `optimizer` as driven by an engine integration that calls step() once per engine step over the
    whole model, whose sum of squares `global_sumsq(local_per_tensor_sumsq, params)` turns into the global one.
    `matrix_builds` {rule name: build}: the engine's update of a matrix rule's groups, whose params it has cut
    (same signature and step as the rule's matrix.py `build`). Kept through everything that recomputes the
    reducer (add_param_group, load_state_dict, unpickling)."""
    optimizer.__dict__[DRIVEN_BY_ENGINE] = global_sumsq
    optimizer.__dict__[ENGINE_MATRIX_BUILDS] = dict(matrix_builds or {})
    optimizer.norm_reducer = global_sumsq


def matrix_builds_of(optimizer) -> dict:
    """The engine's builds of matrix-rule updates (`drive`), {} when none replaces the rules' own."""
    return optimizer.__dict__.get(ENGINE_MATRIX_BUILDS) or {}


def norm_reducer_of(optimizer):
    """The reducer of the optimizer's sum of squares: its engine's (`drive`), else the DTensor one or None."""
    return optimizer.__dict__.get(DRIVEN_BY_ENGINE) or norm_reducer(optimizer.param_groups)


def rules_in_use(policy: StepPolicy) -> list[str]:
    """The settings of `policy` that need the whole model's norm or one call per engine step."""
    used = []
    if policy.max_grad_norm is not None:
        used.append(f"max_grad_norm={policy.max_grad_norm}")
    if policy.clip_mode == CLIP_ZSCORE:
        used.append('clip="zscore"')
    if policy.spike_skip_threshold is not None:
        used.append(f"spike_skip_threshold={policy.spike_skip_threshold}")
    if policy.schedule is not None:
        used.append("lr_schedule")
    return used


def zero_wrapper_caller() -> str | None:
    """The module of the DeepSpeed ZeRO wrapper whose code called step(), or None."""
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        frame = frame.f_back
        if frame is None:
            return None
        name = frame.f_globals.get("__name__", "")
        if name.startswith(ZERO_WRAPPER_MODULES):
            return name
    return None


def refuse_partition_steps(optimizer) -> None:
    """Raises when DeepSpeed's ZeRO wrapper steps this optimizer itself while it has a rule that would act on one
    partition (see the module doc); called before a step plan is built, so nothing has changed."""
    if DRIVEN_BY_ENGINE in optimizer.__dict__:
        return
    used = rules_in_use(optimizer.policy)
    if not used:
        return
    caller = zero_wrapper_caller()
    if caller is None:
        return
    raise RuntimeError(
        f"FusedAdamW({', '.join(used)}) is being stepped by DeepSpeed's ZeRO optimizer ({caller}), which calls "
        "step() once per param group on this rank's partition: the clip, skip and schedule would use one "
        "partition's norm and advance once per group, silently wrong. Use fused_stable.integrations.deepspeed "
        "(initialize(...) or attach(engine)), which decides once per engine step from the global norm; or drop "
        "these options from FusedAdamW and let DeepSpeed clip (gradient_clipping) and schedule"
    )
