r"""SGD with momentum (Polyak's heavy ball; Sutskever et al.'s Nesterov form), as torch.optim.SGD computes it.

With g the grad times the step's multiplier (the clip coefficient and the loss scale; negated with maximize):

    g = g + weight_decay * p                                 (L2 weight decay, coupled into the grad, as torch's)
    B = g                              on B's first update   (momentum_buffer: torch clones the grad)
    B = momentum * B + (1 - dampening) * g    afterwards
    g = g + momentum * B   with nesterov, else g = B         (momentum != 0 only; momentum 0 keeps no buffer)
    p = p - lr * g

Names, defaults, checks and the state key are torch.optim.SGD's (its `foreach`, `fused` and `differentiable` are
kept in the groups for its call sites and state dicts). torch's SGD keeps no `step`: fused_stable's state adds one,
which tells the buffer's first update (a loaded buffer has been written: its state starts at step 1). The
per-element math is beside this file: triton.py (the update kernel), torch.py (the exact reference), cpu.h (the
compiled CPU op).
"""

from __future__ import annotations

from ..declaration import SIGNED, HParam, Rule, State, at_least_zero, learning_rate


def _row(momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool) -> tuple:
    """The rule's slots of a group's row; 1 - dampening derived on the host in float64, as torch's `1 - dampening`."""
    return (momentum, 1.0 - dampening, weight_decay, 1.0 if nesterov else 0.0, -1.0 if maximize else 1.0)


def _nesterov_needs_momentum(group: dict) -> None:
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")  # torch's words


RULE = Rule(
    name="sgd",
    title="SGD",
    package=__name__,
    # momentum != 0 adds the buffer (torch keeps none without momentum); bf16 to nearest: momentum 0.9 moves it 10%
    # of (g - B) a step, over half a bf16 ulp (0.2-0.4%) unless g is within ~4% of B
    states=(State("momentum_buffer", SIGNED, option="momentum"),),
    hparams=(
        HParam("lr", 1e-3, check=learning_rate),
        HParam("momentum", 0.0, check=at_least_zero("momentum")),
        HParam("dampening", 0.0),
        HParam("weight_decay", 0.0, check=at_least_zero("weight_decay")),
        HParam("nesterov", False, normalize=bool),
        HParam("maximize", False, normalize=bool),
        # torch.optim.SGD's own keys, kept in the groups (no effect here: the step is always the fused one)
        HParam("foreach", None),
        HParam("differentiable", False),
        HParam("fused", None),
    ),
    row=("momentum", "one_minus_dampening", "weight_decay", "nesterov", "grad_sign"),
    row_inputs=("momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    fill_row=_row,
    check_across=_nesterov_needs_momentum,
    torch_keeps_step=False,
    loaded_step=1,
)
