"""The update rules: what makes each optimizer's update its own, one folder per rule, around one rule-free step.

The step's machinery (norm pass, decision kernel, skip, clip, schedule, chunking, master weights, state codecs)
knows no rule; a rule brings its hyper-parameter row, its state names (and torch's state-dict keys), and its
per-element math in each language the step runs in, side by side in its folder:

  adamw/__init__.py  the hyper-parameter row's slots and `hparam_row`, the state names, torch's keys
  adamw/triton.py    `step_scalars` and `adamw_element`, called by the update kernel (kernels/update.py)
  adamw/torch.py     the same two on fp32 tensors, for the torch backend's exact reference
  adamw/cpu.h        the same two in C++, for the compiled CPU op (backends/torch/cpu_step.cpp)

`RULES` is the registry, by the name the optimizers take. Importing this package imports neither triton nor
the language files (the kernels and backends import those where they run).
"""

from __future__ import annotations

from . import adamw

RULES = {"adamw": adamw}
