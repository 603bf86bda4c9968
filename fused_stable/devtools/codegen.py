"""Ahead-of-time compilation of the kernels for a GPU architecture, without a GPU: what the compiler makes of them.

    python -m fused_stable.devtools.codegen [ARCH] [--candidates]   # sm_90 by default; one JSON line per variant

Triton compiles to PTX and SASS with the LLVM and ptxas it ships, so this runs on a CPU-only machine (in a
process without TRITON_INTERPRET=1). Every variant the optimizer launches is compiled with its launch
configuration (kernels/*.py `*_CONFIG`), and for each one this reports:
  - registers and spill bytes (from `ptxas -v`), shared memory;
  - for every loop in the PTX: its global loads and stores by width in bits, its barriers (`bar.sync`: a
    block's data going through shared memory) and its floating-point instructions that decide rounding
    (`fma.rn`, `div.rn` / `div.full`, `sqrt.rn` / `sqrt.approx`).
tests/core/test_kernels_codegen.py asserts the properties the kernels claim on these records; `--candidates` adds
the alternative launch configurations that benchmarks/gpu_probe.py times on a GPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .. import state_format
from ..kernels import decide, norm, update
from ..kernels.launch import LaunchConfig
from ..kernels.tables import CHUNK_SIZE
from ..rules import RULES

_I64, _F32 = "*i64", "*fp32"
_TYPES = {
    "sumsq": {
        "grad_addrs": _I64,
        "numels": _I64,
        "chunk_tensor": _I64,
        "chunk_start": _I64,
        "partials": _F32,
        "partial_offset": "i32",
        "scale_ptr": _F32,
    },
    "adamw": {
        "table": _I64,
        "grad_addrs": _I64,
        "chunk_tensor": _I64,
        "chunk_start": _I64,
        "hparams": _F32,
        "fstate": _F32,
    },
    "decide": {
        "partials": _F32,
        "chunk_owner": _I64,
        "num_chunks": "i32",
        "tensor_num_chunks": _I64,
        "num_tensors": "i32",
        "per_tensor_sumsq": _F32,
        "worst_sumsq": _F32,
        "tensor_positions": _I64,
        "step_addrs": _I64,
        "fstate": _F32,
        "istate": "*i64",
        "hparams": _F32,
        "num_groups": "i32",
        "scale_ptr": _F32,
        "found_inf_ptr": _F32,
        "external_sumsq_ptr": _F32,
        "max_grad_norm": "fp32",
        "zscore_alpha": "fp32",
        "zscore_threshold": "fp32",
        "zscore_warmup": "i32",
        "spike_skip_threshold": "fp32",
        "spike_skip_ratio": "fp32",
        "schedule_total": "fp32",
        "schedule_warmup": "fp32",
        "schedule_min_ratio": "fp32",
    },
}
_KERNELS = {"sumsq": norm._sumsq_kernel, "adamw": update._update_kernel, "decide": decide._decide_kernel}

# launch configurations a GPU should decide between (benchmarks/gpu_probe.py times them side by side)
CANDIDATES = {
    "sumsq": [norm.SUMSQ_CONFIG, LaunchConfig(1024, 4, True), LaunchConfig(1024, 8, True), LaunchConfig(4096, 8, True)],
    "adamw": [
        update.UPDATE_CONFIG,
        LaunchConfig(512, 4, False),
        LaunchConfig(1024, 4, False),
        LaunchConfig(2048, 8, False),
    ],
}
DTYPES = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}


def compile_kernel(kernel: str, constexprs: dict, config: LaunchConfig, arch: int = 90):
    """One variant of a kernel, compiled for sm_<arch>; constexprs not given take their defaults."""
    fn = _KERNELS[kernel]
    signature, values = {}, {}
    for param in fn.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            values[param.name] = constexprs.get(param.name, param.default)
        else:
            signature[param.name] = _TYPES[kernel][param.name]
    source = ASTSource(fn=fn, signature=signature, constexprs=values)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=config.options())


_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
_LABEL = re.compile(r"^(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")


def access_bits(suffixes: str) -> int:
    """Width in bits of one PTX global access from its suffixes, e.g. '.v4.b32' -> 128, '.b16' -> 16."""
    parts = suffixes.split(".")
    vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
    bits = next(int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bfsu]\d+", p))
    return vector * bits


def loops(ptx: str) -> list[dict]:
    """Every loop of a PTX function (a backward branch to an earlier label): accesses, barriers, fp rounding."""
    lines = ptx.splitlines()
    labels = {}
    found = []
    for number, line in enumerate(lines):
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = number
        branch = _BRANCH.search(line)
        if branch and branch.group(1) in labels:
            body = lines[labels[branch.group(1)] : number + 1]
            loads, stores = Counter(), Counter()
            for text in body:
                for op, suffixes in _ACCESS.findall(text):
                    (loads if op == "ld" else stores)[access_bits(suffixes)] += 1
            text = "\n".join(body)
            found.append(
                {"loads": dict(loads), "stores": dict(stores), "barriers": text.count("bar.sync"), **rounding(text)}
            )
    return found


def rounding(ptx: str) -> dict:
    """The fp32 instructions whose rounding differs between choices: fused multiply-adds (one rounding for
    a * b + c), IEEE (`.rn`) against approximate division and square root."""
    return {
        "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)),
        "div_rn": len(re.findall(r"\bdiv\.rn\.f32", ptx)),
        "div_approx": len(re.findall(r"\bdiv\.(?:full|approx)\.", ptx)),
        "sqrt_rn": len(re.findall(r"\bsqrt\.rn\.f32", ptx)),
        "sqrt_approx": len(re.findall(r"\bsqrt\.approx\.", ptx)),
    }


def ptxas_usage(ptx: str, arch: int, fp_fusion: bool) -> dict:
    """Registers and spill bytes per thread, as ptxas reports them (`-v`) for this PTX, with Triton's own ptxas
    and the flags Triton passes it."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        fmad = [] if fp_fusion else ["--fmad=false"]
        proc = subprocess.run(
            [
                get_ptxas(arch).path,
                "-v",
                *fmad,
                "--regAllocOptLevel=2",
                f"--gpu-name={sm_arch_from_capability(arch)}",
                str(source),
                "-o",
                str(Path(tmp) / "kernel.o"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    log = proc.stdout + proc.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return {"registers": int(registers.group(1)) if registers else None, "spill_bytes": sum(spills)}


def record(kernel: str, constexprs: dict, config: LaunchConfig, arch: int = 90, **describe) -> dict:
    compiled = compile_kernel(kernel, constexprs, config, arch)
    ptx = compiled.asm["ptx"]
    return {
        "kernel": kernel,
        **describe,
        "block": config.block,
        "num_warps": config.num_warps,
        "fp_fusion": config.fp_fusion,
        "has_cubin": bool(compiled.asm.get("cubin")),
        "shared_bytes": compiled.metadata.shared,
        **ptxas_usage(ptx, arch, config.fp_fusion),
        "loops": loops(ptx),
        "kernel_rounding": rounding(ptx),
    }


def _adamw_record(dtype: str, has_master: bool, amsgrad: bool, fmt: int, config: LaunchConfig, arch: int) -> dict:
    constexprs = {
        "PARAM_DTYPE": DTYPES[dtype],
        "HAS_MASTER": has_master,
        "CHUNK": CHUNK_SIZE,
        "BLOCK": config.block,
        "RULE": update.rule_constexpr(RULES["adamw"], amsgrad),
        "STATE_FORMAT": fmt,
    }
    describe = dict(dtype=dtype, has_master=has_master, amsgrad=amsgrad, state_format=state_format.FORMAT_NAMES[fmt])
    return record("adamw", constexprs, config, arch, **describe, default=config == update.UPDATE_CONFIG)


def compile_all(arch: int = 90, candidates: bool = False) -> list[dict]:
    """Every kernel variant the optimizer launches (with its launch configuration), compiled for sm_<arch>."""
    records = []
    for name, dtype in DTYPES.items():
        for config in CANDIDATES["sumsq"] if candidates else [norm.SUMSQ_CONFIG]:
            records.append(
                record(
                    "sumsq",
                    {"GRAD_DTYPE": dtype, "HAS_SCALE": True, "CHUNK": CHUNK_SIZE, "BLOCK": config.block},
                    config,
                    arch,
                    dtype=name,
                    default=config == norm.SUMSQ_CONFIG,
                )
            )
        for has_master in (False, True) if dtype != tl.float32 else (False,):
            # amsgrad (one more fp32 state) for the two layouts it adds most to: fp32, and 16-bit with a master
            for amsgrad in (False, True) if has_master == (dtype != tl.float32) and name != "fp16" else (False,):
                for config in CANDIDATES["adamw"] if candidates else [update.UPDATE_CONFIG]:
                    records.append(_adamw_record(name, has_master, amsgrad, state_format.FP32, config, arch))
    # low-precision state (state_format.py), bf16 moments and 8-bit codes: for fp32 params (with amsgrad too), and
    # for bf16 params with and without fp32 masters
    for fmt in (state_format.BF16, state_format.Q8):
        for name, has_master, amsgrad in (
            ("fp32", False, False),
            ("fp32", False, True),
            ("bf16", True, False),
            ("bf16", False, False),
        ):
            records.append(_adamw_record(name, has_master, amsgrad, fmt, update.UPDATE_CONFIG, arch))
    for schedule in range(4):
        records.append(
            record(
                "decide",
                {
                    "HAS_SCALE": True,
                    "HAS_FOUND_INF": True,
                    "HAS_EXTERNAL_SUMSQ": schedule == 1,
                    "CLIP_MODE": schedule % 2,
                    "SCHEDULE": schedule,
                    "BLOCK_T": decide.BLOCK_TENSORS,
                },
                decide.DECIDE_CONFIG,
                arch,
                schedule=schedule,
                default=True,
            )
        )
    return records


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if not a.startswith("--")]
    for line in compile_all(int(arguments[0]) if arguments else 90, candidates="--candidates" in sys.argv):
        print(json.dumps(line))
