"""Parameter sets the benchmark steps over: shapes (pure data) and their materialisation as params with grads.

A `ParamSetSpec` is plain data (JSON-serialisable) so a worker process can rebuild exactly the same tensors
from it; `materialize` turns it into leaf parameters with gradients on a device.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ParamSetSpec:
    name: str  # row key, e.g. "dense-fp32"
    family: str  # "dense" | "lora" | "amp" | "sweep"
    dtype: str  # key of DTYPES: the params' (and grads') dtype
    shapes: tuple = field(repr=False)
    description: str = ""

    @property
    def n_tensors(self) -> int:
        return len(self.shapes)

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def to_json(self) -> dict:
        d = asdict(self)
        d["shapes"] = [list(s) for s in self.shapes]
        return d

    @classmethod
    def from_json(cls, d: dict) -> ParamSetSpec:
        return cls(
            name=d["name"],
            family=d["family"],
            dtype=d["dtype"],
            shapes=tuple(tuple(s) for s in d["shapes"]),
            description=d.get("description", ""),
        )


def llama_shapes(hidden: int, intermediate: int, layers: int, vocab: int, kv_dim: int) -> list[tuple]:
    """Weight shapes of a Llama-style decoder (GQA attention, SwiGLU MLP, RMSNorm, untied embeddings)."""
    shapes: list[tuple] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [
            (hidden, hidden),
            (kv_dim, hidden),
            (kv_dim, hidden),
            (hidden, hidden),  # q k v o
            (intermediate, hidden),
            (intermediate, hidden),
            (hidden, intermediate),  # gate up down
            (hidden,),
            (hidden,),
        ]  # two RMSNorms
    shapes += [(hidden,), (vocab, hidden)]  # final norm, lm_head
    return shapes


def lora_shapes(hidden: int, intermediate: int, layers: int, rank: int) -> list[tuple]:
    """LoRA A/B adapter shapes on all seven linear layers of a Llama block: 14 tensors per layer."""
    io = [
        (hidden, hidden),
        (hidden, hidden),
        (hidden, hidden),
        (hidden, hidden),  # q k v o (in, out)
        (hidden, intermediate),
        (hidden, intermediate),
        (intermediate, hidden),
    ]  # gate up down
    shapes: list[tuple] = []
    for _ in range(layers):
        for d_in, d_out in io:
            shapes += [(rank, d_in), (d_out, rank)]  # lora_A.weight, lora_B.weight
    return shapes


def sweep_shapes(total: int, n_tensors: int = 32) -> list[tuple]:
    """`n_tensors` equal 2-D tensors totalling about `total` elements: cost against size at a fixed tensor count."""
    per = max(1, total // n_tensors)
    cols = 1024 if per >= 1024 else per
    return [(max(1, per // cols), cols)] * n_tensors


def scale_shapes(shapes: list[tuple], factor: float) -> list[tuple]:
    """Shrink (or grow) every tensor by about `factor` in elements, keeping the tensor count and the rank."""
    if factor == 1.0:
        return list(shapes)
    out = []
    for s in shapes:
        per_dim = factor ** (1.0 / len(s))
        out.append(tuple(max(1, round(d * per_dim)) for d in s))
    return out


# Plans: which parameter sets a run covers. Sizes are chosen so a CPU run of the whole plan aims at 4 minutes on
# 2 idle cores (with the time budget per row, cli.PLAN_DEFAULTS), and a GPU run covers 1M to 1B+ parameters
# inside gpu_check.sh's time budget.
def plan_sets(plan: str, size_scale: float = 1.0) -> list[ParamSetSpec]:
    if plan == "gpu":
        dense = llama_shapes(hidden=2048, intermediate=5632, layers=8, vocab=32000, kv_dim=512)
        lora = lora_shapes(hidden=4096, intermediate=11008, layers=32, rank=16)
        sweep = [2**20, 2**24, 2**27, 2**30]
        dense_desc = "Llama-style, hidden 2048, 8 layers, vocab 32000"
        lora_desc = "LoRA r=16 on q,k,v,o,gate,up,down of a Llama-7B shape, 32 layers"
    elif plan == "cpu":
        dense = llama_shapes(hidden=768, intermediate=2048, layers=2, vocab=8192, kv_dim=192)
        lora = lora_shapes(hidden=4096, intermediate=11008, layers=32, rank=8)
        sweep = [2**18, 2**20, 2**22, 2**24]
        dense_desc = "Llama-style, hidden 768, 2 layers, vocab 8192"
        lora_desc = "LoRA r=8 on q,k,v,o,gate,up,down of a Llama-7B shape, 32 layers"
    elif plan == "smoke":
        dense = llama_shapes(hidden=64, intermediate=176, layers=2, vocab=256, kv_dim=16)
        lora = lora_shapes(hidden=64, intermediate=176, layers=4, rank=4)
        sweep = [2**12, 2**14]
        dense_desc = "Llama-style, hidden 64, 2 layers (smoke)"
        lora_desc = "LoRA r=4, 4 layers (smoke)"
    else:
        raise ValueError(f"unknown plan {plan!r}; expected one of: cpu, gpu, smoke")

    if not size_scale > 0:
        raise ValueError(f"--size-scale must be > 0, got {size_scale}")
    dense = scale_shapes(dense, size_scale)
    lora = scale_shapes(lora, size_scale)
    sets = [
        ParamSetSpec("dense-fp32", "dense", "fp32", tuple(dense), dense_desc + ", fp32 params"),
        ParamSetSpec("dense-bf16", "dense", "bf16", tuple(dense), dense_desc + ", bf16 params"),
        ParamSetSpec("lora-fp32", "lora", "fp32", tuple(lora), lora_desc + ", fp32 adapters"),
        ParamSetSpec(
            "amp-fp16", "amp", "fp32", tuple(dense), dense_desc + ", fp32 params under fp16 AMP (GradScaler recipe)"
        ),
    ]
    for total in sweep:
        n = max(1, round(total * size_scale))
        label = f"{n / 2**30:.3g}G" if n >= 2**30 else f"{n / 2**20:.3g}M" if n >= 2**20 else f"{n / 2**10:.3g}K"
        sets.append(
            ParamSetSpec(
                f"sweep-{label}",
                "sweep",
                "fp32",
                tuple(sweep_shapes(n)),
                f"size sweep: 32 equal fp32 tensors, {n:,} params",
            )
        )
    return sets


def materialize(spec: ParamSetSpec, device: torch.device, seed: int = 0) -> list[torch.nn.Parameter]:
    """Leaf params (~N(0, 0.02)) with grads whose global L2 norm is about 5, so a clip at 1.0 is active."""
    dtype = DTYPES[spec.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    grad_std = 5.0 / math.sqrt(max(1, spec.n_params))
    params = []
    for shape in spec.shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen).mul_(0.02).to(dtype))
        p.grad = torch.randn(shape, device=device, generator=gen).mul_(grad_std).to(dtype)
        params.append(p)
    return params


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
