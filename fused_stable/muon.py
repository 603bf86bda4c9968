"""FusedMuon: Muon for the hidden matrices and AdamW for the rest, in one step with one global-norm clip, one
non-finite / spike decision and the lr schedule, all on the device.

Every param group says `use_muon=True` (2-D matrices, or 3-D stacks of them such as MoE experts x out x in, each
expert its own matrix: torch.optim.Muon's keywords and defaults) or `use_muon=False` (torch.optim.AdamW's keywords
and defaults); `fused_stable.muon_param_groups(model)` splits a model the usual way and records why each param is
where it is, which `describe()` counts (what took Muon, what AdamW, and for what reason).
A step is the fused step of FusedOptimizer over every group: Muon is a matrix rule (rules/muon), so its groups take
part in the norm pass and the decision kernel (one norm over the whole model, one clip coefficient, one skip) and
are updated right after the update pass from the same decisions (fused_stable/matrix_step.py, rules/muon/matrix.py:
the clip multiplier before the momentum, the skip, the lr factor, as 0-dim device tensors): no host read. AdamW
updates the rest. A skipped step leaves every param and momentum buffer bit-identical.

Not yet: Muon groups under FSDP2 or DeepSpeed ZeRO (Newton-Schulz needs the whole matrix: refused in one line),
8-bit momentum buffers (fp32, the param's dtype as torch's, or bf16 with state_precision="bf16"), tensor lrs in
Muon groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .optim import FusedOptimizer
from .rules import RULES
from .rules.muon.param_groups import describe_groups


class FusedMuon(FusedOptimizer):
    """Muon (torch.optim.Muon's update) for the groups with `use_muon=True`, AdamW for those with `use_muon=False`,
    with the global grad-norm clip over both, the non-finite / spike skip and the lr schedule fused on the device.
    A 3-D param of a Muon group is a stack of matrices (experts x out x in): each expert is stepped exactly as
    torch.optim.Muon steps a 2-D param of its shape (its own Newton-Schulz, lr adjusted by its out x in).
    `describe()` says how many matrices and params each side took, and why.

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

    RULE = RULES["adamw"]  # the AdamW groups'
    MATRIX_RULE = RULES["muon"]  # the Muon groups'

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
        defaults = self.RULE.defaults()  # torch.optim.AdamW's, for the AdamW groups
        super().__init__(groups, defaults, max_grad_norm=max_grad_norm, **step_options)

    def describe(self, per_param: bool = False) -> dict:
        """What took Muon and what AdamW, and why: `{"muon": {...}, "adamw": {...}}`, each with its `tensors`,
        `matrices` (a 3-D expert stack counts its experts) and `params` (elements), and `reasons`: for each reason
        ("hidden matrix", "3-D expert", "LoRA factor" on Muon; "1-D", "embedding", "head", "LoRA factor", "conv
        weight", "3-D expert", "other" on AdamW; "caller's group" for a group built without muon_param_groups'
        reasons) its tensors and params. `per_param=True` adds `each`: every param's name (`param_names` when
        set, else its index), shape, side and reason."""
        return describe_groups(self.param_groups, self.param_names, per_param)

    def group_rule(self, group: dict):
        return self.MATRIX_RULE if group.get("use_muon") else self.RULE

    def check_group(self, group: dict) -> None:
        if not isinstance(group.get("use_muon"), bool):
            raise ValueError(
                f"every param group of FusedMuon says use_muon=True (Muon: 2-D hidden matrices) or use_muon=False "
                f"(AdamW: embeddings, head, norms, biases); got use_muon={group.get('use_muon', 'missing')!r}: "
                "fused_stable.muon_param_groups(model) splits a model the usual way"
            )
        super().check_group(group)
