"""The torch backend (backend "torch", the default for CPU tensors), one folder:

  torch_backend.py    TorchLists (a plan's lists and update doors) and the step: norm, decisions, update
  torch_decide.py     the decision kernel's sections on 0-dim tensors (meta, CUDA tensors, tensor lrs)
  host_decide.py      the same sections on host scalars (the CPU step)
  updates.py          the update doors: torch's `_fused_adamw_` and the compiled CPU op
  exact_reference.py  the third door: the update kernel's arithmetic in torch, for bf16 and 8-bit state
  cpu_ops.py          builds and loads the compiled CPU ops (cpu_step.cpp, with the rule's cpu.h)

The backend module that fused_stable.ops registers is torch_backend.
"""
