"""FusedAdamW: global-norm clipping, inf/NaN skipping and AdamW in one fused, sync-free step.

The optimizer owns param groups, per-param state and a few device scalars. A step goes
optimizer -> plan (plan.py: the params, states and grads flattened once, rebuilt only when they change)
-> backend (ops.fused_step: Triton kernels on CUDA, torch's multi-tensor ops on CPU) -> kernels. Semantics
equal `torch.nn.utils.clip_grad_norm_(params, max_grad_norm)` followed by `torch.optim.AdamW.step()`, except
that a step whose gradients are not finite is skipped whole, and that nothing in step() reads the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from . import compiled, layout, ops
from .kernels.tables import check_not_capturing  # plain torch: does not import triton
from .layout import StepBuffers, StepRules
from .plan import ParamStates, StepPlan, Version, check_grads, check_state, is_dtensor
from .plan import local as _local
from .schedules import Schedule

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")
_CLIP_MODES = {"fixed": layout.CLIP_FIXED, "zscore": layout.CLIP_ZSCORE}
_STATE_KEY = "fused_stable"
# False outside dynamo's tracing (a constant there); bound once, as the check runs in every eager step
_is_compiling = torch.compiler.is_compiling
_LAYOUT_VERSION = 2  # of the counters saved under _STATE_KEY: 2 added the worst-step window (layout.F_WORST_*)


class FusedAdamW(Optimizer):
    """AdamW with the global grad-norm clip, the non-finite check and the update fused on the device.

    Args:
        params: parameters, (name, parameter) pairs or param-group dicts, as for torch.optim.AdamW.
        lr, betas, eps, weight_decay, amsgrad, maximize: as torch.optim.AdamW (decoupled weight decay), per param
            group as there. `lr` may be a 1-element tensor; tensor `betas` are read once, when their group is
            added. amsgrad=True keeps torch's `max_exp_avg_sq` state (fp32, like the moments).
        foreach, fused: accepted for torch.optim.AdamW's call sites and kept in the param groups; they have no
            effect (the step is always the fused one). As in torch, they cannot both be True.
        differentiable: only False: the fused step is not differentiable (True is refused with an error, from
            the constructor, a param group or a loaded state dict).
        max_grad_norm: clip the global L2 norm over all groups to this value; None disables fixed clipping.
        lr_schedule: a `fused_stable.schedules` schedule, evaluated on the device from the count of applied
            updates, multiplying every group's lr (skipped steps do not advance it).
        master_weights: keep an fp32 copy of bf16/fp16 params in the state and update it (the param gets
            the rounded result), so small updates are not lost to rounding.
        capturable: a whole step can be captured in a CUDA graph and replayed (README, "CUDA graphs"): every
            per-step value stays on the device (always true here); change lr through a tensor lr or
            `lr_schedule` so a replay sees the change. Anything that would upload host data while capturing
            (the first step, new grad storage, a changed float hyper-parameter) raises a clear error instead.
        clip: "fixed" (max_grad_norm only) or "zscore" (also clip spikes to mean + zscore_threshold * std of the
            running norm statistics, ZClip-style, after `zscore_warmup` finite steps).
        zscore_alpha, zscore_threshold, zscore_warmup: the running statistics (kept in every mode, for
            spike detection).
        spike_skip_threshold: skip steps whose norm's z-score exceeds this (counted in `spike_skips`).
        spike_skip_ratio: ...and only those whose norm is also at least this many times the running mean (0, the
            default: the z-score alone). Small-batch fine-tuning has normal steps at z ~ 10 but only a few times
            the mean norm; with a ratio of 5 a threshold near 6 skips real spikes and none of those.
        backend: None / "auto", "triton", "interpret" or "torch" (default: $FUSED_STABLE_BACKEND, else by device).
    """

    # GradScaler hands us `grad_scale` and `found_inf` instead of running its own unscale pass
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        max_grad_norm: float | None = None,
        lr_schedule: Schedule | None = None,
        master_weights: bool = False,
        clip: str = "fixed",
        zscore_alpha: float = 0.97,
        zscore_threshold: float = 2.5,
        zscore_warmup: int = 25,
        spike_skip_threshold: float | None = None,
        spike_skip_ratio: float = 0.0,
        backend: str | None = None,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        _check_not_differentiable(differentiable, "FusedAdamW(differentiable=True)")
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")  # torch's words
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm}")
        if clip not in _CLIP_MODES:
            raise ValueError(f"clip must be one of {sorted(_CLIP_MODES)}, got {clip!r}")
        if not 0.0 < zscore_alpha < 1.0:
            raise ValueError(f"zscore_alpha must be in (0, 1), got {zscore_alpha}")
        if not zscore_threshold > 0:
            raise ValueError(f"zscore_threshold must be > 0, got {zscore_threshold}")
        if int(zscore_warmup) < 1:
            raise ValueError(f"zscore_warmup must be >= 1, got {zscore_warmup}")
        if spike_skip_threshold is not None and not spike_skip_threshold >= zscore_threshold:
            raise ValueError(
                f"spike_skip_threshold ({spike_skip_threshold}) must be >= zscore_threshold ({zscore_threshold}): "
                "a step is skipped only when it is a spike"
            )
        if not (spike_skip_ratio >= 0 and math.isfinite(spike_skip_ratio)):
            raise ValueError(
                f"spike_skip_ratio must be a finite number >= 0 (0: the z-score alone), got {spike_skip_ratio}"
            )
        if lr_schedule is not None and not isinstance(lr_schedule, Schedule):
            raise TypeError(
                "lr_schedule must come from fused_stable.schedules (warmup_cosine, warmup_linear, constant); "
                "for a torch LR scheduler, pass the optimizer to the scheduler instead"
            )
        defaults = dict(
            lr=lr,
            betas=_float_betas(betas),
            eps=eps,
            weight_decay=weight_decay,
            # torch.optim.AdamW's own keys, so that either optimizer loads the other's state_dict
            amsgrad=bool(amsgrad),
            maximize=bool(maximize),
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
            decoupled_weight_decay=True,
        )
        self._version = Version()  # bumped by whatever invalidates a cached plan (see plan.py)
        super().__init__(params, defaults)
        self.state = ParamStates(self._version, self.state)
        self.rules = StepRules(
            max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
            clip_mode=_CLIP_MODES[clip],
            zscore_alpha=float(zscore_alpha),
            zscore_threshold=float(zscore_threshold),
            zscore_warmup=int(zscore_warmup),
            spike_skip_threshold=None if spike_skip_threshold is None else float(spike_skip_threshold),
            spike_skip_ratio=float(spike_skip_ratio),
            schedule=lr_schedule,
        )
        self.master_weights = bool(master_weights)
        self.capturable = bool(capturable)
        self._check_params(self.param_groups)
        self.device = self._params_device()
        self.backend = ops.resolve_backend(backend, self.device)
        self._global_sumsq = self._sharded_norm_reducer()
        self._fstate = torch.zeros(layout.F_SIZE, dtype=torch.float32, device=self.device)
        self._istate = torch.zeros(layout.I_SIZE, dtype=torch.int64, device=self.device)
        self._istate[layout.I_LAST_SPIKE_STEP] = -1
        self._worst_sumsq = self._new_worst_sumsq()
        self.reset_max_zscore()
        self._buffers = self._step_buffers()
        self._plan: StepPlan | None = None
        self._last_tables = None  # the backend tables of the latest step: per-tensor norms
        self._param_names: list[str] | None = None
        self._shown_lrs: list[torch.Tensor] = []
        self._show_lrs()

    # ------------------------------------------------------------------------------------------
    # device-side read-outs: 0-dim views of the optimizer's buffers, updated in place by every step

    @property
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the last step's gradients, before clipping (inf/nan if they were not finite)."""
        return self._fstate[layout.F_GRAD_NORM]

    @property
    def skipped_steps(self) -> torch.Tensor:
        """Steps skipped so far because the gradients were not finite."""
        return self._istate[layout.I_SKIPPED_STEPS]

    @property
    def spike_skips(self) -> torch.Tensor:
        """Steps skipped so far because the norm's z-score exceeded spike_skip_threshold."""
        return self._istate[layout.I_SPIKE_SKIPS]

    @property
    def applied_steps(self) -> torch.Tensor:
        """Updates applied so far (what the lr schedule counts)."""
        return self._istate[layout.I_APPLIED_STEPS]

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """Whether the last step was skipped (non-finite grads or a spike), as a 0-dim bool device tensor."""
        return self._istate[layout.I_LAST_STEP_SKIPPED] != 0

    @property
    def last_step_found_inf(self) -> torch.Tensor:
        """1.0 if the last step's gradients were not finite, else 0.0 (what a GradScaler backs off on)."""
        return self._fstate[layout.F_FOUND_INF]

    @property
    def last_lr(self) -> torch.Tensor:
        """Param group 0's effective lr in the last step (schedule applied)."""
        return self._fstate[layout.F_LAST_LR]

    @property
    def grad_norm_mean(self) -> torch.Tensor:
        return self._fstate[layout.F_NORM_MEAN]

    @property
    def grad_norm_std(self) -> torch.Tensor:
        return self._fstate[layout.F_NORM_VAR].clamp(min=0.0).sqrt()

    @property
    def last_zscore(self) -> torch.Tensor:
        return self._fstate[layout.F_LAST_ZSCORE]

    @property
    def spike_count(self) -> torch.Tensor:
        """Steps so far whose norm's z-score exceeded zscore_threshold (after the statistics' warm-up)."""
        return self._istate[layout.I_SPIKE_COUNT]

    @property
    def last_spike_step(self) -> torch.Tensor:
        """Applied-step index of the latest spike, -1 if none."""
        return self._istate[layout.I_LAST_SPIKE_STEP]

    @property
    def last_spike_norm(self) -> torch.Tensor:
        return self._fstate[layout.F_LAST_SPIKE_NORM]

    @property
    def max_zscore(self) -> torch.Tensor:
        """Largest grad-norm z-score since reset_max_zscore() (-inf if none): lets a guard that polls only at
        logging steps see a spike that happened between two polls."""
        return self._fstate[layout.F_MAX_ZSCORE]

    @property
    def max_zscore_norm(self) -> torch.Tensor:
        """The grad norm of the step with the largest z-score since reset_max_zscore()."""
        return self._fstate[layout.F_MAX_ZSCORE_NORM]

    @property
    def max_zscore_step(self) -> torch.Tensor:
        """Applied-step index of the step with the largest z-score since reset_max_zscore() (-1 if none)."""
        return self._istate[layout.I_MAX_ZSCORE_STEP]

    @property
    def worst_step(self) -> torch.Tensor:
        """Index, among all steps taken (applied or skipped, from 0), of the worst step since reset_max_zscore():
        the largest z-score, or the first step with non-finite gradients; -1 if none. `skipped_steps +
        spike_skips + applied_steps` is the count of steps taken, so the latest step's index is that count - 1."""
        return self._istate[layout.I_WORST_STEP]

    @property
    def worst_step_norm(self) -> torch.Tensor:
        """The global grad norm of the worst step since reset_max_zscore() (inf/nan for a non-finite step)."""
        return self._fstate[layout.F_WORST_NORM]

    @property
    def worst_step_zscore(self) -> torch.Tensor:
        """The worst step's z-score (0 during the statistics' warm-up, inf for a non-finite step; -inf if none)."""
        return self._fstate[layout.F_WORST_KEY]

    def worst_step_grad_norms(self) -> torch.Tensor:
        """Per-parameter gradient norms of the worst step since reset_max_zscore(), in param_groups order (0 for
        a param without a grad then). The decision kernel copies them when a step becomes the worst: reading them
        costs no per-step work."""
        return self._worst_sumsq.sqrt()

    def reset_max_zscore(self) -> None:
        """Starts a new polling window for max_zscore and the worst step (device writes only, no sync)."""
        self._fstate[layout.F_MAX_ZSCORE] = float("-inf")
        self._fstate[layout.F_MAX_ZSCORE_NORM] = 0.0
        self._istate[layout.I_MAX_ZSCORE_STEP] = -1
        self._reset_worst_step()

    def _reset_worst_step(self) -> None:
        self._fstate[layout.F_WORST_KEY] = float("-inf")
        self._fstate[layout.F_WORST_NORM] = 0.0
        self._istate[layout.I_WORST_STEP] = -1
        self._worst_sumsq.zero_()

    @property
    def param_names(self) -> list[str] | None:
        """Names for the parameters in param_groups order (e.g. from model.named_parameters()), for tools that
        report which tensor's gradient exploded: as set, else the groups' own (params given as (name, param)
        pairs), else None."""
        if self._param_names is None and all("param_names" in group for group in self.param_groups):
            return [name for group in self.param_groups for name in group["param_names"]]
        return self._param_names

    @param_names.setter
    def param_names(self, names: Iterable[str] | None) -> None:
        if names is None:
            self._param_names = None
            return
        names = [str(n) for n in names]
        count = sum(len(group["params"]) for group in self.param_groups)
        if len(names) != count:
            raise ValueError(f"param_names has {len(names)} names but the optimizer has {count} parameters")
        self._param_names = names

    def reset_grad_norm_stats(self) -> None:
        """Forget the running grad-norm statistics and warm them up again from the next step (device writes
        only). For a deliberate change of regime (a new data mix, a rollback to an earlier state), after which
        the old statistics would flag every step as a spike."""
        for index in (layout.F_NORM_MEAN, layout.F_NORM_VAR, layout.F_WARMUP_SUM, layout.F_WARMUP_SUMSQ):
            self._fstate[index] = 0.0
        self._istate[layout.I_STATS_COUNT] = 0

    def per_tensor_grad_norms(self) -> torch.Tensor:
        """L2 norm of each parameter's gradient in the last step, in param_groups order (0 where no grad).

        A by-product of the norm pass: no further pass over the gradients.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        norms = torch.zeros(len(params), dtype=torch.float32, device=self.device)
        tables = self._last_tables
        if tables is not None and tables.per_tensor_sumsq is not None and tables.positions.numel() <= len(params):
            norms.index_copy_(0, tables.positions, tables.per_tensor_sumsq.sqrt())
        return norms

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
        return compiled.prepare(self, tensors, grads, lrs)

    def _fused_step(self) -> None:
        plan = self._plan
        grads = None
        if plan is not None and plan.version == self._version.value and type(self.state) is ParamStates:
            grads = plan.current_grads(self.param_groups)  # the per-step check: a few C-level passes
        if grads is None:
            plan, grads = self._build_plan()
            if plan is None:
                return
        attrs = self.__dict__  # GradScaler sets these two for the duration of its step() call
        ops.fused_step(
            self.backend,
            plan,
            grads,
            self._buffers,
            self.rules,
            self._hparam_rows(),
            grad_scale=attrs.get("grad_scale"),
            found_inf=attrs.get("found_inf"),
            global_sumsq=self._global_sumsq,
        )
        self._last_tables = plan.backend_cache

    def _hparam_rows(self) -> list[tuple]:
        """(lr, beta1, beta2, eps, weight_decay, maximize) per param group, as the backends take them: with an lr
        schedule the lr is the group's base lr, `initial_lr`."""
        groups = self.param_groups
        if self.rules.schedule is None:
            return [(g["lr"], *g["betas"], g["eps"], g["weight_decay"], g["maximize"]) for g in groups]
        shown = self._shown_lrs
        if len(shown) != len(groups) or any(g["lr"] is not view for g, view in zip(groups, shown)):
            self._show_lrs()  # an lr set from outside (group["lr"] = value): the group's new base lr
        return [(g["initial_lr"], *g["betas"], g["eps"], g["weight_decay"], g["maximize"]) for g in groups]

    # ------------------------------------------------------------------------------------------
    # the lr that monitors read: param_groups[g]["lr"] under an lr schedule

    def _show_lrs(self) -> None:
        """With `lr_schedule`, every group keeps its base lr in `initial_lr` (the key torch's LR schedulers use for it)
        and `group["lr"]` is a 0-dim fp32 device tensor, a view of the step's hyper-parameter table, that each step sets
        on the device to the lr the next step will use: what Lightning's LearningRateMonitor or a loop that prints
        `group["lr"]` read, with no host read in step(). A value assigned to `group["lr"]` (anything but that view)
        becomes the group's new base lr; so does one loaded with a state dict. Without a schedule the groups are left as
        they are."""
        if self.rules.schedule is None:
            self._shown_lrs = []
            return
        previous = self._shown_lrs
        views = list(self._buffers.hparams[:, layout.H_SHOWN_LR].unbind(0))
        for index, (group, view) in enumerate(zip(self.param_groups, views)):
            lr = group["lr"]
            if not (index < len(previous) and lr is previous[index]):
                group["initial_lr"] = lr
            group["lr"] = view
        self._shown_lrs = views
        self._refresh_shown_lrs()

    def _refresh_shown_lrs(self) -> None:
        """The shown lrs from the base lrs and the count of applied updates, on the device (no host read)."""
        check_not_capturing(self.device, "a changed lr (group['lr'] was assigned)")
        bases = [group["initial_lr"] for group in self.param_groups]
        base = torch.stack([torch.as_tensor(b, dtype=torch.float32, device=self.device).reshape(()) for b in bases])
        factor = self.rules.schedule.factor_tensor(self._istate[layout.I_APPLIED_STEPS])
        with torch.no_grad():
            torch.mul(base, factor, out=self._buffers.hparams[:, layout.H_SHOWN_LR])

    def _build_plan(self) -> tuple[StepPlan | None, list[torch.Tensor] | None]:
        """The plan for the params that have a grad now, with their (lazily created) state. Validates every grad
        and state before anything changes; afterwards a step only checks that nothing it encodes moved."""
        check_not_capturing(self.device, "a new step plan (the first step, or params, state or grads that changed)")
        if type(self.state) is not ParamStates:  # replaced wholesale (e.g. by torch's __setstate__)
            self.state = ParamStates(self._version, self.state)
        group_params = [group["params"] for group in self.param_groups]
        all_params = [p for params in group_params for p in params]
        if len(all_params) != self._worst_sumsq.numel() or len(group_params) != self._buffers.hparams.shape[0]:
            self._renew_slots()  # params or groups added to param_groups in place, not through add_param_group
        groups = [index for index, params in enumerate(group_params) for _ in params]
        group_amsgrad = [bool(group["amsgrad"]) for group in self.param_groups]
        grads = [p.grad for p in all_params]
        members = [i for i, g in enumerate(grads) if g is not None]
        if not members:
            self._plan = None
            return None, None
        params = [all_params[i] for i in members]
        local_params = [_local(p) for p in params]
        local_grads = [_local(grads[i]) for i in members]
        check_grads(local_params, local_grads, ops.needs_dense_layouts(self.backend))
        states = []
        for p, group in zip(params, (groups[i] for i in members)):
            state = self.state[p]
            if not state:
                self._init_state(p, state, group_amsgrad[group])
            check_state(_local(p), state, group_amsgrad[group])
            states.append(state)
        plan = StepPlan(
            version=self._version.value,
            group_params=group_params,
            group_sizes=[len(params) for params in group_params],
            all_params=all_params,
            members=None if len(members) == len(all_params) else members,
            params=params,
            local_params=local_params,
            exp_avgs=[_local(state["exp_avg"]) for state in states],
            exp_avg_sqs=[_local(state["exp_avg_sq"]) for state in states],
            masters=[_local(state["master_param"]) if "master_param" in state else None for state in states],
            max_exp_avg_sqs=[
                _local(state["max_exp_avg_sq"]) if group_amsgrad[groups[i]] else None
                for i, state in zip(members, states)
            ],
            group_amsgrad=group_amsgrad,
            steps=[state["step"] for state in states],
            groups=[groups[i] for i in members],
            numels=[p.numel() for p in local_params],
            nbytes=[p.nbytes for p in local_params],
            param_ptrs=[p.data_ptr() for p in local_params],
            dtypes=[p.dtype for p in local_params],
            strides=[p.stride() for p in local_params],
            contiguous=all(p.is_contiguous() for p in local_params),
            sharded=any(is_dtensor(p) for p in params),
            dense_layouts=ops.needs_dense_layouts(self.backend),
            storages=[p.untyped_storage() for p in local_params],
            grad_ptrs=[g.data_ptr() for g in local_grads],
        )
        if not plan.dense_layouts:
            plan.note_grad_layouts(local_grads)
        if not plan.sharded:
            plan.same_grads.seen(local_grads)
        self._plan = plan
        return plan, local_grads

    def _init_state(self, p: torch.Tensor, state: dict, amsgrad: bool) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32, device=self.device)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if self.master_weights and p.dtype != torch.float32:
            state["master_param"] = p.detach().to(torch.float32, memory_format=torch.preserve_format).clone()

    def _step_buffers(self) -> StepBuffers:
        hparams = torch.zeros(len(self.param_groups), layout.H_SIZE, dtype=torch.float32, device=self.device)
        return StepBuffers(self._fstate, self._istate, hparams, self._worst_sumsq)

    def _renew_slots(self) -> None:
        """The buffers with a slot per param (the worst-step window) or per group (the hyper-parameter table) made
        anew for the current param_groups; the worst-step window starts over."""
        self._worst_sumsq = self._new_worst_sumsq()
        self.reset_max_zscore()
        self._buffers = self._step_buffers()
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
        if "lr" in param_group or "betas" in param_group or "eps" in param_group or "weight_decay" in param_group:
            _check_hyperparameters(
                param_group.get("lr", self.defaults["lr"]),
                param_group.get("betas", self.defaults["betas"]),
                param_group.get("eps", self.defaults["eps"]),
                param_group.get("weight_decay", self.defaults["weight_decay"]),
            )
        _check_not_differentiable(param_group.get("differentiable"), "a param group with differentiable=True")
        constructed = hasattr(self, "_buffers")
        if constructed:  # a group added later: check it against the others before anything changes
            self._check_params(self.param_groups + [{**param_group, "params": params}])
        param_group["params"] = listed
        if "betas" in param_group:
            param_group["betas"] = _float_betas(param_group["betas"])
        super().add_param_group(param_group)
        if constructed:
            self._renew_slots()
            self._global_sumsq = self._sharded_norm_reducer()
            self._version.bump()

    def _check_params(self, groups: list[dict[str, Any]]) -> None:
        """Refuses what the fused step cannot update; called before a group is added, so nothing changes."""
        from .integrations import distributed

        devices = set()
        for group in groups:
            for p in group["params"]:
                if p.is_complex():
                    raise TypeError(
                        "FusedAdamW does not support complex parameters; optimize torch.view_as_real(param) instead"
                    )
                if not p.is_floating_point() or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise TypeError(f"FusedAdamW supports float32, bfloat16 and float16 parameters, got {p.dtype}")
                devices.add(_local(p).device)
            distributed.validate_params(list(group["params"]))  # FSDP1 flat params, mixed meshes
        if len(devices) > 1:
            raise ValueError(
                f"all parameters of one FusedAdamW must be on one device, got {sorted(map(str, devices))}: "
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
        return _local(self.param_groups[0]["params"][0]).device

    def _sharded_norm_reducer(self) -> ops.GlobalSumsq | None:
        """For DTensor (FSDP2) params: the all-reduce that turns local sums of squares into the global one."""
        if not any(is_dtensor(p) for group in self.param_groups for p in group["params"]):
            return None
        from .integrations import distributed

        return distributed.global_sumsq

    # ------------------------------------------------------------------------------------------
    # state dict: torch.optim.AdamW's layout, fp32 moments kept fp32, our counters under one extra key

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["state"] = {key: dict(entry) for key, entry in state["state"].items()}  # plain dicts, like torch's
        state[_STATE_KEY] = {"fstate": self._fstate.clone(), "istate": self._istate.clone(), "layout": _LAYOUT_VERSION}
        if self.rules.schedule is not None:  # the base lr, as before schedules were shown (see _show_lrs)
            for saved, group in zip(state["param_groups"], self.param_groups):
                saved["lr"] = group["initial_lr"]
        return state

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
            _check_not_differentiable(saved.get("differentiable"), "a state dict saved with differentiable=True")
            id_to_param.update(zip(saved["params"], group["params"]))
        # keep the moments in fp32: torch's loader would cast them to the param dtype (bf16 loses bits)
        moments: dict[Any, dict[str, torch.Tensor]] = {}
        plain_state = {}
        for param_id, entry in state_dict["state"].items():
            param = id_to_param.get(param_id)
            kept = {k: v for k, v in entry.items() if k not in _MOMENT_KEYS}
            taken = {k: v for k, v in entry.items() if k in _MOMENT_KEYS}
            if param is not None:
                for key, value in taken.items():
                    if tuple(value.shape) != tuple(_local(param).shape) and tuple(value.shape) != tuple(param.shape):
                        raise ValueError(
                            f"state {key!r} has shape {tuple(value.shape)} but its parameter has shape "
                            f"{tuple(param.shape)}: this state dict belongs to another model"
                        )
                moments[param_id] = taken
            plain_state[param_id] = kept
        super().load_state_dict({**state_dict, "state": plain_state})
        for group in self.param_groups:  # torch may have saved tensor betas: the step's tables hold floats
            group["betas"] = _float_betas(group["betas"])
        for param_id, taken in moments.items():
            param = id_to_param[param_id]
            state = self.state[param]
            for key, value in taken.items():
                state[key] = value.to(device=param.device, dtype=torch.float32, copy=True)
            if "step" in state:
                step = state["step"]
                state["step"] = (
                    (step if isinstance(step, torch.Tensor) else torch.tensor(float(step)))
                    .to(device=self.device, dtype=torch.float32, copy=True)
                    .reshape(())
                )
            if self.master_weights and param.dtype != torch.float32 and "master_param" not in state:
                state["master_param"] = param.detach().to(torch.float32).clone()
        if extra is not None:
            self._load_counters(extra)
        else:  # a torch.optim.AdamW state: continue the schedule from the steps already taken
            self._fstate.zero_()
            self._istate.zero_()
            self._istate[layout.I_LAST_SPIKE_STEP] = -1
            self.reset_max_zscore()
            steps = [float(s["step"]) for s in self.state.values() if "step" in s]
            self._istate[layout.I_APPLIED_STEPS] = int(max(steps, default=0.0))
        self._plan = None
        self._version.bump()
        self._show_loaded_lrs()

    def _show_loaded_lrs(self) -> None:
        """After a state dict or a pickle was loaded: the saved base lrs (`initial_lr`, which torch's LR
        schedulers also save, else `lr`) shown at the loaded count of applied updates."""
        if self.rules.schedule is None:
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
        "rules",
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
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_version" not in self.__dict__:  # unpickling: a fresh object
            self._version = Version()
        super().__setstate__(state)
        self.state = ParamStates(self._version, self.state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", True)
        if not hasattr(self, "rules"):  # pickled by an older version or by a plain Optimizer
            self.rules, self.master_weights, self.capturable = StepRules(), False, False
        if not hasattr(self, "device"):
            self.device = self._params_device()
            self.backend = ops.resolve_backend(None, self.device)
        if not hasattr(self, "_fstate"):
            self._fstate = torch.zeros(layout.F_SIZE, dtype=torch.float32, device=self.device)
            self._istate = torch.zeros(layout.I_SIZE, dtype=torch.int64, device=self.device)
            self._istate[layout.I_LAST_SPIKE_STEP] = -1
        if getattr(self, "_worst_sumsq", None) is None:  # pickled by an older version: no worst-step window yet
            self._worst_sumsq = self._new_worst_sumsq()
            saved = {"fstate": self._fstate, "istate": self._istate}
            self._fstate = torch.zeros(layout.F_SIZE, dtype=torch.float32, device=self.device)
            self._istate = torch.zeros(layout.I_SIZE, dtype=torch.int64, device=self.device)
            self._load_counters(saved)
        self._param_names = getattr(self, "_param_names", None)
        self._buffers = self._step_buffers()
        self._plan = None
        self._last_tables = None
        self._version.bump()
        self._global_sumsq = self._sharded_norm_reducer()
        self._show_loaded_lrs()


def _check_counters(extra: dict) -> None:
    fstate, istate = extra["fstate"], extra["istate"]
    if fstate.numel() > layout.F_SIZE or istate.numel() > layout.I_SIZE:
        raise ValueError(
            f"this optimizer state was saved by a newer fused_stable (counter layout {extra.get('layout')}, this one "
            f"reads up to {_LAYOUT_VERSION}): upgrade fused_stable to load it"
        )


def _check_not_differentiable(differentiable, where: str) -> None:
    if differentiable:
        raise ValueError(
            f"{where}: FusedAdamW's fused step cannot be differentiated through (autograd does not see inside "
            "its kernels); use torch.optim.AdamW(differentiable=True) for that, or differentiable=False"
        )


def _float_betas(betas) -> tuple[float, float]:
    """Tensor betas (torch accepts 1-element ones) as floats: the step's tables hold floats."""
    return tuple(float(b.detach().reshape(())) if isinstance(b, torch.Tensor) else b for b in betas)


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        lr_value = float(lr.detach().reshape(()).cpu())
    else:
        lr_value = float(lr)
    if not lr_value >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")  # torch's words
    for index, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor) and beta.numel() != 1:
            raise ValueError(f"Tensor betas[{index}] must be 1-element")
    betas = _float_betas(betas)
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta} (must be in [0, 1))")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
