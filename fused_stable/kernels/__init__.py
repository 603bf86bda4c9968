"""Triton kernels and their launchers. They know pointers and dtypes, not optimizers.

Importing this package imports triton. For the interpreter (CPU) backend, TRITON_INTERPRET=1 must be set
before triton is first imported in the process; fused_stable.ops checks that and says so.
"""
