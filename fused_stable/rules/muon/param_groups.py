"""A model's trainable params split into one Muon group and one AdamW group, the usual way (Keller Jordan's recipe,
Moonlight, LLaMA-Factory): Muon for the 2-D weights of hidden layers, AdamW for everything else.

AdamW (`use_muon=False`) gets: every param that is not 2-D (biases, norms, conv weights); the embeddings (the
weights of nn.Embedding modules, the model's get_input_embeddings(), any param whose name contains "embed");
the output head (get_output_embeddings(), a module named `lm_head`, `output` or `head`, a weight tied to an
embedding); and LoRA factors (a name containing "lora_"), which LLaMA-Factory's v1 plugin also keeps off Muon.
Frozen params (requires_grad False) are left out; a tied param is seen once, so none is in two groups.

What LLaMA-Factory does (src/llamafactory/train/trainer_utils.py `_create_muon_optimizer`, third_party/muon, the
Moonlight variant): Muon for `param.ndim == 2 and "embed" not in name and "lm_head" not in name` (v1 also
excludes "wte", "wpe", "lora"); one lr and one weight decay for both sides (training_args.learning_rate and
weight_decay, also decaying biases and norms); the Muon lr adjusted as 0.2 * sqrt(max(A, B)) * lr (torch's
"match_rms_adamw"), so AdamW's lr can be reused; but its momentum is `buf = momentum * buf + g` (SGD's, not
torch's lerp), Nesterov `g + momentum * buf`, and Newton-Schulz divides by `norm + 1e-7`, not `norm.clamp(eps)`:
its updates are not torch.optim.Muon's, and this package follows torch's. To be closest to LLaMA-Factory, pass
`adjust_lr_fn="match_rms_adamw"` with `adamw_lr` left as `lr`.
"""

from __future__ import annotations

from torch import nn

from . import DEFAULTS, LR, WEIGHT_DECAY, check_muon_group

HEAD_NAMES = ("lm_head", "output", "head")  # the last part of the owning module's name


def _embedding_and_head_ids(model: nn.Module) -> set[int]:
    """The ids of the params that are embeddings or the output head, whatever their names."""
    found = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or name.rpartition(".")[2] in HEAD_NAMES:
            found.update(id(p) for p in module.parameters(recurse=False))
    for getter in ("get_input_embeddings", "get_output_embeddings"):  # transformers' PreTrainedModel
        try:
            module = getattr(model, getter)() if hasattr(model, getter) else None
        except NotImplementedError:
            module = None
        if module is not None:
            found.update(id(p) for p in module.parameters())
    return found


def is_muon_param(name: str, param, embedding_and_head_ids: set[int]) -> bool:
    """The split rule: a 2-D weight of a hidden layer (not an embedding, the head or a LoRA factor)."""
    return param.ndim == 2 and id(param) not in embedding_and_head_ids and "embed" not in name and "lora_" not in name


def muon_param_groups(
    model: nn.Module,
    *,
    lr: float = LR,
    adamw_lr: float | None = None,
    weight_decay: float = WEIGHT_DECAY,
    adamw_weight_decay: float | None = None,
    **muon_kwargs,
) -> list[dict]:
    """Two param groups for FusedMuon: `[{"params": hidden matrices, "use_muon": True, "lr": lr, "weight_decay":
    weight_decay, **muon_kwargs}, {"params": the rest, "use_muon": False, "lr": adamw_lr, "weight_decay":
    adamw_weight_decay}]` (adamw_lr and adamw_weight_decay default to lr and weight_decay, as LLaMA-Factory's
    one lr); `muon_kwargs` are torch.optim.Muon's other keywords (momentum, nesterov, ns_coefficients, eps,
    ns_steps, adjust_lr_fn). An empty group is left out."""
    unknown = sorted(set(muon_kwargs) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"muon_param_groups: unknown Muon keywords {unknown}; Muon takes {sorted(DEFAULTS)}")
    special = _embedding_and_head_ids(model)
    muon, adamw = [], []
    for name, param in model.named_parameters():  # a tied param is yielded once
        if param.requires_grad:
            (muon if is_muon_param(name, param, special) else adamw).append(param)
    muon_group = {"params": muon, "use_muon": True, "lr": lr, "weight_decay": weight_decay, **muon_kwargs}
    check_muon_group(muon_group)
    adamw_group = {
        "params": adamw,
        "use_muon": False,
        "lr": lr if adamw_lr is None else adamw_lr,
        "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
    }
    return [group for group in (muon_group, adamw_group) if group["params"]]
