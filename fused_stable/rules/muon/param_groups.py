"""A model's trainable params split into one Muon group and one AdamW group, the usual way (Keller Jordan's recipe,
Moonlight, LLaMA-Factory): Muon for the 2-D weights of hidden layers, AdamW for everything else, with the reason
for each param recorded in its group (`group["reasons"]`, one per param, what `FusedMuon.describe()` counts).

Muon gets: the 2-D weights of hidden layers ("hidden matrix"); the 3-D expert stacks of transformers 5's MoE
layers ("3-D expert": experts x out x in, a param whose name says `expert`, Newton-Schulz per expert; with
`expert_stacks=False` they go to AdamW for that reason); and, with `muon_lora=True` (ms-swift's split), the 2-D
LoRA factors ("LoRA factor": A is r x in, B is out x r, each a matrix for Newton-Schulz).
AdamW gets, with its reason: every param of at most one dimension ("1-D": biases, norms, DoRA's magnitude); the
weights of convolution modules ("conv weight"); the embeddings ("embedding": nn.Embedding modules, the model's
get_input_embeddings(), any param whose name contains "embed"); the output head ("head": get_output_embeddings(),
a module named `lm_head`, `output` or `head`, a weight tied to an embedding counts as the embedding); LoRA factors
(a name containing "lora_"), which LLaMA-Factory's v1 plugin also keeps off Muon, unless `muon_lora=True` (the
factors of an embedding or head stay there, as ms-swift's name test keeps them); any other param of 3 or more
dimensions ("other": not a matrix and not an expert stack).
Frozen params (requires_grad False) are left out; a tied param is seen once, so none is in two groups.

What LLaMA-Factory does (src/llamafactory/train/trainer_utils.py `_create_muon_optimizer`, third_party/muon, the
Moonlight variant): Muon for `param.ndim == 2 and "embed" not in name and "lm_head" not in name` (v1 also
excludes "wte", "wpe", "lora"); one lr and one weight decay for both sides (training_args.learning_rate and
weight_decay, also decaying biases and norms); the Muon lr adjusted as 0.2 * sqrt(max(A, B)) * lr (torch's
"match_rms_adamw"), so AdamW's lr can be reused; but its momentum is `buf = momentum * buf + g` (SGD's, not
torch's lerp), Nesterov `g + momentum * buf`, and Newton-Schulz divides by `norm + 1e-7`, not `norm.clamp(eps)`:
its updates are not torch.optim.Muon's, and this package follows torch's. To be closest to LLaMA-Factory, pass
`adjust_lr_fn="match_rms_adamw"` with `adamw_lr` left as `lr`. ms-swift (swift/plugin/optimizer.py
`create_muon_optimizer`, Moonlight's Muon) takes every `ndim >= 2` param whose name has neither the embedding's
nor the head's key, LoRA factors included: `muon_lora=True`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from . import DEFAULTS, LR, WEIGHT_DECAY, check_muon_group

HEAD_NAMES = ("lm_head", "output", "head")  # the last part of the owning module's name

# why a param is where it is: muon_param_groups records one per param (group["reasons"]), describe() counts them
HIDDEN = "hidden matrix"
EXPERT = "3-D expert"
LORA = "LoRA factor"
ONE_D = "1-D"
EMBEDDING = "embedding"
HEAD = "head"
CONV = "conv weight"
OTHER = "other"
CALLERS = "caller's group"  # a group built by hand, without recorded reasons: its params are where it put them


def _roles(model: nn.Module) -> dict[int, str]:
    """The ids of the params whose module makes them an embedding, the output head or a conv weight, whatever their
    names (an embedding tied to the head stays an embedding)."""
    roles: dict[int, str] = {}
    getters = (("get_input_embeddings", EMBEDDING), ("get_output_embeddings", HEAD))  # transformers' PreTrainedModel
    for getter, role in getters:
        try:
            module = getattr(model, getter)() if hasattr(model, getter) else None
        except NotImplementedError:
            module = None
        if module is not None:
            for p in module.parameters():
                roles.setdefault(id(p), role)
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            role = EMBEDDING
        elif isinstance(module, nn.modules.conv._ConvNd):
            role = CONV
        elif name.rpartition(".")[2] in HEAD_NAMES:
            role = HEAD
        else:
            continue
        for p in module.parameters(recurse=False):
            roles.setdefault(id(p), role)
    return roles


def placement(name: str, param, roles: dict[int, str], *, muon_lora: bool = False, expert_stacks: bool = True):
    """The split rule for one trainable param: (on Muon, why), `roles` being `_roles(model)`."""
    if param.ndim <= 1:
        return False, ONE_D
    role = roles.get(id(param))
    if role == CONV:
        return False, CONV
    if role == EMBEDDING or "embed" in name:
        return False, EMBEDDING
    if role == HEAD:
        return False, HEAD
    if "lora_" in name:
        return muon_lora and param.ndim == 2, LORA
    if param.ndim == 3 and "expert" in name:  # transformers 5's MoE layout: experts x out x in
        return expert_stacks, EXPERT
    if param.ndim == 2:
        return True, HIDDEN
    return False, OTHER


def muon_param_groups(
    model: nn.Module,
    *,
    lr: float = LR,
    adamw_lr: float | None = None,
    weight_decay: float = WEIGHT_DECAY,
    adamw_weight_decay: float | None = None,
    muon_lora: bool = False,
    expert_stacks: bool = True,
    **muon_kwargs,
) -> list[dict]:
    """Two param groups for FusedMuon: `[{"params": hidden matrices, "use_muon": True, "lr": lr, "weight_decay":
    weight_decay, **muon_kwargs}, {"params": the rest, "use_muon": False, "lr": adamw_lr, "weight_decay":
    adamw_weight_decay}]` (adamw_lr and adamw_weight_decay default to lr and weight_decay, as LLaMA-Factory's
    one lr); `muon_kwargs` are torch.optim.Muon's other keywords (momentum, nesterov, ns_coefficients, eps,
    ns_steps, adjust_lr_fn). `muon_lora=True` puts the 2-D LoRA factors on Muon (ms-swift's split; default:
    AdamW, LLaMA-Factory's); `expert_stacks=False` keeps 3-D expert stacks on AdamW. Each group's "reasons"
    says why each of its params is there (the module docstring's words). An empty group is left out."""
    unknown = sorted(set(muon_kwargs) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"muon_param_groups: unknown Muon keywords {unknown}; Muon takes {sorted(DEFAULTS)}")
    roles = _roles(model)
    muon, adamw = ([], []), ([], [])  # (params, reasons)
    for name, param in model.named_parameters():  # a tied param is yielded once
        if param.requires_grad:
            on_muon, reason = placement(name, param, roles, muon_lora=muon_lora, expert_stacks=expert_stacks)
            side = muon if on_muon else adamw
            side[0].append(param)
            side[1].append(reason)
    muon_group = {"params": muon[0], "use_muon": True, "lr": lr, "weight_decay": weight_decay, **muon_kwargs}
    check_muon_group(muon_group)
    muon_group["reasons"] = muon[1]
    adamw_group = {
        "params": adamw[0],
        "use_muon": False,
        "lr": lr if adamw_lr is None else adamw_lr,
        "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        "reasons": adamw[1],
    }
    return [group for group in (muon_group, adamw_group) if group["params"]]


def _matrices(param, reason: str, side: str) -> int:
    """The 2-D matrices a param is: one for a 2-D param, its experts for an expert stack (or any 3-D param a Muon
    group holds: FusedMuon steps it as a stack), none otherwise (vectors, conv kernels)."""
    if param.ndim == 2:
        return 1
    return param.shape[0] if param.ndim == 3 and (reason == EXPERT or side == "muon") else 0


def describe_groups(param_groups: Sequence[dict], names: Sequence[str] | None = None, per_param: bool = False) -> dict:
    """What took Muon and what AdamW, and why, from FusedMuon's param groups (FusedMuon.describe()): per side the
    tensors, the matrices (Muon: a 3-D stack counts its experts) and the params (elements), and per reason the
    tensors and params; with `per_param`, a list of every param's name (from `names`, else its index), shape,
    side and reason. A group without "reasons" (built by hand) gives its params the reason "caller's group"."""
    summary = {side: {"tensors": 0, "matrices": 0, "params": 0, "reasons": {}} for side in ("muon", "adamw")}
    listed = []
    index = 0
    for group in param_groups:
        side = "muon" if group.get("use_muon") else "adamw"
        reasons = group.get("reasons")
        if reasons is None or len(reasons) != len(group["params"]):
            reasons = [CALLERS] * len(group["params"])
        for p, reason in zip(group["params"], reasons):
            counts = summary[side]
            counts["tensors"] += 1
            counts["matrices"] += _matrices(p, reason, side)
            counts["params"] += p.numel()
            held = counts["reasons"].setdefault(reason, {"tensors": 0, "params": 0})
            held["tensors"] += 1
            held["params"] += p.numel()
            if per_param:
                name = names[index] if names is not None else str(index)
                listed.append({"name": name, "shape": list(p.shape), "side": side, "reason": reason})
            index += 1
    if per_param:
        summary["each"] = listed
    return summary
