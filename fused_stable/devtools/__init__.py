"""Tools for checking the kernels without a GPU; nothing in the optimizer's step imports them.

  codegen.py  ahead-of-time sm_90 compiles of every kernel variant: registers, spills, access widths, rounding
  standin.py  a Triton driver that records launches instead of running them (host time, what a step launches)

Both import triton; run them in a process without TRITON_INTERPRET (they compile for a real GPU).
"""
