"""Triton kernels and their launchers. They know pointers and dtypes, not optimizers.

  common.py   JIT helpers every kernel module shares (dtype map, int64 addresses as pointers, alignment, rounding)
  norm.py     the norm pass (multi-tensor sums of squares) and clip_grad_norm_'s in-place scale
  decide.py   the decision kernel: clip coefficient, skip, statistics, schedule, counters, in one program
  update.py   the update kernel: the rule's element (fused_stable/rules) over every tensor, reading those decisions
  launch.py   launch configurations, and launches that go to the cached compiled kernel directly
  tables.py   the device tables the kernels read, and the one way host values reach the device
(the tools over them, codegen.py and standin.py, are in fused_stable/devtools)

Importing this package, or tables.py, does not import triton (the backends import the kernel modules only when a
kernel is launched); every other module does. For the interpreter (CPU) backend, TRITON_INTERPRET=1 must be set
before triton is first imported in the process; fused_stable.ops checks that and says so.
"""
