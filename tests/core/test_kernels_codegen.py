"""What the compiler makes of the kernels for Hopper (sm_90), checked on this CPU-only machine.

Triton compiles ahead of time with its own LLVM and ptxas (fused_stable/devtools/codegen.py), so the GPU code
generation is checked even where no GPU is: a kernel that no longer compiles, whose full-block loop falls back
to narrower accesses or goes through shared memory (bar.sync), or whose rounding changes, fails here before it
reaches a GPU. The claims are exact: every access of the aligned full-block loop has the width stated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def records():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSED_STABLE_BACKEND")}
    proc = subprocess.run(
        [sys.executable, "-m", "fused_stable.devtools.codegen", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("triton's ptxas is not available here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRITON_DEFAULT_FP_FUSION" not in proc.stderr, "a kernel was compiled without an explicit fp fusion choice"
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for record in records:  # JSON keys are strings: widths back to ints
        for loop in record["loops"]:
            loop["loads"] = {int(bits): n for bits, n in loop["loads"].items()}
            loop["stores"] = {int(bits): n for bits, n in loop["stores"].items()}
    return records


def vector_loop(record):
    """The aligned full-block loop: the one whose accesses are vectors."""
    loops = [loop for loop in record["loops"] if any(bits > 32 for bits in {**loop["loads"], **loop["stores"]})]
    assert len(loops) == 1, record
    return loops[0]


def scalar_loop(record, element_bits):
    """The per-tensor fallback for unaligned tensors: a loop of element-wide accesses only."""
    loops = [
        loop
        for loop in record["loops"]
        if loop["loads"]
        and all(bits <= 32 for bits in {**loop["loads"], **loop["stores"]})
        and element_bits in {**loop["loads"], **loop["stores"]}
    ]
    assert loops, record
    return loops[0]


def test_every_kernel_variant_compiles_to_sass_without_spills(records):
    kernels = sorted(
        (r["kernel"], r.get("dtype"), r.get("has_master"), r.get("amsgrad"), r.get("state_format"), r.get("schedule"))
        for r in records
    )
    # sumsq per dtype; adamw fp32 and bf16/fp16 with/without master, plus amsgrad for fp32 and bf16 + master; the
    # bf16 and 8-bit state variants (4 each); decide
    assert len(kernels) == len(set(kernels)) == 3 + 5 + 2 + 8 + 4, kernels
    for r in records:
        assert r["has_cubin"] and r["spill_bytes"] == 0, r
        # at least two blocks of this many warps fit an SM's 64K registers
        assert r["registers"] * r["num_warps"] * 32 * 2 <= 65536, r


ADAMW_WIDTHS = {
    # (param dtype, master weights, amsgrad, state format): (loads, stores, barriers) of the aligned loop, bits ->
    # count per thread and block. fp32 arrays (moments, master, amsgrad's max, fp32 params/grads) are 128-bit; 16-bit
    # params, grads and bf16 moments 64-bit; 8-bit codes 32-bit: 4 elements per thread, the layout every array
    # shares, so no data goes through shared memory.
    ("fp32", False, False, "fp32"): ({128: 4}, {128: 3}, 0),
    ("fp32", False, True, "fp32"): ({128: 5}, {128: 4}, 0),
    ("bf16", False, False, "fp32"): ({64: 2, 128: 2}, {64: 1, 128: 2}, 0),
    ("bf16", True, False, "fp32"): ({64: 1, 128: 3}, {64: 1, 128: 3}, 0),
    ("bf16", True, True, "fp32"): ({64: 1, 128: 4}, {64: 1, 128: 4}, 0),
    ("fp16", False, False, "fp32"): ({64: 2, 128: 2}, {64: 1, 128: 2}, 0),
    ("fp16", True, False, "fp32"): ({64: 1, 128: 3}, {64: 1, 128: 3}, 0),
    # bf16 moments: 64-bit like 16-bit params
    ("fp32", False, False, "bf16"): ({128: 2, 64: 2}, {64: 2, 128: 1}, 0),
    ("fp32", False, True, "bf16"): ({128: 2, 64: 3}, {64: 3, 128: 1}, 0),
    ("bf16", True, False, "bf16"): ({64: 3, 128: 1}, {64: 3, 128: 1}, 0),
    ("bf16", False, False, "bf16"): ({64: 4}, {64: 3}, 0),
    # 8-bit: per moment one 32-bit load and store of 4 codes, and its block's fp32 scale (32-bit: every lane of a
    # warp reads its row's one scale; a warp is one quantisation block). The new scales are a reduction inside each
    # warp (shuffles), but their store goes through shared memory: 2 bar.sync per moment (Triton gives the store of
    # the per-row values its own layout); no element data moves through shared memory
    ("fp32", False, False, "8bit"): ({128: 2, 32: 4}, {32: 4, 128: 1}, 4),
    ("fp32", False, True, "8bit"): ({128: 2, 32: 6}, {32: 6, 128: 1}, 6),
    ("bf16", True, False, "8bit"): ({64: 1, 128: 1, 32: 4}, {32: 4, 128: 1, 64: 1}, 4),
    ("bf16", False, False, "8bit"): ({64: 2, 32: 4}, {32: 4, 64: 1}, 4),
}


def test_update_loop_has_exactly_the_claimed_vector_widths_and_barriers(records):
    adamw = [r for r in records if r["kernel"] == "adamw"]
    key = lambda r: (r["dtype"], r["has_master"], r["amsgrad"], r["state_format"])  # noqa: E731
    assert {key(r) for r in adamw} == set(ADAMW_WIDTHS)
    for r in adamw:
        loop = vector_loop(r)
        loads, stores, barriers = ADAMW_WIDTHS[key(r)]
        assert loop["loads"] == loads and loop["stores"] == stores, r
        assert loop["barriers"] == barriers, r


def test_norm_loop_reads_128_bits_per_access(records):
    for r in (r for r in records if r["kernel"] == "sumsq"):
        loop = vector_loop(r)
        # 2048 elements / 256 threads = 8 per thread: two 128-bit fp32 loads, or one of 8 16-bit values
        assert loop["loads"] == ({128: 2} if r["dtype"] == "fp32" else {128: 1}), r
        assert loop["stores"] == {} and loop["barriers"] == 0, r


@pytest.mark.parametrize("kernel", ["sumsq", "adamw"])
def test_unaligned_tensors_fall_back_per_tensor_in_the_same_kernel(records, kernel):
    """Alignment is decided per tensor at run time: every variant carries both loops, so one unaligned tensor
    does not take the vector loop away from the others of its launch."""
    for r in (r for r in records if r["kernel"] == kernel):
        vector_loop(r)
        scalar_loop(r, 32 if r["dtype"] == "fp32" else 16)


def test_rounding_is_chosen_per_kernel(records):
    for r in records:
        whole = r["kernel_rounding"]
        if r["kernel"] == "sumsq":
            assert r["fp_fusion"] and vector_loop(r)["fma"] > 0, r  # acc + g * g contracted, as torch's CUDA norm
        else:  # op-by-op rounding with IEEE division and square root, as torch's AdamW and the torch backend
            assert not r["fp_fusion"] and whole["fma"] == 0, r
            assert whole["div_approx"] == 0 and whole["sqrt_approx"] == 0 and whole["div_rn"] > 0, r
    for r in (r for r in records if r["kernel"] == "adamw"):
        assert vector_loop(r)["sqrt_rn"] > 0 and vector_loop(r)["div_rn"] > 0, r


def test_ptx_access_widths_are_parsed_from_the_suffixes():
    from fused_stable.devtools.codegen import access_bits, loops

    assert access_bits(".v4.b32") == 128 and access_bits(".v2.b32") == 64 and access_bits(".b16") == 16
    assert access_bits(".L1::evict_last.v2.b64") == 128 and access_bits(".nc.f32") == 32
    ptx = "\n".join(
        [
            "$L__BB0_1:",
            "ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];",
            "bar.sync 0;",
            "st.global.v2.b32 [%rd2], {%r1, %r2};",
            "@%p1 bra $L__BB0_1;",
            "ld.global.b32 %r5, [%rd3];",
        ]
    )
    assert loops(ptx) == [
        {
            "loads": {128: 1},
            "stores": {64: 1},
            "barriers": 1,
            "fma": 0,
            "div_rn": 0,
            "div_approx": 0,
            "sqrt_rn": 0,
            "sqrt_approx": 0,
        }
    ]
