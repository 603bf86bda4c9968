"""fused_stable: a fused, sync-free global-norm clip + AdamW (or Lion, or Muon) step, and training tools built on it."""

import os as _os
import sys as _sys

# FUSED_STABLE_BACKEND=interpret runs the Triton kernels through Triton's interpreter, which triton only
# honours if TRITON_INTERPRET is set before it is first imported: set it here, on that explicit request only.
# Once triton is imported it is too late (its own jit functions are compiled-mode already): leave it unset, so
# the backend check (ops.resolve_backend) says so clearly instead of the interpreter failing inside step().
if _os.environ.get("FUSED_STABLE_BACKEND", "").lower() == "interpret" and "triton" not in _sys.modules:
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from . import schedules  # noqa: E402
from .amp import GradScaler  # noqa: E402
from .clip import clip_grad_norm_  # noqa: E402
from .optimizers import *  # noqa: E402, F403  (OPTIMIZERS and one class per rule: the registry's __all__)
from .optimizers import __all__ as _optimizers
from .rules.muon.param_groups import muon_param_groups  # noqa: E402

__all__ = [*_optimizers, "GradScaler", "clip_grad_norm_", "muon_param_groups", "schedules"]
__version__ = "0.1.0"
