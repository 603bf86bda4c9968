"""The optimizer steps the benchmark compares: every contender does the same math (global-norm clip 1.0 + AdamW).

A contender builds, for one list of params with grads, a zero-argument `step()` plus the optimizer it drives,
and names the memory passes its step makes, which the bytes model in `measure.py` turns into bytes per step.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 1e-2, 1.0
# GradScaler contenders run at scale 1 with growth off: torch's unscale_ rewrites the grads in place, so any other
# scale would shrink the stored grads step after step (to denormals, which are slow on CPU); the arithmetic and
# the memory traffic are the same at every scale.
SCALER_KW = dict(init_scale=1.0, growth_interval=10**9)


@dataclass
class Built:
    step: Callable[[], None]
    optimizer: torch.optim.Optimizer
    backend: str = ""


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    families: tuple  # param-set families it runs on
    passes: tuple  # memory passes of one step, in order (see measure.PASS_BYTES)
    build: Callable[[list, torch.device], Built]
    bytes_note: str = ""  # caveat on the bytes model, shown in the docs/markdown
    isolated: bool = False  # run in a time-boxed worker process (torch.compile)

    def unavailable(self, device: torch.device) -> str | None:
        """Why this contender cannot run here, or None."""
        if self.key == "apex":
            if device.type != "cuda":
                return "apex FusedAdam needs CUDA"
            if importlib.util.find_spec("apex") is None or importlib.util.find_spec("amp_C") is None:
                return "apex (with its amp_C extension) is not importable"
        if self.key.startswith("fused_stable"):
            try:
                import fused_stable  # noqa: F401
                from fused_stable import FusedAdamW  # noqa: F401
            except ImportError as e:
                return f"fused_stable.FusedAdamW is not importable: {e}"
        if self.key == "torch_compile" and not hasattr(torch, "compile"):
            return "this torch has no torch.compile"
        if self.key in _EIGHT_BIT_PACKAGES:
            package = _EIGHT_BIT_PACKAGES[self.key]
            if device.type != "cuda":  # GPU-plan contenders: their CPU paths are not what users run
                return f"{package} AdamW8bit is a GPU contender (runs on CUDA only here)"
            if importlib.util.find_spec(package) is None:
                return f"{package} is not installed (pip install {package})"
        return None


_EIGHT_BIT_PACKAGES = {"bnb_8bit": "bitsandbytes", "torchao_8bit": "torchao"}


def _clip(params):
    torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)


def _fused_stable_backend(opt) -> str:
    for attr in ("backend", "_backend"):
        value = getattr(opt, attr, None)
        if isinstance(value, str):
            return value
    return "auto"


def build_fused_stable(params, device):
    from fused_stable import FusedAdamW

    opt = FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM)
    return Built(opt.step, opt, backend=_fused_stable_backend(opt))


def build_fused_stable_bf16(params, device):
    from fused_stable import FusedAdamW

    opt = FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM, state_precision="bf16")
    return Built(opt.step, opt, backend=_fused_stable_backend(opt))


def build_fused_stable_8bit(params, device):
    from fused_stable import FusedAdamW

    opt = FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM, state_precision="8bit")
    return Built(opt.step, opt, backend=_fused_stable_backend(opt))


def _clip_then(opt, params, backend: str) -> Built:
    def step():
        _clip(params)
        opt.step()

    return Built(step, opt, backend=backend)


def build_bnb_8bit(params, device):
    """bitsandbytes' blockwise 8-bit AdamW (blocks of 256, tensors under 4096 elements kept fp32), torch's clip."""
    import bitsandbytes as bnb

    return _clip_then(bnb.optim.AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY), params, "bitsandbytes")


def build_torchao_8bit(params, device):
    """torchao's 8-bit AdamW (blockwise quantised subclass tensors, a torch.compile'd step per param), torch's clip."""
    from torchao.optim import AdamW8bit

    return _clip_then(AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY), params, "torchao")


def _build_torch_clip_adamw(params, implementation: str) -> Built:
    """torch's recipe: clip_grad_norm_(foreach) then AdamW with `implementation` ("fused" or "foreach")."""
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **{implementation: True})

    def step():
        _clip(params)
        opt.step()

    return Built(step, opt, backend=f"torch {implementation}")


def build_torch_fused(params, device):
    return _build_torch_clip_adamw(params, "fused")


def build_torch_foreach(params, device):
    return _build_torch_clip_adamw(params, "foreach")


def build_torch_compile(params, device):
    # A tensor lr (and capturable=True, which a tensor lr requires with foreach) keeps every per-step value on
    # the device, so the compiled graph is reused instead of recompiled for each new step count or lr.
    opt = torch.optim.AdamW(
        params, lr=torch.tensor(LR, device=device), weight_decay=WEIGHT_DECAY, foreach=True, capturable=True
    )

    def eager_step():
        _clip(params)
        opt.step()

    return Built(torch.compile(eager_step), opt, backend="inductor")


def build_apex(params, device):
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.optimizers import FusedAdam

    opt = FusedAdam(params, lr=LR, weight_decay=WEIGHT_DECAY, adam_w_mode=True)
    overflow = torch.zeros(1, dtype=torch.int, device=device)
    grads = [p.grad for p in params]

    def step():
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow, [grads], False)
        # multi_tensor_scale takes a host float (a sync); a foreach mul by the device coefficient does not.
        torch._foreach_mul_(grads, (MAX_NORM / (norm + 1e-6)).clamp(max=1.0))
        opt.step()

    return Built(step, opt, backend="apex")


def _init_scale(scaler, device):
    # A real loop calls scaler.scale(loss) before anything else; that call creates the scale tensor.
    scaler.scale(torch.ones((), device=device))


def build_torch_scaler(params, device):
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    scaler = torch.amp.GradScaler(device.type, **SCALER_KW)
    _init_scale(scaler, device)

    def step():
        scaler.unscale_(opt)
        _clip(params)
        scaler.step(opt)
        scaler.update()

    return Built(step, opt, backend="torch fused")


def build_fused_stable_scaler(params, device):
    from fused_stable import FusedAdamW, GradScaler

    opt = FusedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM)
    scaler = GradScaler(device.type, **SCALER_KW)
    _init_scale(scaler, device)

    def step():
        scaler.step(opt)
        scaler.update()

    return Built(step, opt, backend=_fused_stable_backend(opt))


_MAIN = ("dense", "lora")
CONTENDERS: dict[str, Contender] = {
    c.key: c
    for c in [
        Contender(
            "fused_stable",
            "fused_stable FusedAdamW(max_grad_norm=1)",
            _MAIN + ("sweep",),
            ("norm", "fused_update"),
            build_fused_stable,
        ),
        Contender(
            "torch_fused",
            "torch clip(foreach) + AdamW(fused)",
            _MAIN + ("sweep",),
            ("norm", "grad_rw", "fused_update"),
            build_torch_fused,
        ),
        Contender(
            "torch_foreach",
            "torch clip(foreach) + AdamW(foreach)",
            _MAIN,
            ("norm", "grad_rw", "foreach_update"),
            build_torch_foreach,
        ),
        Contender(
            "torch_compile",
            "torch.compile(clip + AdamW)",
            _MAIN,
            ("norm", "fused_update"),
            build_torch_compile,
            bytes_note="floor (inductor fusing the clip scale into the update); the compiled code may move more",
            isolated=True,
        ),
        Contender("apex", "apex l2norm + FusedAdam", _MAIN, ("norm", "grad_rw", "fused_update"), build_apex),
        # the precision axis (issue 22): the same step with bf16 and 8-bit moments, and the 8-bit AdamWs users have
        Contender(
            "fused_stable_bf16",
            'fused_stable FusedAdamW(max_grad_norm=1, state_precision="bf16")',
            _MAIN,
            ("norm", "fused_update"),
            build_fused_stable_bf16,
        ),
        Contender(
            "fused_stable_8bit",
            'fused_stable FusedAdamW(max_grad_norm=1, state_precision="8bit")',
            _MAIN,
            ("norm", "fused_update"),
            build_fused_stable_8bit,
        ),
        Contender(
            "bnb_8bit",
            "torch clip(foreach) + bitsandbytes AdamW8bit",
            _MAIN,
            ("norm", "grad_rw", "fused_update"),
            build_bnb_8bit,
            bytes_note="floor: one pass over codes and scales; its lookup tables and per-tensor launches are not bytes",
        ),
        Contender(
            "torchao_8bit",
            "torch clip(foreach) + torchao AdamW8bit",
            _MAIN,
            ("norm", "grad_rw", "fused_update"),
            build_torchao_8bit,
            bytes_note="floor (one compiled pass per param over codes and scales)",
            isolated=True,
        ),
        Contender(
            "torch_scaler",
            "torch GradScaler: unscale_, clip, step, update",
            ("amp",),
            ("grad_rw", "norm", "grad_rw", "fused_update"),
            build_torch_scaler,
        ),
        Contender(
            "fused_stable_scaler",
            "fused_stable GradScaler + FusedAdamW(max_grad_norm=1)",
            ("amp",),
            ("norm", "fused_update"),
            build_fused_stable_scaler,
        ),
    ]
}

# The reference each set's speedups are measured against: torch's fused AdamW after a foreach clip.
BASELINE = {"amp": "torch_scaler"}
DEFAULT_BASELINE = "torch_fused"


def runs_exact_reference(optimizer) -> bool:
    """Whether a stepped fused_stable optimizer updates some tensors with the exact tensor reference
    (backends/torch/exact_reference.py: bf16 / 8-bit state where the compiled CPU update cannot run, 55-75x slower
    than the fp32 step). Read from the plan the step cached."""
    from fused_stable.backends.torch.exact_reference import ExactUpdate

    cached = getattr(optimizer, "last_tables", None)  # the latest step's backend plan (optim.py)
    return any(type(update) is ExactUpdate for update in getattr(cached, "updates", ()))


def baseline_for(family: str) -> str:
    return BASELINE.get(family, DEFAULT_BASELINE)


def contenders_for(family: str) -> list[Contender]:
    return [c for c in CONTENDERS.values() if family in c.families]
