"""Ahead-of-time compilation of the kernels for a GPU architecture, without a GPU: a check of what the
compiler makes of them (that they compile, and that aligned launches get 128-bit vector memory accesses).

    python -m fused_stable.kernels.codegen            # sm_90 (Hopper), prints one line per kernel variant

Triton compiles to PTX and SASS with the LLVM and ptxas it ships, so this runs on a CPU-only machine. It
needs the real (compiled) kernels: run it in a process without TRITON_INTERPRET=1.
"""
from __future__ import annotations

import json
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import adamw, norm
from .tables import CHUNK_SIZE

_I64 = "*i64"
_SUMSQ_SIGNATURE = {
    "grad_addrs": _I64, "numels": _I64, "chunk_tensor": _I64, "chunk_start": _I64, "partials": "*fp32",
    "partial_offset": "i32", "scale_ptr": "*fp32", "GRAD_DTYPE": "constexpr", "HAS_SCALE": "constexpr",
    "ALIGNED": "constexpr", "CHUNK": "constexpr", "BLOCK": "constexpr",
}  # fmt: skip
_ADAMW_SIGNATURE = {
    "table": _I64, "grad_addrs": _I64, "chunk_tensor": _I64, "chunk_start": _I64, "hparams": "*fp32",
    "fstate": "*fp32", "PARAM_DTYPE": "constexpr", "HAS_MASTER": "constexpr", "ALIGNED": "constexpr",
    "CHUNK": "constexpr", "BLOCK": "constexpr",
}  # fmt: skip
_FINALIZE_SIGNATURE = {
    "partials": "*fp32", "chunk_owner": _I64, "num_chunks": "i32", "tensor_num_chunks": _I64,
    "num_tensors": "i32", "per_tensor_sumsq": "*fp32", "step_addrs": _I64, "fstate": "*fp32", "istate": "*i64",
    "hparams": "*fp32", "scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "external_sumsq_ptr": "*fp32",
    "max_grad_norm": "fp32", "zscore_alpha": "fp32", "zscore_threshold": "fp32", "zscore_warmup": "i32",
    "spike_skip_threshold": "fp32", "schedule_total": "fp32", "schedule_warmup": "fp32",
    "schedule_min_ratio": "fp32", "HAS_SCALE": "constexpr", "HAS_FOUND_INF": "constexpr",
    "HAS_EXTERNAL_SUMSQ": "constexpr", "CLIP_MODE": "constexpr", "SCHEDULE": "constexpr", "BLOCK_T": "constexpr",
}  # fmt: skip


def _memory_ops(fn, signature, constexprs, target) -> dict:
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target)
    ptx = kernel.asm["ptx"]
    return {
        "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v[24]\.", ptx)),
        "vector_stores": len(re.findall(r"st\.global(?:\.\w+)*\.v[24]\.", ptx)),
        "has_cubin": bool(kernel.asm.get("cubin")),
    }


def compile_all(arch: int = 90) -> list[dict]:
    """Every kernel variant the optimizer launches, compiled for sm_<arch>; one record per variant."""
    target = GPUTarget("cuda", arch, 32)
    records = []
    for dtype in (tl.float32, tl.bfloat16, tl.float16):
        for aligned in (False, True):
            common = {"ALIGNED": aligned, "CHUNK": CHUNK_SIZE, "BLOCK": norm.BLOCK_SIZE}
            records.append({"kernel": "sumsq", "dtype": str(dtype), "aligned": aligned, **_memory_ops(
                norm._sumsq_kernel, _SUMSQ_SIGNATURE, {"GRAD_DTYPE": dtype, "HAS_SCALE": True, **common}, target)})
            records.append({"kernel": "adamw", "dtype": str(dtype), "aligned": aligned, **_memory_ops(
                adamw._adamw_kernel, _ADAMW_SIGNATURE,
                {"PARAM_DTYPE": dtype, "HAS_MASTER": dtype != tl.float32, **common}, target)})  # fmt: skip
    for schedule in range(4):
        records.append({"kernel": "finalize", "schedule": schedule, **_memory_ops(
            adamw._finalize_kernel, _FINALIZE_SIGNATURE,
            {"HAS_SCALE": True, "HAS_FOUND_INF": True, "HAS_EXTERNAL_SUMSQ": schedule == 1, "CLIP_MODE": schedule % 2,
             "SCHEDULE": schedule, "BLOCK_T": adamw.BLOCK_TENSORS}, target)})  # fmt: skip
    return records


if __name__ == "__main__":
    for record in compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90):
        print(json.dumps(record))
