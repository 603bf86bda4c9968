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

Under FSDP2 (Shard(0) DTensor params, as `fully_shard` leaves them) the momentum buffers are sharded like their
params and the elementwise work runs on each rank's rows; each matrix has one owner rank (assigned once by Newton-
Schulz work: costliest first, to the least loaded rank), which receives every rank's rows of the matrix's direction
(bf16), runs Newton-Schulz on the matrices it owns (batched by shape) and sends each rank its rows of the result:
two all-to-alls per batch of same-shaped matrices per step (fused_stable/matrix_exchange.py). Without an active clip
this is the one-process step bit for bit; a placement other than Shard(0) or Replicate is refused in one line.

Under DeepSpeed: ZeRO 0-2 through fused_stable.integrations.deepspeed (at ZeRO 1-2 each matrix is rebuilt whole on
one owner rank for Newton-Schulz, integrations/deepspeed_muon.py); ZeRO-3 and ZeRO-Offload refused in one line.

Momentum buffers: fp32 (the param's dtype, as torch's), bf16 (state_precision="bf16"), or 8-bit
(state_precision="8bit": AdamW exp_avg's signed blockwise codes under `momentum_buffer`, their block scales under
`momentum_buffer_scale`, decoded to fp32 for each step and encoded once: rules/muon/lowbit.py); 8-bit runs in one
process (tested), and DDP and ZeRO-0 hand it whole params as one process does (not tested there); its blocks run
over whole matrices: refused in one line under FSDP2 and ZeRO 1-2.

`torch.compile(opt.step)` runs the Muon groups inside the compiled step's op (compiled.py), the same bits as eager.

Newton-Schulz runs in bf16 as torch's, but in fp32 on a CPU without native bf16 products, where torch's bf16
matmul is several times slower (rules/muon/newton_schulz.py); on a CPU whose bf16 products do not run on AMX its
symmetric Gram products run by blocks above the diagonal (fewer products, the same dot products);
`describe()["newton_schulz"]` says which dtype, how many matrices go by blocks, and why.

Not yet: tensor lrs in Muon groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .optim import FusedOptimizer
from .rules import RULES
from .rules.muon.newton_schulz import gram_blocks_choice, newton_schulz_choice, newton_schulz_dtype, row_blocked
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
            the Muon groups' momentum buffers ("fp32": the param's dtype, as torch's; "bf16"; "8bit": int8 codes
            and fp32 block scales for a matrix of at least 4096 elements, fp32 below, as AdamW's moments).
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
        set, else its index), shape, side and reason. `newton_schulz`: the dtype Newton-Schulz runs in on the Muon
        params' device ("bf16", torch's, or "fp32" on a CPU without native bf16 products) and why, and
        `gram_blocks`: how many Muon matrices run their Gram products by row blocks, and why (`blocks_why`)."""
        summary = describe_groups(self.param_groups, self.param_names, per_param)
        muon = [p for group in self.param_groups if group.get("use_muon") for p in group["params"]]
        device = muon[0].device if muon else "cpu"
        dtype, why = newton_schulz_choice(device)
        blocks, blocks_why = gram_blocks_choice(device, newton_schulz_dtype(device))
        # counted as describe_groups counts matrices: a DeepSpeed flat partition is none
        matrices = [p for p in muon if p.ndim in (2, 3)]
        blocked = sum(p.shape[0] if p.ndim == 3 else 1 for p in matrices if blocks and row_blocked(p.shape))
        summary["newton_schulz"] = {"dtype": dtype, "why": why, "gram_blocks": blocked, "blocks_why": blocks_why}
        return summary

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
