"""FusedOptimizer: global-norm clipping, inf/NaN skipping and a rule's update in one fused, sync-free step.

The optimizer owns param groups, per-param state and a few device scalars. A step goes
optimizer -> plan (plan.py: the params, states and grads flattened once, rebuilt only when they change)
-> backend (ops.fused_step: Triton kernels on CUDA, torch's multi-tensor ops on CPU) -> kernels. What it
decides and reads back lives beside it: the step policy and buffer slots in layout.py, the read-outs in readouts.py,
the state dict and pickling in state_dict.py, sharded params in sharding.py. Semantics
equal `torch.nn.utils.clip_grad_norm_(params, max_grad_norm)` followed by `torch.optim.AdamW.step()`, except
that a step whose gradients are not finite is skipped whole, and that nothing in step() reads the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from . import compiled, engines, layout, ops, state_format
from .kernels.tables import check_not_capturing  # plain torch: does not import triton
from .layout import StepBuffers, StepPolicy, check_not_differentiable
from .matrix_exchange import check_row_shards
from .matrix_step import MatrixSteps, hyperparameter_key, matrix_module
from .param_state import ParamStates, Version
from .plan import StepPlan, build_plan
from .readouts import ReadOuts
from .rules import H_SIZE
from .schedules import Schedule
from .sharding import is_dtensor, local, validate_params
from .shown_lrs import ShownLrs
from .state_dict import SavedState

# False outside dynamo's tracing (a constant there); bound once, as the check runs in every eager step
_is_compiling = torch.compiler.is_compiling


class FusedOptimizer(ReadOuts, SavedState, ShownLrs, Optimizer):
    """The fused step around one update rule (`RULE`, a fused_stable/rules declaration): param groups, state, the
    device buffers, the plan, the read-outs and the state dict. A subclass names its rule and takes its rule's
    keywords with torch's defaults (FusedAdamW, FusedLion); `step_options` are the step-wide ones every rule
    shares (max_grad_norm, clip, the spike policy, lr_schedule, master_weights, state_precision, capturable,
    backend), documented on FusedAdamW."""

    RULE: Any = None  # the subclass's rule
    # GradScaler hands us `grad_scale` and `found_inf` instead of running its own unscale pass
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        capturable: bool = False,
        max_grad_norm: float | None = None,
        lr_schedule: Schedule | None = None,
        master_weights: bool = False,
        state_precision: str = "fp32",
        clip: str = "fixed",
        zscore_alpha: float = 0.97,
        zscore_threshold: float = 2.5,
        zscore_warmup: int = 25,
        spike_skip_threshold: float | None = None,
        spike_skip_ratio: float = 0.0,
        backend: str | None = None,
    ) -> None:
        defaults["state_precision"] = state_format.check_precision(state_precision)
        policy = StepPolicy(  # checks itself, before anything is built
            max_grad_norm=max_grad_norm,
            clip=clip,
            zscore_alpha=zscore_alpha,
            zscore_threshold=zscore_threshold,
            zscore_warmup=zscore_warmup,
            spike_skip_threshold=spike_skip_threshold,
            spike_skip_ratio=spike_skip_ratio,
            schedule=lr_schedule,
        )
        self._version = Version()  # bumped by whatever invalidates a cached plan (see plan.py)
        super().__init__(params, defaults)
        self.state = ParamStates(self._version, self.state)
        self.policy, self.master_weights, self.capturable = policy, bool(master_weights), bool(capturable)
        self._check_params(self.param_groups)
        self.device = self._params_device()
        self.backend = ops.resolve_backend(backend, self.device)
        self.norm_reducer = engines.norm_reducer_of(self)  # DTensor params: the all-reduce of the norm
        self._fstate, self._istate = layout.new_counters(self.device)
        self._worst_sumsq = self._new_worst_sumsq()
        self.reset_max_zscore()
        self.step_buffers = self._new_step_buffers()
        self._plan: StepPlan | None = None
        self.last_tables = None  # the backend tables of the latest step: per-tensor norms
        self._param_names: list[str] | None = None
        self._shown_lrs: list[torch.Tensor] = []
        self._hparams: tuple[list | None, list] = (None, [])  # hparam_rows' last (key, rows)
        self._show_lrs()

    # ------------------------------------------------------------------------------------------
    # the step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One fused step (see the class doc); `closure` re-evaluates the model and returns the loss."""
        if _is_compiling():  # dynamo is tracing this call: the custom-op route (compiled.py)
            return self._traced_step(closure)
        if (
            self._optimizer_step_pre_hooks
            or self._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks
            or _global_optimizer_post_hooks
            or torch._C._autograd._profiler_enabled()
        ):
            return self._hooked_step(closure)
        return self._plain_step(closure)

    def _patch_step_function(self) -> None:
        # torch.optim.Optimizer wraps every step() in profile_hook_step: the step hooks inside a profiler range
        # (record_function), whose Python costs about 10 us per step whether a profiler runs or not. step()
        # above takes that same wrapper (`_hooked_step`) only when a hook is registered or a profiler records.
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{self.__class__.__name__}.zero_grad"

    def _plain_step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # what @torch.no_grad() does, without its per-call context-manager objects (this is host time per step)
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            self._fused_step()
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        return loss

    _hooked_step = Optimizer.profile_hook_step(_plain_step)

    def _traced_plain_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """What dynamo traces for step(): the plan is built at trace time (`_init_group`), the step is one op."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        lrs: list[torch.Tensor] = []
        key = self._init_group(tensors, grads, lrs)
        if key >= 0:
            with torch.no_grad():
                torch.ops.fused_stable.fused_step(
                    key, tensors, grads, lrs, getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
                )
        return loss

    def _traced_step(self, *args: Any, **kwargs: Any) -> Any:
        """profile_hook_step's hooks without its profiler range (dynamo ignores record_function, with a warning)."""
        for pre_hook in chain(_global_optimizer_pre_hooks.values(), self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, (self, *args), kwargs)
            if result is not None:
                (_, *args), kwargs = result
        out = self._traced_plain_step(*args, **kwargs)
        self._optimizer_step_code()
        for post_hook in chain(self._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
            post_hook(self, (self, *args), kwargs)
        return out

    def _init_group(self, tensors: list, grads: list, lrs: list) -> int:
        """Trace time only: dynamo runs a method of this name eagerly and makes the tensors it appends graph
        inputs (compiled.prepare says what goes into each list)."""
        rules = [self.group_rule(group) for group in self.param_groups]
        if any(not r.elementwise and not getattr(matrix_module(r), "COMPILED_STEP", False) for r in rules):
            raise RuntimeError(
                f"{type(self).__name__}'s step does not run inside torch.compile yet (its groups of a matrix rule "
                "are updated after the fused op): call opt.step() outside the compiled function"
            )
        return compiled.prepare(self, tensors, grads, lrs)

    def _fused_step(self) -> None:
        plan = self._plan
        grads = None
        if plan is not None and plan.version == self._version.value and type(self.state) is ParamStates:
            grads = plan.current_grads(self.param_groups)  # the per-step check: a few C-level passes
        if grads is None:
            plan, grads = self.build_step_plan()
            if plan is None:
                return
        attrs = self.__dict__  # GradScaler sets these two for the duration of its step() call
        ops.fused_step(
            self.backend,
            plan,
            grads,
            self.step_buffers,
            self.policy,
            self.hparam_rows(),
            grad_scale=attrs.get("grad_scale"),
            found_inf=attrs.get("found_inf"),
            global_sumsq=self.norm_reducer,
        )
        self.last_tables = plan.backend_cache
        if not plan.all_updated:  # groups of a matrix rule: stepped from the same decisions (matrix_step.py)
            self.matrix_steps(plan).step(self._fstate)

    def matrix_steps(self, plan: StepPlan, state=None, cached: MatrixSteps | None = None) -> MatrixSteps:
        """The plan's matrix-rule updates for the groups' current hyper-parameters, built anew when either changed
        (`cached`: the latest, default this optimizer's); `state`: the params' states (default opt.state; a compiled
        step's: its graph's tensors)."""
        rules = [self.group_rule(group) for group in self.param_groups]
        base_lrs = self.base_lrs()
        key = hyperparameter_key(self.param_groups, rules, base_lrs)
        own = state is None
        if own:
            cached = self.__dict__.get("_matrix")  # (absent after unpickling: built again)
        if cached is None or cached.plan is not plan or cached.key != key:
            builds = engines.matrix_builds_of(self)  # an engine's own, where it cut the params (DeepSpeed)
            cached = MatrixSteps(
                plan,
                key,
                self.param_groups,
                rules,
                self.state if own else state,
                base_lrs,
                builds,
                compiled_ops=ops.compiled_cpu_ops(self.backend),
            )
            if own:
                self._matrix = cached
        return cached

    # ------------------------------------------------------------------------------------------
    # the package-internal surface: what compiled.py, engines.py, the integrations and the benchmark use of the
    # optimizer (not user API): hparam_rows(), build_step_plan(), step_buffers, last_tables, norm_reducer,
    # invalidate_plan(), matrix_steps(), device_schedule_only (set by the HF integration). No module but optim.py
    # and its mixins reads a private member (tests/core/test_package_layout.py)

    def invalidate_plan(self) -> None:
        """The params were replaced behind the optimizer's back (DeepSpeed's flat partitions): the next step builds
        a new plan."""
        self._version.bump()

    def group_rule(self, group: dict):
        """The rule (a rules/ declaration) that updates a group's params: RULE. An elementwise rule's groups are
        updated in the fused step's update pass; a matrix rule's (`elementwise` False: FusedMuon's Muon groups) are
        only measured and decided for there, then updated from the same decisions (matrix_step.py)."""
        return self.RULE

    def check_group(self, group: dict) -> None:
        """A group's hyper-parameters, checked by its rule before the group is added (nothing changes on an
        error); a matrix rule also checks the params and the state precision it can hold."""
        rule = self.group_rule(group)
        rule.check_group(group, self.defaults)
        if not rule.elementwise:
            interface = matrix_module(rule)
            if any(is_dtensor(p) for p in group["params"]):
                # a matrix rule steps whole params: under FSDP2 only one that brings row shards together can
                if not getattr(interface, "ROW_SHARDS", False):
                    raise ValueError(
                        f"{type(self).__name__}'s {rule.title} groups do not run under FSDP2 yet: {rule.title} "
                        "updates whole params (a matrix rule) and a DTensor param holds a shard; give these params "
                        "an elementwise rule (FusedAdamW, FusedLion, FusedSGD) under FSDP2"
                    )
                check_row_shards(group["params"], rule.title)
            precision = group.get("state_precision", self.defaults.get("state_precision", "fp32"))
            interface.check_group(group, precision)

    def hparam_rows(self) -> list:
        """Every param group's hyper-parameters, as the backends take them: with an lr schedule the lr is the
        group's base lr, `initial_lr`. The same list object while the values stay (a tensor lr by identity), so
        a backend needs one identity check per step, and no row is built per step. A row is the group rule's
        HParams: the lr, then the rule's own (rules/declaration.py: `group_hparams`; a matrix rule's: the lr
        alone)."""
        groups = self.param_groups
        rules = [self.group_rule(g) for g in groups]
        if self.policy.schedule is None:
            values = [(g["lr"], *r.group_hparams(g)) for g, r in zip(groups, rules)]
        else:
            if "step" in self.__dict__:  # step() wrapped from outside, as torch's LR schedulers do
                _refuse_a_torch_scheduler(self)
            shown = self._shown_lrs
            if len(shown) != len(groups) or any(g["lr"] is not view for g, view in zip(groups, shown)):
                self._show_lrs()  # an lr set from outside (group["lr"] = value): the group's new base lr
            values = [(g["initial_lr"], *r.group_hparams(g)) for g, r in zip(groups, rules)]
        # tensors by identity: comparing them by value would read the device (the cached rows keep them alive)
        key = [v if not isinstance(v[0], torch.Tensor) else (id(v[0]), *v[1:]) for v in values]
        cached_key, rows = self._hparams
        if key != cached_key:
            rows = [r.HParams(*v) for r, v in zip(rules, values)]
            self._hparams = (key, rows)
        return rows

    def build_step_plan(self) -> tuple[StepPlan | None, list[torch.Tensor] | None]:
        """The plan for the params that have a grad now (plan.build_plan), and those grads; (None, None) when
        none has one."""
        check_not_capturing(self.device, "a new step plan (the first step, or params, state or grads that changed)")
        engines.refuse_partition_steps(self)  # DeepSpeed ZeRO stepping one partition per call (engines.py)
        if type(self.state) is not ParamStates:  # replaced wholesale (e.g. by torch's __setstate__)
            self.state = ParamStates(self._version, self.state)
        count = sum(len(group["params"]) for group in self.param_groups)
        if count != self._worst_sumsq.numel() or len(self.param_groups) != self.step_buffers.hparams.shape[0]:
            self._renew_slots()  # params or groups added to param_groups in place, not through add_param_group
        self._plan, grads = build_plan(
            self.param_groups,
            self.state,
            self._version,
            group_rules=[kernel_rule(self.group_rule(group)) for group in self.param_groups],
            dense_layouts=ops.needs_dense_layouts(self.backend),
            master_weights=self.master_weights,
            device=self.device,
        )
        return self._plan, grads

    def _new_step_buffers(self) -> StepBuffers:
        hparams = torch.zeros(len(self.param_groups), H_SIZE, dtype=torch.float32, device=self.device)
        return StepBuffers(self._fstate, self._istate, hparams, self._worst_sumsq)

    def _renew_slots(self) -> None:
        """The buffers with a slot per param (the worst-step window) or per group (the hyper-parameter table) made
        anew for the current param_groups; the worst-step window starts over."""
        self._worst_sumsq = self._new_worst_sumsq()
        self.reset_max_zscore()
        self.step_buffers = self._new_step_buffers()
        self._show_lrs()

    def _new_worst_sumsq(self) -> torch.Tensor:
        count = sum(len(group["params"]) for group in self.param_groups)
        return torch.zeros(count, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------------------------------
    # param groups and validation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but the ordering of tensors in "
                "sets will change between runs. Please use a list instead."
            )  # torch's words
        listed = [params] if isinstance(params, torch.Tensor) else list(params)
        # (name, param) pairs, as torch accepts: torch's add_param_group below keeps the names in "param_names"
        params = [p[1] if isinstance(p, tuple) else p for p in listed]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in one param group; list every parameter once")
        self.check_group(param_group)
        check_not_differentiable(param_group.get("differentiable"), "a param group with differentiable=True")
        if "state_precision" in param_group:
            state_format.check_precision(param_group["state_precision"], "a param group's state_precision")
        constructed = hasattr(self, "step_buffers")
        if constructed:  # a group added later: check it against the others before anything changes
            self._check_params(self.param_groups + [{**param_group, "params": params}])
        param_group["params"] = listed
        self.group_rule(param_group).normalize_group(param_group)
        super().add_param_group(param_group)
        if constructed:
            self._renew_slots()
            self.norm_reducer = engines.norm_reducer_of(self)
            self._version.bump()

    def _check_params(self, groups: list[dict[str, Any]]) -> None:
        """Refuses what the fused step cannot update; called before a group is added, so nothing changes."""
        devices = set()
        for group in groups:
            for p in group["params"]:
                if p.is_complex():
                    raise TypeError(
                        f"{type(self).__name__} does not support complex parameters; optimize "
                        "torch.view_as_real(param) instead"
                    )
                if not p.is_floating_point() or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise TypeError(
                        f"{type(self).__name__} supports float32, bfloat16 and float16 parameters, got {p.dtype}"
                    )
                devices.add(local(p).device)
            validate_params(list(group["params"]))  # FSDP1 flat params, mixed meshes
        if len(devices) > 1:
            raise ValueError(
                f"all parameters of one {type(self).__name__} must be on one device, got {sorted(map(str, devices))}: "
                "create one optimizer per device"
            )
        device = devices.pop() if devices else None
        for group in groups:
            lr = group.get("lr", self.defaults["lr"])
            # a tensor lr is copied into the step's tables on the device: from another device that copy would sync
            if isinstance(lr, torch.Tensor) and device is not None and lr.device != device:
                raise ValueError(
                    f"a tensor lr must live on the parameters' device ({device}), got one on {lr.device}: "
                    f"create it with torch.tensor(value, device={str(device)!r})"
                )

    def _params_device(self) -> torch.device:
        return local(self.param_groups[0]["params"][0]).device


def kernel_rule(rule):
    """The rule the update pass runs for a group: its own when elementwise; None for a matrix rule's group (its
    params are measured and decided for, and updated from the decisions afterwards)."""
    return rule if rule is not None and rule.elementwise else None


def _refuse_a_torch_scheduler(opt: FusedOptimizer) -> None:
    """With `lr_schedule`, a torch LR scheduler's lr goes nowhere: it fills group["lr"], the shown-lr view that
    the next step overwrites (or, assigned as a number, becomes the base lr the device schedule multiplies: two
    schedules compounded), and the user is told nothing. torch's schedulers wrap the step of the optimizer they
    drive and mark the wrapper (`_wrapped_by_lr_sched`); the HF integration's DeviceScheduleLR writes no lr and
    marks the optimizer `device_schedule_only`. Raised before the step launches anything: nothing changes."""
    wrapped = getattr(opt.__dict__.get("step"), "_wrapped_by_lr_sched", False)
    if wrapped and not opt.__dict__.get("device_schedule_only", False):
        raise ValueError(
            f"a torch LR scheduler drives this {type(opt).__name__}, which already has lr_schedule= (run on the device "
            "inside step()): its lr would be overwritten or compounded. Drop the torch scheduler, or drop lr_schedule= "
            "and let the scheduler set group['lr'] (fused_stable.schedules has warm-up + cosine / linear / constant)"
        )


def __getattr__(name: str):
    """Pickles made before the optimizer classes moved to fused_stable/optimizers.py name them here (the package's
    import has loaded that module: nothing is imported here)."""
    import sys

    registry = sys.modules.get(__package__ + ".optimizers")
    if registry is not None and name in ("FusedAdamW", "FusedLion"):
        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
