"""FusedMuon: Muon for the hidden matrices and AdamW for the rest, in one step with one global-norm clip, one
non-finite / spike decision and the lr schedule, all on the device.

Every param group says `use_muon=True` (2-D matrices: torch.optim.Muon's keywords and defaults) or `use_muon=False`
(torch.optim.AdamW's keywords and defaults); `fused_stable.muon_param_groups(model)` splits a model the usual way.
A step is the fused step of FusedOptimizer over every group, in which the Muon groups have no rule
(`group_rule` None): their grads take part in the norm pass and the decision kernel (one norm over the whole
model, one clip coefficient, one skip), AdamW updates the rest; then MuonSide (rules/muon/torch.py) updates the
Muon groups from the same decisions, read as 0-dim device tensors (the clip multiplier before the momentum, the
skip, the lr factor): no host read. A skipped step leaves every param and momentum buffer bit-identical.

Not yet: Muon groups under FSDP2 or DeepSpeed ZeRO (Newton-Schulz needs the whole matrix: refused in one line),
8-bit momentum buffers (fp32, the param's dtype as torch's, or bf16 with state_precision="bf16"), tensor lrs in
Muon groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from . import layout
from .optim import FusedOptimizer, adamw_defaults
from .rules import RULES
from .rules import muon as muon_rule
from .rules.muon.torch import MuonSide
from .sharding import is_dtensor

# a Muon group's state_precision -> its momentum buffers' dtype (None: the param's, as torch.optim.Muon's); bf16
# rounds to nearest (momentum 0.95 moves a buffer 5% of g - buf a step, over half a bf16 ulp unless g is within 8%)
MOMENTUM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


class FusedMuon(FusedOptimizer):
    """Muon (torch.optim.Muon's update) for the groups with `use_muon=True`, AdamW for those with `use_muon=False`,
    with the global grad-norm clip over both, the non-finite / spike skip and the lr schedule fused on the device.

    Args:
        param_groups: param-group dicts, each with `use_muon`. Muon groups take `lr, weight_decay, momentum,
            nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn` (torch.optim.Muon's, same defaults: lr 1e-3,
            weight_decay 0.1, momentum 0.95, nesterov True, 5 steps, adjust_lr_fn None = "original"); AdamW
            groups `lr, betas, eps, weight_decay, amsgrad, maximize` (torch.optim.AdamW's defaults).
        max_grad_norm, clip, zscore_alpha, zscore_threshold, zscore_warmup, spike_skip_threshold,
        spike_skip_ratio, lr_schedule, master_weights, state_precision, capturable, backend: as FusedAdamW, for the
            whole step; master_weights applies to the AdamW groups; state_precision to the AdamW groups' moments and
            the Muon groups' momentum buffers ("fp32": the param's dtype, as torch's; "bf16"; "8bit" for AdamW
            only: a Muon group with it is refused, saying so).
    """

    RULE = RULES["adamw"]

    def __init__(
        self,
        param_groups: Iterable[dict[str, Any]],
        *,
        max_grad_norm: float | None = None,
        **step_options: Any,
    ) -> None:
        groups = list(param_groups)
        if not groups or not all(isinstance(group, dict) for group in groups):
            raise TypeError(
                "FusedMuon takes param-group dicts, each with use_muon=True (2-D hidden matrices) or False (the "
                "rest): fused_stable.muon_param_groups(model) splits a model the usual way"
            )
        defaults = adamw_defaults(1e-3, (0.9, 0.999), 1e-8, 1e-2, False, False, None, None, False)
        self._sides: tuple | None = None  # (plan, hyper-parameter key, MuonSide) of the last step
        super().__init__(groups, defaults, max_grad_norm=max_grad_norm, **step_options)

    def group_rule(self, group: dict):
        return None if group.get("use_muon") else self.RULE

    def check_group(self, group: dict) -> None:
        if not isinstance(group.get("use_muon"), bool):
            raise ValueError(
                f"every param group of FusedMuon says use_muon=True (Muon: 2-D hidden matrices) or use_muon=False "
                f"(AdamW: embeddings, head, norms, biases); got use_muon={group.get('use_muon', 'missing')!r}: "
                "fused_stable.muon_param_groups(model) splits a model the usual way"
            )
        if not group["use_muon"]:
            self.RULE.check_group(group, self.defaults)
            return
        for key, default in muon_rule.DEFAULTS.items():
            group.setdefault(key, default)
        muon_rule.check_muon_group(group)
        precision = group.get("state_precision", self.defaults.get("state_precision", "fp32"))
        if precision not in MOMENTUM_DTYPES:
            raise ValueError(
                f"a Muon group's momentum buffers are kept in fp32 (the param's dtype, as torch's) or bf16, not "
                f"{precision!r} (8-bit Muon momentum is not built yet): give the Muon group state_precision='bf16' "
                "or 'fp32' (the AdamW groups keep theirs)"
            )
        if any(is_dtensor(p) for p in group["params"]):
            raise ValueError(
                "FusedMuon's Muon groups do not run under FSDP2 yet: Newton-Schulz needs each whole matrix, a "
                "DTensor param holds a shard; put these params in an AdamW group (use_muon=False) or use FusedAdamW"
            )

    def _init_group(self, tensors: list, grads: list, lrs: list) -> int:
        raise RuntimeError(
            "FusedMuon's step does not run inside torch.compile yet (its Muon groups are updated after the fused "
            "op): call opt.step() outside the compiled function"
        )

    def _fused_step(self) -> None:
        super()._fused_step()
        plan = self._plan
        if plan is None or all(plan.updated):
            return
        side = self._side(plan)
        fstate = self._fstate
        grads = [p.grad for p in side.params]
        side.step(grads, fstate[layout.F_GRAD_MUL], fstate[layout.F_SKIP], fstate[layout.F_LR_FACTOR])

    def _side(self, plan) -> MuonSide:
        """The Muon groups' side for this plan and their hyper-parameters (base lrs: the schedule's factor comes
        from the decisions), built anew when either changed (no tensor work); momentum buffers created here."""
        groups = self.param_groups
        base_lrs = self.base_lrs()
        key = tuple(
            (base_lrs[g], *(groups[g][k] for k in muon_rule.DEFAULTS if k != "lr"))
            for g in range(len(groups))
            if groups[g].get("use_muon")
        )
        cached = self.__dict__.get("_sides")  # (absent after unpickling: built again)
        if cached is not None and cached[0] is plan and cached[1] == key:
            return cached[2]
        members = [i for i, updated in enumerate(plan.updated) if not updated]
        params = [plan.params[i] for i in members]
        hparams = [{**groups[plan.groups[i]], "lr": base_lrs[plan.groups[i]]} for i in members]
        buffers = []
        for i, p in zip(members, params):
            state = self.state[p]
            if "momentum_buffer" not in state:  # torch's: zeros like the param (its dtype); bf16 when asked for
                dtype = MOMENTUM_DTYPES[groups[plan.groups[i]]["state_precision"]] or p.dtype
                state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            buffers.append(state["momentum_buffer"])
        side = MuonSide(params, buffers, hparams)
        self._sides = (plan, key, side)
        return side
