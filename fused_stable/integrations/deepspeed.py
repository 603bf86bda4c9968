"""FusedAdamW (or FusedLion: any elementwise rule) under DeepSpeed ZeRO 0-3 (and ZeRO-Offload): the clip, the
non-finite skip, the spike policy and the lr schedule decided once per engine step, from the global norm across
ranks, groups and sub-groups.

    from fused_stable.integrations import deepspeed as fs_deepspeed
    engine, optimizer, _, _ = fs_deepspeed.initialize(model=model, optimizer=FusedAdamW(...), config="ds.json")

`initialize` is `deepspeed.initialize` with the config `prepare_config` makes, followed by `attach(engine)`. For an
engine made elsewhere, pass the config through `prepare_config` and call `attach` on the engine before its first
step: the HF Trainer's `TrainingArguments(deepspeed=...)` path does both through
`fused_stable.integrations.hf.FusedStableTrainerMixin`, and `fused-stable sft --deepspeed / --zero_stage` through
`fused_stable.train.run.deepspeed_run`.

How: DeepSpeed's ZeRO wrappers call the client optimizer once per param group (ZeRO-3: per sub-group) on flat fp32
partitions, right after building that group's gradient partition, and copy the result into the model's params
right after the call. `attach` replaces the wrapper's per-group `_optimizer_step` on the engine's instance: the
calls of one engine step hand their gradient partitions to the integration, and the last call runs one
`FusedAdamW.step()` over every group, whose sum of squares is all-reduced over the data-parallel group (on the
device, no host read: an inf on any rank makes every rank skip), then redoes the earlier groups' copy into the
model's params (DeepSpeed's all-gather, after its loop, then sees the updated values). So `grad_norm`,
`skipped_steps`, `applied_steps` and `last_lr` mean what they mean without DeepSpeed.

What DeepSpeed no longer does: its gradient clipping (`gradient_clipping` must be 0: clip with FusedAdamW's
`max_grad_norm`); at ZeRO 1-2 without offload its fp64 norm and its overflow check (`compute_grad_norm: false`,
bf16's `check_grad_overflow: false`, both set by `prepare_config`). Where its config cannot switch them off (ZeRO-3;
ZeRO 1-2 with `offload_optimizer`) the wrapper's norm is replaced by a CPU constant on the instance, so its host
check reads host memory (no device sync) and never skips a step on its own; ZeRO-3's multiplication of every
gradient partition by 1 (`unscale_and_clip_grads`) is replaced by nothing. docs/integrations.md says what is left.
fp16 (DeepSpeed's loss scaler), NVMe offload, partial offload and ZenFlow are refused.

FusedMuon runs at ZeRO 0 (whole params: every rank orthogonalises every matrix, as under DDP) and ZeRO 1-2: its
Muon groups' momentum stays on the flat partitions, and each matrix is rebuilt whole on one owner rank for
Newton-Schulz, its pieces of the result sent back (deepspeed_muon.py, given to the fused step through
engines.drive); the same bits as one process's FusedMuon given the same grads. Refused in one line: ZeRO-3 (it cuts
each param into its own partitions, which the exchange does not rebuild yet) and ZeRO-Offload with Muon groups;
FusedAdafactor under ZeRO.

The state's size: `FusedAdamW.state_bytes()` counts its groups' params, which ZeRO-3 empties between steps;
`EngineStep.state_bytes()` counts this rank's partitions (what the step sees), `state_bytes_per_rank()` every rank's
(a collective, once).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import engines
from ..optim import FusedOptimizer
from ..optimizers import OPTIMIZERS
from .deepspeed_muon import PartitionedMuon

__all__ = ["EngineStep", "attach", "initialize", "prepare_config"]

# what DeepSpeed's own norm becomes where its config cannot switch it off: a CPU constant, so its host check of the
# norm (`is_invalid_grad_norm`, a bool() of a tensor) reads host memory and never waits for the device
_HOST_ZERO = torch.zeros(())
MUON = "muon"  # the matrix rule whose groups run here (ZeRO 0-2): FusedMuon's


def _load_config(config: dict | str | Path) -> dict:
    if isinstance(config, (str, Path)):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"a DeepSpeed config is a dict or the path of a JSON file, got {type(config).__name__}")
    return copy.deepcopy(config)


def prepare_config(config: dict | str | Path) -> dict:
    """A copy of the DeepSpeed config (a dict, or a JSON file's path) with what FusedAdamW's integration needs:
    `zero_allow_untested_optimizer` (DeepSpeed refuses a client optimizer at ZeRO 1-3 otherwise), no
    `gradient_clipping` (the clip is FusedAdamW's `max_grad_norm`; a positive value is refused, not dropped), at
    ZeRO 1-2 without offload `compute_grad_norm: false`, with bf16 `check_grad_overflow: false`, and with
    `offload_optimizer` `zero_force_ds_cpu_optimizer: false` (FusedAdamW is the offloaded CPU optimizer)."""
    cfg = _load_config(config)
    clipping = cfg.get("gradient_clipping", 0)
    if clipping not in (0, 0.0, "auto"):
        raise ValueError(
            f"DeepSpeed config has gradient_clipping={clipping!r}: with fused_stable's integration the clip is "
            "FusedAdamW's (max_grad_norm=..., decided once per engine step from the global norm); set "
            "gradient_clipping to 0 and pass the value to FusedAdamW"
        )
    cfg["gradient_clipping"] = 0.0
    fp16 = cfg.get("fp16", {})
    if isinstance(fp16, dict) and fp16.get("enabled") in (True, "auto"):
        raise ValueError(
            "fp16 under DeepSpeed uses its loss scaler and overflow check, which the integration does not take "
            "over: use bf16 (`bf16: {enabled: true}`) or fp32"
        )
    if "optimizer" in cfg:
        raise ValueError(
            "DeepSpeed config has an `optimizer` section: the integration passes FusedAdamW as the client "
            "optimizer; remove the section (lr, betas and weight decay go to FusedAdamW)"
        )
    cfg["zero_allow_untested_optimizer"] = True
    zero = cfg.setdefault("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero.get('stage')!r}")
    offload = _offload_device(zero)
    if offload == "nvme" or _offload_device(zero, "offload_param") == "nvme":
        raise ValueError("NVMe offload is not supported by fused_stable's DeepSpeed integration: use cpu")
    if offload is not None:
        if float(zero["offload_optimizer"].get("ratio", 1.0)) != 1.0:
            raise ValueError("partial optimizer offload (offload_optimizer.ratio < 1) is not supported: use 1.0")
        cfg["zero_force_ds_cpu_optimizer"] = False
    elif stage in (1, 2):
        zero["compute_grad_norm"] = False  # DeepSpeed's own fp64 norm: FusedAdamW computes the norm
    bf16 = cfg.get("bf16")
    if isinstance(bf16, dict) and bf16.get("enabled") in (True, "auto"):
        bf16["check_grad_overflow"] = False  # the non-finite check is FusedAdamW's, global across ranks
    if "zenflow" in zero:
        raise ValueError("ZenFlow is not supported by fused_stable's DeepSpeed integration")
    return cfg


def _offloads(wrapper) -> bool:
    """Whether a ZeRO wrapper offloads the optimizer (ZeRO 1-2: cpu_offload; ZeRO-3: offload_optimizer)."""
    return bool(getattr(wrapper, "cpu_offload", False) or getattr(wrapper, "offload_optimizer", False))


def _flat_layout(wrapper, group: int) -> list[tuple[tuple[int, ...], int]]:
    """Group `group`'s params in ZeRO 1-2's flat buffer: (shape, offset) each, in DeepSpeed's order (its
    round-robin order when round_robin_gradients is on), as its get_flat_partition reads them."""
    metas, offsets = wrapper.round_robin_bit16_meta[group], wrapper.round_robin_bit16_offsets[group]
    return [(tuple(meta.shape), int(offset)) for meta, offset in zip(metas, offsets)]


def _offload_device(zero: dict, key: str = "offload_optimizer") -> str | None:
    section = zero.get(key)
    if not isinstance(section, dict):
        return None
    device = str(section.get("device", "none")).lower()
    return None if device == "none" else device


def initialize(*, model: torch.nn.Module, optimizer: FusedOptimizer, config: dict | str | Path, **kwargs: Any):
    """`deepspeed.initialize(model=model, optimizer=optimizer, config=prepare_config(config), **kwargs)`, then
    `attach(engine)`; returns what deepspeed.initialize returns (engine, optimizer, dataloader, lr_scheduler)."""
    if not isinstance(optimizer, FusedOptimizer):
        names = " or ".join(entry.title for entry in OPTIMIZERS.values() if not entry.own_param_groups)
        raise TypeError(f"optimizer must be a fused_stable {names}, got {type(optimizer).__name__}")
    config = prepare_config(config)
    zero = config["zero_optimization"]
    # before deepspeed is imported: nothing runs for a refused optimizer
    _refuse_groups_without_a_rule(optimizer, int(zero.get("stage", 0)), _offload_device(zero) is not None)
    import deepspeed

    out = deepspeed.initialize(model=model, optimizer=optimizer, config=config, **kwargs)
    attach(out[0])
    return out


def _refuse_groups_without_a_rule(optimizer: FusedOptimizer, stage: int, offload: bool) -> None:
    """Groups of a matrix rule are updated after the fused step from whole params, and ZeRO hands the optimizer
    flat partitions of them: Muon's run at ZeRO 0 (whole params) and 1-2 (the matrices rebuilt for their owner,
    deepspeed_muon.py); the rest is refused before the engine is built, in one line saying why."""
    rules = [optimizer.group_rule(group) for group in optimizer.param_groups]
    muon = any(rule.name == MUON for rule in rules)
    if muon and stage == 3:
        raise ValueError(
            f"{type(optimizer).__name__}'s Muon groups do not run under ZeRO-3 yet: ZeRO-3 cuts each matrix into "
            "per-param partitions that the Muon exchange (built for ZeRO 1-2's flat groups) does not rebuild; use "
            "ZeRO-1 or ZeRO-2 (or ZeRO-3 with FusedAdamW)"
        )
    if muon and stage in (1, 2) and any(p.ndim == 3 for g in _muon_groups(optimizer) for p in g["params"]):
        raise ValueError(
            f"{type(optimizer).__name__}'s Muon groups step 3-D expert stacks per expert, and the ZeRO {stage} "
            "exchange rebuilds 2-D matrices only (not built yet): give the experts use_muon=False "
            "(muon_param_groups(..., expert_stacks=False)) under ZeRO 1-2"
        )
    if muon and stage in (1, 2) and _muon_8bit(optimizer):
        raise ValueError(
            f"{type(optimizer).__name__}'s Muon groups keep 8-bit momentum in blocks over whole matrices, and ZeRO "
            f"{stage} steps flat partitions of them: give the Muon groups state_precision 'bf16' or 'fp32' (8-bit "
            "Muon momentum runs in one process, under DDP and at ZeRO-0)"
        )
    if muon and offload:
        raise ValueError(
            f"{type(optimizer).__name__}'s Muon groups do not run with ZeRO-Offload yet: the exchange of whole "
            "matrices between ranks runs on the device's partitions; drop offload_optimizer"
        )
    matrix = [rule.title for rule in rules if not rule.elementwise and rule.name != MUON]
    if matrix:
        usable = [e.title for e in OPTIMIZERS.values() if e.cls.RULE.elementwise and not e.own_param_groups]
        raise ValueError(
            f"{type(optimizer).__name__}'s {matrix[0]} groups are updated after the fused step from whole params (a "
            "matrix rule: Newton-Schulz needs whole matrices, factored moments whole rows and columns), and "
            f"DeepSpeed ZeRO steps flat partitions: use {' or '.join(usable)} under DeepSpeed"
        )


def _muon_groups(optimizer: FusedOptimizer) -> list[dict]:
    return [group for group in optimizer.param_groups if optimizer.group_rule(group).name == MUON]


def _muon_8bit(optimizer: FusedOptimizer) -> bool:
    precision = optimizer.defaults.get("state_precision", "fp32")
    return any(group.get("state_precision", precision) == "8bit" for group in _muon_groups(optimizer))


def attach(engine) -> EngineStep:
    """Makes the engine's FusedAdamW decide once per engine step (see the module doc); call it after
    deepspeed.initialize and before the first step. Returns the EngineStep (also `engine.fused_stable_step`)."""
    step = EngineStep(engine)
    engine.fused_stable_step = step
    return step


class EngineStep:
    """One FusedAdamW.step() per engine step over every group and sub-group of a DeepSpeed engine."""

    def __init__(self, engine) -> None:
        wrapper = engine.optimizer
        fused = getattr(wrapper, "optimizer", wrapper)
        if not isinstance(fused, FusedOptimizer):
            raise TypeError(
                f"the engine's optimizer is {type(fused).__name__}, not a fused one: pass FusedAdamW(...) as "
                "deepspeed.initialize's optimizer= (the config's `optimizer` section builds DeepSpeed's own)"
            )
        stage = int(engine.zero_optimization_stage()) if wrapper is not fused else 0
        _refuse_groups_without_a_rule(fused, stage, _offloads(wrapper))
        if engine.gradient_clipping() > 0:
            raise ValueError(
                "the engine clips (gradient_clipping > 0): pass the config through "
                "fused_stable.integrations.deepspeed.prepare_config and clip with FusedAdamW(max_grad_norm=...)"
            )
        if engine.fp16_enabled():
            raise ValueError("fp16 under DeepSpeed is not supported by the integration: use bf16 or fp32")
        if fused.policy.schedule is not None and engine.lr_scheduler is not None:
            raise ValueError(
                f"the engine has an lr scheduler and {type(fused).__name__} has lr_schedule=: two schedules; drop "
                f"one (the config's `scheduler` section, or {type(fused).__name__}'s lr_schedule)"
            )
        self.engine, self.wrapper, self.optimizer = engine, wrapper, fused
        self.stage = stage
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.engine_steps = 0  # engine steps this integration ran (host count; skipped steps included)
        self.offload = False
        self.muon_layouts: dict = {}
        self.muon_sides: list = []  # the Muon updates built (one per plan and hyper-parameters)
        if wrapper is fused:  # ZeRO 0: DeepSpeed all-reduces the grads and calls step() once with every group
            self.calls = 1
            self.process_group = None  # (the state is whole on every rank: state_bytes_per_rank gathers over all)
            engines.drive(fused, None)
            return
        for attr in ("torch_autocast_gradscaler", "zenflow", "swap_optimizer"):
            if getattr(wrapper, attr, None):
                raise ValueError(f"DeepSpeed's {attr} is not supported by fused_stable's integration")
        self.replaced: dict = {}  # the wrapper's methods replaced on its instance, once every check has passed
        name = type(wrapper).__name__
        if name == "DeepSpeedZeroOptimizer":
            self._attach_stage_1_2(wrapper)
        elif name == "DeepSpeedZeroOptimizer_Stage3":
            self._attach_stage_3(wrapper)
        else:
            raise TypeError(
                f"DeepSpeed wrapped {type(fused).__name__} in {name}, which the integration does not drive (ZeRO "
                "1-2 use DeepSpeedZeroOptimizer, ZeRO-3 DeepSpeedZeroOptimizer_Stage3; bf16 ZeRO-1 with fp32 gradient "
                "accumulation uses BF16_Optimizer: leave data_types.grad_accum_dtype unset)"
            )
        devices = {str(flat.device) for flat in self.flats}
        if devices != {str(fused.device)}:
            raise ValueError(
                f"DeepSpeed keeps the optimizer's partitions on {sorted(devices)}, its step buffers are on "
                f"{fused.device}: ZeRO-Offload of a model on another device is not supported yet (FusedAdamW would "
                "have to be built on the offload device); offload with a CPU model, or do not offload"
            )
        for method, replacement in self.replaced.items():
            setattr(wrapper, method, replacement)
        wrapper._optimizer_step = self._group_step  # on the instance: DeepSpeed's loop calls this per group
        # the all-reduce of the sum of squares (cf. sharding.py); the Muon groups' update on the partitions
        builds = {MUON: self._build_muon} if self.muon_layouts else {}
        engines.drive(fused, self._global_sumsq, builds)
        fused.invalidate_plan()  # DeepSpeed replaced the groups' params by its flat partitions: a new plan

    # ------------------------------------------------------------------------------------------
    # per stage: where the flat partitions are, and what DeepSpeed does after each group's step

    def _attach_stage_1_2(self, wrapper) -> None:
        self.flats = wrapper.single_partition_of_fp32_groups
        self.calls = len(wrapper.bit16_groups)
        groups = {id(g) for g in wrapper.real_dp_process_group}
        if len(groups) != 1:
            raise ValueError("param groups on different data-parallel groups (MoE) are not supported")
        self.process_group = wrapper.real_dp_process_group[0]
        self.offload = bool(wrapper.cpu_offload)
        if self.offload:  # the config cannot switch its norm off with offload: a constant, so it never skips
            self.replaced["scaled_global_norm"] = lambda norm_type=2: _HOST_ZERO
        self.group_of_call = list(range(self.calls))
        self.muon_layouts = {  # flat partition's id -> (its group's matrices as (shape, offset), partition size)
            id(self.flats[i]): (_flat_layout(wrapper, i), wrapper.partition_size[i])
            for i, group in enumerate(self.optimizer.param_groups)
            if self.optimizer.group_rule(group).name == MUON
        }

    def _build_muon(self, params, states, groups) -> PartitionedMuon:
        """matrix_step's build for the Muon groups: their flat partitions, stepped by deepspeed_muon.py."""
        layouts = [self.muon_layouts[id(p)] for p in params]
        side = PartitionedMuon(
            params,
            [state["momentum_buffer"] for state in states],
            groups,
            [layout for layout, _ in layouts],
            [size for _, size in layouts],
            self.process_group,
        )
        self.muon_sides.append(side)
        return side

    @property
    def orthogonalized_matrices(self) -> int:
        """Matrices this rank ran Newton-Schulz on so far (ZeRO 1-2 with Muon groups; 0 otherwise): host count."""
        return sum(side.orthogonalized for side in self.muon_sides)

    def _attach_stage_3(self, wrapper) -> None:
        self.flats = wrapper.fp32_partitioned_groups_flat
        self.calls = len(wrapper.fp16_groups)
        self.process_group = wrapper.dp_process_group
        self.offload = bool(wrapper.offload_optimizer)
        if self.offload and any(device != "cpu" for device in wrapper.subgroup_to_device.values()):
            raise ValueError("partial optimizer offload is not supported: offload every sub-group")
        self.group_of_call = [wrapper.sub_group_to_group_id[i] for i in range(self.calls)]
        # ZeRO-3 always takes its norm (fp64 per dtype, read on the host) and multiplies every partition by
        # 1 / (loss scale x clip) = 1: replaced by a constant and by nothing (clip 0 and no loss scale, checked)
        self.replaced["_get_norm_groups"] = lambda: [_HOST_ZERO]
        self.replaced["unscale_and_clip_grads"] = lambda sub_group_id, total_norm: None
        # the client optimizer's groups hold their sub-groups' partitions only while a step runs (DeepSpeed
        # empties them between calls); one list object per group, so FusedAdamW's plan stays valid across steps
        self.group_params = [[] for _ in self.optimizer.param_groups]
        for call, group in enumerate(self.group_of_call):
            self.group_params[group].append(self.flats[call])

    # ------------------------------------------------------------------------------------------
    # the state's size

    def state_bytes(self) -> int:
        """Bytes of FusedAdamW's state on this rank (moments in the state_precision, scales, `step`), counted by
        FusedAdamW.state_bytes over what its step sees: at ZeRO 1-3 this rank's flat fp32 partitions (DeepSpeed's
        padding included), at ZeRO-0 every param. What the state takes, or will take before the first step; in
        host memory under ZeRO-Offload (`offload`). Local: no collective."""
        with self._partitions_in_groups():
            return self.optimizer.state_bytes()

    def state_bytes_per_rank(self) -> list[int]:
        """state_bytes() of every rank of the data-parallel group, in rank order: one all_gather_object, a
        collective (every rank calls it, once: at the start, not per step)."""
        mine = self.state_bytes()
        ranks: list = [None] * dist.get_world_size(group=self.process_group)
        dist.all_gather_object(ranks, mine, group=self.process_group)
        return [int(n) for n in ranks]

    @contextlib.contextmanager
    def _partitions_in_groups(self):
        """FusedAdamW's groups hold their partitions: at ZeRO-3 only while this lasts (DeepSpeed empties them
        between calls); at ZeRO 1-2 (one flat partition per group) and ZeRO-0 they always do."""
        if self.stage != 3:
            yield
            return
        for group, params in zip(self.optimizer.param_groups, self.group_params):
            group["params"] = params
        try:
            yield
        finally:
            for group in self.optimizer.param_groups:
                group["params"] = []

    # ------------------------------------------------------------------------------------------
    # the step

    def _global_sumsq(self, local_sumsq: torch.Tensor, params: list) -> torch.Tensor:
        """The sum of squares over every rank's partitions: one all-reduce, on the device."""
        total = local_sumsq.float().sum()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.process_group)
        return total

    def _group_step(self, call: int) -> None:
        """What DeepSpeed's loop calls for group (ZeRO-3: sub-group) `call`: keeps its gradient partition; the
        last call of the engine step runs the one fused step."""
        if call != len(self.pending):
            raise RuntimeError(
                f"DeepSpeed stepped group {call} after {len(self.pending)} of {self.calls}: the integration "
                "expects the groups in order once per engine step (a DeepSpeed version it was not built for?)"
            )
        grad = self.flats[call].grad
        if grad is None:
            raise RuntimeError(f"DeepSpeed stepped group {call} without a gradient partition")
        self.pending.append((call, grad))
        if call < self.calls - 1:
            return
        try:
            self._fused_step()
        finally:
            self.pending = []

    def _fused_step(self) -> None:
        wrapper, fused = self.wrapper, self.optimizer
        for call, grad in self.pending:
            self.flats[call].grad = grad  # DeepSpeed dropped the earlier groups' (ZeRO 1-2 without offload)
        with self._partitions_in_groups():
            fused.step()
        self.engine_steps += 1
        # what engine.get_global_grad_norm() returns (the HF Trainer logs it as grad_norm): the fused step's norm,
        # a device view (read it when logging)
        wrapper._global_grad_norm = fused.grad_norm
        last = self.calls - 1
        for call, _ in self.pending[:last]:  # DeepSpeed copied these into the model before the update: again
            self._copy_to_model(call)
            if not self.offload:
                self.flats[call].grad = None
        if self.stage != 3:
            wrapper._lazy_init_hp_params_optimizer_state()

    def _copy_to_model(self, call: int) -> None:
        wrapper = self.wrapper
        if self.stage == 3:
            wrapper._reassign_or_swap_out_partitioned_parameters(call)
            return
        partition_id = dist.get_rank(group=wrapper.real_dp_process_group[call])
        bit16 = wrapper.parallel_partitioned_bit16_groups[call][partition_id]
        fp32 = self.flats[call]
        if self.offload:
            buffer = wrapper.param_buffer_of_bit16_for_cpu_offload_groups[call]
            buffer.data.copy_(fp32.data)
            bit16.data.copy_(buffer.data, non_blocking=True)
        else:
            bit16.data.copy_(fp32.data)
