"""GradScaler that leaves the inf/NaN check to FusedAdamW's fused norm pass.

torch.amp.GradScaler.step() runs its own pass over every gradient (`_amp_foreach_non_finite_check_and_unscale_`)
before it calls an optimizer that handles scaling itself. FusedAdamW already divides by the scale and tests
for non-finite values while it computes the global norm, so this subclass hands it the scale, lets it decide,
and records the optimizer's own device-side found-inf flag for update(): fp16 training then costs no more
passes over gradient memory than fp32. Scale arithmetic (growth, back-off, interval) is torch's, unchanged;
neither step() nor update() reads the device. With any other optimizer, or after an explicit unscale_(),
it behaves exactly as torch.amp.GradScaler.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp.grad_scaler import OptState


class GradScaler(torch.amp.GradScaler):
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled or not hasattr(optimizer, "last_step_found_inf"):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        # torch.amp is on dynamo's skip list: what follows calls none of GradScaler's own methods, so that a
        # compiled function (even fullgraph=True) can hold scaler.step(opt)
        if self._scale is None or self._growth_tracker is None:
            raise AssertionError(
                "Attempted step but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration."
            )
        states = self._per_optimizer_states
        key = id(optimizer)
        if key not in states:
            states[key] = {"stage": OptState.READY, "found_inf_per_device": {}}
        optimizer_state = states[key]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if optimizer_state["stage"] is OptState.UNSCALED:
            # unscale_() already divided the grads and found the infs: torch's path, no double unscale
            return super().step(optimizer, *args, **kwargs)

        scale = self._scale
        optimizer.grad_scale = scale
        optimizer.found_inf = None
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
        # a copy: update() may add other optimizers' flags into the first one in place
        optimizer_state["found_inf_per_device"] = {scale.device: optimizer.last_step_found_inf.clone()}
        optimizer_state["stage"] = OptState.STEPPED
        return retval
