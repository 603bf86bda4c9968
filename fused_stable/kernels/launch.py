"""Launching a kernel whose arguments a plan fixed: Triton's dispatcher once, then the compiled kernel directly.

Triton's JIT dispatcher (`kernel[grid](...)`) binds every argument, computes the specialisation key, looks
the compiled kernel up and re-checks the module globals the kernel read: 9-33 us of Python per launch. A
fused step launches the same kernels over the same table tensors every step, so a `PreparedLaunch` goes
through the dispatcher on its first call (which compiles or finds the kernel, and launches it) and keeps
the `CompiledKernel` it returns; later calls hand the arguments straight to that kernel's launcher (about
1 us). That is sound because everything the specialisation depends on is fixed when the plan is built:
table tensors allocated by the plan (always 16-byte aligned), integers (declared `do_not_specialize`, so
their value does not matter), flags and dtypes. The only arguments that change per step are pointers to a
loss scale, a found-inf flag or an externally reduced sum; the kernels declare them
`do_not_specialize_on_alignment`, the caller passes them as fp32 tensors, and the flags that say whether
they are present are part of the `variant` under which a compiled kernel is kept.

Under Triton's interpreter, or while a launch hook is installed (profilers such as proton read launches
through it), every call goes through the dispatcher.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from triton import knobs
from triton.runtime import driver


@dataclass(frozen=True)
class LaunchConfig:
    """How a kernel is launched: its block size (elements per loop iteration), warps, and fp contraction.

    `fp_fusion` is chosen per kernel, never left to Triton's default (which Triton 3.9 warns about and 3.10
    changes): whether `a * b + c` may become one fused multiply-add, rounded once. See each kernel module for
    why it matches torch's rounding.
    """

    block: int
    num_warps: int
    fp_fusion: bool

    def options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "enable_fp_fusion": self.fp_fusion}


def positional_args(fn, **values: Any) -> tuple:
    """Every argument of `fn` in signature order (defaults filled in): what a compiled kernel's launcher takes."""
    signature = _signatures.get(fn)
    if signature is None:
        signature = _signatures[fn] = inspect.signature(fn.fn)
    bound = signature.bind(**values)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


_signatures: dict = {}


class ArgTemplate:
    """A kernel's positional arguments, fixed once (`base`), with a few slots filled in per launch (`fill`)."""

    __slots__ = ("base", "index")

    def __init__(self, fn, **values: Any) -> None:
        self.base = positional_args(fn, **values)
        names = list(_signatures[fn].parameters)
        self.index = {name: names.index(name) for name in values}

    def fill(self, **dynamic: Any) -> tuple:
        values = list(self.base)
        for name, value in dynamic.items():
            values[self.index[name]] = value
        return tuple(values)


class PreparedLaunch:
    """One launch of `fn` over `grid` programs with the given options; see the module doc."""

    __slots__ = ("fn", "grid", "options", "_compiled")

    def __init__(self, fn, grid: int, config: LaunchConfig) -> None:
        self.fn = fn
        self.grid = grid
        self.options = config.options()
        self._compiled: dict[Hashable, Any] = {}

    def __call__(self, args: tuple, stream: int | None, variant: Hashable = None) -> None:
        """Launch with `args` (all of them, positional, see `positional_args`) on `stream`.

        `stream` None means: go through Triton's dispatcher (interpreter, launch hooks, no stream known).
        """
        direct = self._compiled.get(variant) if stream is not None else None
        if direct is not None:
            launcher, function, metadata, _ = direct
            launcher(self.grid, 1, 1, stream, function, metadata, None, None, None, *args)
            return
        compiled = self.fn[(self.grid,)](*args, **self.options)
        if compiled is not None and stream is not None:  # the interpreter returns None
            self._compiled[variant] = (compiled.run, compiled.function, compiled.packed_metadata, compiled)

    def compiled(self, variant: Hashable = None):
        """The CompiledKernel this launch goes to directly (None before its first call or under the interpreter)."""
        direct = self._compiled.get(variant)
        return direct[3] if direct is not None else None


def current_stream(device_index: int) -> int | None:
    """The raw stream the next launch on `device_index` goes to, or None where launches must be dispatched."""
    runtime = knobs.runtime
    if _INTERPRET or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
        return None
    return driver.active.get_current_stream(device_index)


_INTERPRET = knobs.runtime.interpret  # read from the environment once, as the @triton.jit decorators did


def _hooked(hook) -> bool:
    """Whether a launch hook is installed (Triton 3.9 keeps an always-present chain of them; older ones None)."""
    return hook is not None and bool(getattr(hook, "calls", True))
