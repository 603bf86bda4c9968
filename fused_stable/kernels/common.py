"""JIT helpers every kernel module shares: storage dtypes, int64 addresses as pointers, alignment, the rounding store.

Written once here (not imported from a sibling kernel file): norm.py, decide.py and adamw.py read their tensors
through addresses loaded from int64 tables, test each tensor's alignment at run time, and store fp32 results
in the storage dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import layout
from ..rules import H_SIZE as H_SIZE

# every kernel's `LAYOUT` constexpr: layout.py's constants and the hyper-parameter table's width (sized from the
# rules' declarations, rules.H_SIZE), so a slot or a width that changes recompiles the kernels (decide.py says why)
KERNEL_LAYOUT = f"{layout.KERNEL_LAYOUT};H_SIZE={H_SIZE}"

# the storage dtypes the kernels take, as Triton names them
TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def to_storage(x, DTYPE: tl.constexpr):
    """fp32 -> storage dtype with round-to-nearest-even.

    For bf16 the rounding is spelled out on the bits: compiled Triton already rounds to nearest even, but
    Triton's interpreter truncates fp32 -> bf16, which would make the CPU tests disagree with the GPU.
    The result is bit-identical to a hardware RTNE conversion; NaN stays NaN.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        rounded = bits.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded).to(tl.bfloat16)
    else:
        return x.to(DTYPE)


@triton.jit
def load_address(address_ptr):
    """A tensor's address from an int64 table (as an integer: alignment is tested on it before the cast)."""
    return tl.load(address_ptr)


@triton.jit
def as_pointer(address, DTYPE: tl.constexpr):
    return address.to(tl.pointer_type(DTYPE))


@triton.jit
def is_aligned(address):
    """Whether an address is a multiple of 16 bytes: then every block (BLOCK elements from it) is too."""
    return (address & 15) == 0


@triton.jit
def aligned_block(base, block_start):
    """base + block_start, marked 16-byte aligned (for tensors `is_aligned` said yes to).

    Addresses loaded from a table carry no alignment the compiler can see; the hint on each block's base pointer
    (a hint on the table value or the loop index does not propagate) is what turns full-block accesses into
    128-bit vector loads and stores.
    """
    return tl.multiple_of(base + block_start, 16)
