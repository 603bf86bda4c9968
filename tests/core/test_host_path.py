"""The Triton backend's compiled launch path, on CPU: what a step launches and how (tests/core/standin_checks.py).

The checks run in a subprocess without TRITON_INTERPRET, through fused_stable.devtools.standin (kernels compiled
for sm_90, launches recorded instead of run): launch counts, direct launches of the cached compiled kernels
after the first step, no recompilation when the param set changes, 128-bit loops in the kernels launched for a
mixed aligned/unaligned set, launch hooks still served, and no Triton fp-fusion warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def seen():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSED_STABLE_BACKEND")}
    env.pop("TRITON_DEFAULT_FP_FUSION", None)  # unset: any kernel compiled without an explicit choice would warn
    script = Path(__file__).with_name("standin_checks.py")
    tests_dir = str(Path(__file__).parents[1])  # standin_checks imports tests/helpers.py
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("triton's ptxas is not available here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_launches_per_step_do_not_grow_with_tensor_count(seen):
    assert seen["launches per step, 3 fp32"] == seen["launches per step, 300 fp32"] == 3
    assert seen["launches per step, 30 fp32+bf16"] == 5  # each further dtype: its own norm and update launch


def test_a_guarded_step_launches_and_dispatches_what_an_unguarded_one_does(seen):
    assert seen["guarded steps: launches"] == seen["unguarded steps: launches"] == 5 * 3
    assert seen["guarded steps: torch ops"] == seen["unguarded steps: torch ops"]


def test_the_stand_in_benchmarker_times_the_host_work_of_real_launches(seen):
    """devtools/standin.py: the driver's benchmarker (Triton's autotuner calls it) runs the function and times it
    on the host clock, in milliseconds."""
    assert 0 < seen["benchmarker: median ms"] < 1e3
    launches = seen["benchmarker: launches"]
    assert launches >= 2 * 3 and launches % 3 == 0  # the untimed first call and at least one timed step, 3 each
    low, high = seen["benchmarker: quantiles"]
    assert 0 < low <= high


def test_steps_launch_the_cached_compiled_kernels_not_the_dispatcher(seen):
    for name in ("3 fp32", "300 fp32", "30 fp32+bf16"):
        assert seen[f"dispatches after the first step, {name}"] == 0, name


def test_new_grad_storage_rewrites_the_address_table_and_stays_direct(seen):
    assert seen["new grads: launches"] == 3 and seen["new grads: dispatches"] == 0
    assert seen["new grads: address table is current"]


def test_other_param_sets_do_not_recompile(seen):
    """Tensor counts, chunk counts, offsets into the partials and the statistics warm-up are runtime integers
    (do_not_specialize): a new set of params, or a 1 where there was a 3, reuses the compiled kernels."""
    assert seen["compiled variants before"] == 5  # fp32 and bf16 norm and update, one decision kernel
    assert seen["new compilations for other param sets"] == 0


def _vector_loops(loops):
    return [loop for loop in loops if any(int(bits) > 32 for bits in {**loop["loads"], **loop["stores"]})]


def test_a_mixed_aligned_and_unaligned_set_keeps_128_bit_accesses(seen):
    """One unaligned view used to drop its whole launch to scalar accesses; alignment is now decided per
    tensor, so the kernels launched for this set still carry their 128-bit loops (and the scalar one)."""
    assert seen["mixed set: unaligned view"]
    (update,) = _vector_loops(seen["mixed set: update loops"])
    assert update["loads"] == {"128": 4} and update["stores"] == {"128": 3} and update["barriers"] == 0
    (norm,) = _vector_loops(seen["mixed set: norm loops"])
    assert norm["loads"] == {"128": 2}
    assert len(seen["mixed set: update loops"]) == 2 and len(seen["mixed set: norm loops"]) == 2


def test_launch_hooks_see_every_launch(seen):
    assert seen["launch hook saw"] == ["_sumsq_kernel", "_decide_kernel", "_update_kernel"]


def test_clip_grad_norm_launches_one_norm_and_one_scale_per_dtype(seen):
    assert seen["clip_grad_norm_ launches"] == ["_sumsq_kernel", "_scale_kernel"]


def test_no_fp_fusion_default_warning(seen):
    """Every kernel states its fp contraction (Triton 3.9 warns when one is left to the default)."""
    assert seen["fp fusion warnings"] == []
