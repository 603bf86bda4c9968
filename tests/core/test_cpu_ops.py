"""The CPU step's compiled ops (fused_stable/backends/torch/cpu_ops.py, cpu_step.cpp, cpu_update.h): the norm pass
against an fp64 reference, the AdamW update against fp64 AdamW with torch's own error as the floor, grads never
written, `step` advanced only when applied, the same sums whatever the thread count, and the build's fallback (a
real failed build: no compiler); the one compiled update (updates.CompiledUpdate) against the exact reference, bit
for bit, for AdamW and Lion in fp32, bf16 and 8-bit state; which update each group takes; and a rule's header
alone giving its op (a test-only rule built in a temporary folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers import reference_adamw_fp64, ulp_distance

from fused_stable import FusedAdamW, FusedLion, rules, schedules, state_format
from fused_stable.backends.torch import cpu_ops
from fused_stable.backends.torch.updates import CompiledUpdate, NativeUpdate
from fused_stable.rules.adamw import torch as adamw_torch
from fused_stable.state_format import BF16, FP32, Q8

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the compiled CPU ops could not be built here")
ADAMW, LION = rules.RULES["adamw"], rules.RULES["lion"]

# odd sizes around the 65536-element chunks of the norm and the update, an empty and a 1-element one
SIZES = [0, 1, 7, 16383, 65535, 65537 + 11, 3 * 65536 + 5]


def grads_of(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 10 ** (k % 3 - 1)).to(dtype) for k, n in enumerate(SIZES)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_sum_squares_is_the_fp64_sum_rounded_once(dtype):
    grads = grads_of(dtype) + [torch.randn(300, 257, generator=torch.Generator().manual_seed(1)).t()]  # transposed
    out = torch.full((len(grads),), float("nan"))
    total = cpu_ops.sum_squares(grads, out)
    exact = torch.stack([g.double().square().sum() for g in grads])
    # fp64 accumulation of exact squares: the per-tensor sums are the exact ones rounded once to fp32 (a
    # different fp64 order moves them by ~1e-16 relative, far under half an fp32 ulp, 6e-8)
    torch.testing.assert_close(out, exact.float(), rtol=0, atol=0)
    assert abs(total - exact.sum().item()) <= 1e-13 * exact.sum().item()


def test_sum_squares_beats_fp32_accumulation_on_a_large_tensor():
    """The accuracy point of the fp64 accumulation: torch's fp32 `_foreach_norm` is measurably off on a large
    tensor (its error is the reason for it), the compiled pass is not."""
    gen = torch.Generator().manual_seed(2)
    grad = torch.rand(1 << 24, generator=gen) + 1.0
    exact = grad.double().square().sum().item()
    out = torch.empty(1)
    ours = abs(cpu_ops.sum_squares([grad], out) - exact) / exact
    theirs = abs(torch._foreach_norm([grad], 2)[0].double().item() ** 2 - exact) / exact
    assert ours < 1e-12, ours
    assert ours < theirs


def test_sum_squares_do_not_depend_on_the_thread_count():
    grads = grads_of(torch.float32, seed=3)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty(len(grads))
            results.append((cpu_ops.sum_squares(grads, out), out))
    finally:
        torch.set_num_threads(threads)
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


def test_sum_squares_of_a_grad_do_not_depend_on_its_neighbours():
    """The pass sums up to four pieces side by side (cpu_step.cpp's kStreams) and groups pieces only of one grad
    dtype: each grad's sum is the one it has alone, bit for bit, in a list of mixed dtypes and sizes (fp32, bf16 and
    fp16 interleaved; the exact fp64 sum rounded once, as alone), and the total is their sum in order."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    grads = [g.to(dtypes[k % 3]) for k, g in enumerate(grads_of(torch.float32, seed=4) * 2)]
    out = torch.full((len(grads),), float("nan"))
    total = cpu_ops.sum_squares(grads, out)
    alone, alone_total = [], 0.0
    for g in grads:
        one = torch.empty(1)
        alone_total += cpu_ops.sum_squares([g], one)
        alone.append(one)
    assert torch.equal(out, torch.cat(alone))
    assert total == alone_total
    exact = torch.stack([g.double().square().sum() for g in grads])
    torch.testing.assert_close(out, exact.float(), rtol=0, atol=0)


def test_sum_squares_refuses_a_wrong_out():
    with pytest.raises(RuntimeError, match="one value per grad"):
        cpu_ops.sum_squares([torch.ones(3), torch.ones(2)], torch.empty(1))


def reference_steps(params, grads, steps, *, lr, betas, eps, weight_decay, grad_mul, amsgrad, maximize, dtype):
    """torch.optim.AdamW (foreach=False) in `dtype` from grads multiplied by `grad_mul` first."""
    ps = [p.detach().to(dtype).clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(
        ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, foreach=False
    )
    for step in range(steps):
        for p, g in zip(ps, grads[step]):
            p.grad = g.to(dtype) * grad_mul
        opt.step()
    return [p.detach() for p in ps], opt


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
def test_adamw_matches_fp64_adamw_as_closely_as_torch(amsgrad, maximize):
    """Three steps with a grad multiplier of 0.37 (a clip) and weight decay: the compiled update's distance to
    fp64 AdamW is at most twice the distance of torch's own fp32 AdamW on the same run (the floor), plus 1e-9."""
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(3)]
    hp = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, grad_mul=0.37, amsgrad=amsgrad)
    exact, _ = reference_steps(params, grads, 3, maximize=maximize, dtype=torch.float64, **hp)
    torch_fp32, _ = reference_steps(params, grads, 3, maximize=maximize, dtype=torch.float32, **hp)

    ours = [p.clone() for p in params]
    states = [[torch.zeros_like(p) for p in params] for _ in range(3 if amsgrad else 2)]
    steps = [torch.zeros(()) for _ in params]
    for step in range(3):
        before = [g.clone() for g in grads[step]]
        hparams = ADAMW.HParams(hp["lr"], (0.9, 0.99), 1e-8, 0.1, maximize)
        fp32_adamw_step(ours, grads[step], states, steps, hparams, grad_mul=0.37, amsgrad=amsgrad)
        assert all(torch.equal(g, b) for g, b in zip(grads[step], before)), "the grads were written"
    assert all(s.item() == 3.0 for s in steps)
    floor = max((t.double() - e).abs().max().item() for t, e in zip(torch_fp32, exact) if e.numel())
    worst = max((o.double() - e).abs().max().item() for o, e in zip(ours, exact) if e.numel())
    assert worst <= 2 * floor + 1e-9, (worst, floor)


def fp32_adamw_step(params, grads, states, steps, hparams, *, grad_mul, amsgrad):
    """One step of AdamW's compiled op on fp32 state as CompiledUpdate takes it: the `step` counters advanced first
    (the backend's part), then per tensor torch.optim.AdamW's fp64 scalars (rules/adamw/torch.py)."""
    torch._foreach_add_(steps, 1.0)
    rows = [adamw_torch.float64_step_scalars(hparams, float(s), np.float32(grad_mul), np.float32(1.0)) for s in steps]
    keys = torch.zeros(len(params), dtype=torch.int64)
    op = cpu_ops.update_op(ADAMW)
    op(params, grads, [t for slot in states for t in slot], [], [], torch.from_numpy(np.stack(rows)), keys, keys, FP32,
       amsgrad, 0b001, 0)  # fmt: skip


def test_fp32_adamw_state_takes_torch_adamws_fp64_scalars(monkeypatch):
    """FusedAdamW's fp32 state on the compiled op is the op with torch.optim.AdamW's fp64 scalars
    (FP32_STATE_SCALARS, `fp32_adamw_step`) bit for bit, params at different steps included (a param without a
    grad at the first step); with the kernels' fp32 scalars (`step_scalars`, the exact reference's) the same run
    ends elsewhere in the last bits, so the choice is seen."""
    hparams = ADAMW.HParams(1e-2, (0.9, 0.999), 1e-8, 0.1, False)
    gen = torch.Generator().manual_seed(8)
    init = [torch.randn(n, generator=gen) for n in (70001, 300, 4097)]
    grads = [[torch.randn(t.shape, generator=gen) for t in init] for _ in range(6)]

    def fused_run():
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1, lr_schedule=None, backend="torch")
        for step, step_grads in enumerate(grads):
            for k, (p, g) in enumerate(zip(params, step_grads)):
                p.grad = None if step == 0 and k == 1 else g.clone()
            opt.step()
        assert set(update_kinds(opt)) == {"CompiledUpdate"}
        return [p.detach() for p in params]

    ours = [t.clone() for t in init]
    states = [[torch.zeros_like(t) for t in init] for _ in range(2)]
    steps = [torch.zeros(()) for _ in init]
    for step, step_grads in enumerate(grads):
        k = [0, 2] if step == 0 else [0, 1, 2]
        pick = lambda tensors: [tensors[i] for i in k]  # noqa: E731
        fp32_adamw_step(pick(ours), pick(step_grads), [pick(s) for s in states], pick(steps), hparams, grad_mul=1.0,
                        amsgrad=False)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(fused_run(), ours))
    monkeypatch.setattr(adamw_torch, "FP32_STATE_SCALARS", None)
    assert not all(torch.equal(a, b) for a, b in zip(fused_run(), ours))


def test_the_update_op_refuses_wrong_lists():
    """One line per mistake, whatever the rule: list lengths (states slot by slot, scales in 8-bit only), the
    rule's number of scalars, the state format's dtypes, 8-bit scales per block, an option the rule lacks, the
    param dtypes the op compiles, slot codes other than the rule's declared ones."""
    p, codes = torch.zeros(256), torch.zeros(256, dtype=torch.int8)
    row, keys = torch.zeros(1, 7), torch.zeros(1, dtype=torch.int64)
    lion, adamw = cpu_ops.update_op(LION), cpu_ops.update_op(ADAMW)

    def call(op, states, scales=(), fmt=FP32, scalars=row, option=False, params=(p,), grads=(p,)):
        op(list(params), list(grads), list(states), list(scales), [], scalars, keys, keys, fmt, option, 0b001, 0b001)

    for match, args in [
        ("one tensor per param", dict(states=[])),
        (r"scalars must be contiguous fp32 \[params or 1, 7\]", dict(states=[p.clone()], scalars=torch.zeros(1, 8))),
        ("in the state format's dtypes", dict(states=[p.to(torch.bfloat16)])),
        ("scales in 8bit only", dict(states=[codes], fmt=Q8)),
        ("one per block of 128", dict(states=[codes], scales=[torch.zeros(3)], fmt=Q8)),
        ("takes no option", dict(states=[p.clone()], option=True)),
        ("unsupported param dtype", dict(states=[p.double()], params=[p.double()], grads=[p.double()])),
        ("of one dtype and size", dict(states=[p.clone()], grads=[p.double()])),
    ]:
        with pytest.raises(RuntimeError, match=match):
            call(lion, **args)
    with pytest.raises(RuntimeError, match=r"one tensor per param \(3 states"):  # amsgrad: max_exp_avg_sq too
        call(adamw, [p.clone(), p.clone()], scalars=torch.zeros(1, 8), option=True)
    # the slot codes are compiled in from the rule's declaration (Lion: exp_avg signed and stochastic): a caller
    # with others is refused, in the format that reads them
    with pytest.raises(RuntimeError, match="called with signed 8-bit slots 0, built for the rule's declared 1"):
        lion([p], [p], [codes], [torch.zeros(2)], [], row, keys, keys, Q8, False, 0b000, 0b001)
    with pytest.raises(RuntimeError, match="called with stochastic bf16 slots 0, built for the rule's declared 1"):
        lion([p], [p], [p.to(torch.bfloat16)], [], [], row, keys, keys, BF16, False, 0b001, 0b000)
    with pytest.raises(RuntimeError, match="first_elements must be int64, one per param"):
        lion([p], [p], [p.clone()], [], [], row, keys, keys.float(), FP32, False, 0b001, 0b001)


def clipped_optimizer(seed=5):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (33, 4097, 70001)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 3
    return params, FusedAdamW(params, lr=1e-3, max_grad_norm=0.5, lr_schedule=None)


def test_a_clipped_step_reads_the_grads_and_never_writes_them():
    """32 bytes per param with the clip active: the grads are bit-identical after the step (torch's CPU
    `_fused_adamw_` given `grad_scale` would hold the clipped grads), and the params moved as clipped AdamW's."""
    params, opt = clipped_optimizer()
    grads = [p.grad.clone() for p in params]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref, 0.5)
    torch.optim.AdamW(ref, lr=1e-3).step()
    opt.step()
    assert opt.grad_norm.item() > 0.5  # the clip was active
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-7)


def test_steps_advance_only_on_an_applied_step():
    params, opt = clipped_optimizer(seed=6)
    opt.step()
    params[1].grad[7] = float("inf")
    before = [p.detach().clone() for p in params]
    opt.step()
    assert [opt.state[p]["step"].item() for p in params] == [1.0, 1.0, 1.0]
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    params[1].grad[7] = 0.0
    opt.step()
    assert [opt.state[p]["step"].item() for p in params] == [2.0, 2.0, 2.0]


def run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


STEP_AND_REPORT = """
    import json
    import warnings
    import torch
    from fused_stable import FusedAdamW, FusedLion, schedules
    from fused_stable.backends.torch import cpu_ops
    p = torch.nn.Parameter(torch.ones(5))
    p.grad = torch.full((5,), 2.0)
    opt = FusedAdamW([p], lr=0.1, max_grad_norm=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    print("available", cpu_ops.available())
    print("warnings", [str(w.message) for w in caught])
    print("param", json.dumps(p.detach().tolist()))
"""


def test_a_failed_build_warns_once_and_the_step_still_runs(tmp_path):
    """No compiler (CXX names a missing program, a fresh extensions folder so nothing cached is loaded): one
    warning that names the cause and the switch, and torch's ops do the step (the same params as with them)."""
    no_compiler = {"CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = run_python(STEP_AND_REPORT, no_compiler)
    assert done.returncode == 0, done.stderr
    assert "available False" in done.stdout
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("warnings")]
    assert line.count("could not be built") == 1 and "FUSED_STABLE_CPU_OPS=0" in line, line
    with_ops = run_python(STEP_AND_REPORT, {})
    assert with_ops.returncode == 0, with_ops.stderr
    assert "available True" in with_ops.stdout and "warnings []" in with_ops.stdout
    fallback, compiled = (
        json.loads(line.removeprefix("param "))
        for line in (done.stdout + with_ops.stdout).splitlines()
        if line.startswith("param")
    )
    assert fallback != [1.0] * 5
    assert fallback == pytest.approx(compiled, rel=1e-6)


def test_the_switch_skips_the_build(tmp_path):
    done = run_python(STEP_AND_REPORT, {"FUSED_STABLE_CPU_OPS": "0", "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "available False" in done.stdout and "warnings []" in done.stdout
    assert not any(tmp_path.iterdir())  # nothing was built


def test_the_build_finds_the_ninja_package_off_the_path(tmp_path):
    """A venv's python run without activating it: PATH has neither the venv's scripts (the `ninja` package's
    binary) nor any other ninja; the build still runs (a fresh extensions folder, so it really builds)."""
    tools = tmp_path / "bin"  # every program of this PATH but ninja (the compiler needs `as`, `ld`, ...)
    tools.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if name != "ninja" and not (tools / name).exists():
                (tools / name).symlink_to(os.path.join(folder, name))
    assert shutil.which("ninja", path=str(tools)) is None
    done = run_python(STEP_AND_REPORT, {"PATH": str(tools), "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "available True" in done.stdout and "warnings []" in done.stdout, done.stdout


def test_the_build_name_covers_every_header_and_rule(tmp_path, monkeypatch):
    """The library holds the template (backends/torch/*.h) and every rule's header, one generated unit per rule: a
    change to a header, and a new rule, must rebuild, so the build's name hashes them as it hashes the source."""
    assert {"adamw", "lion"} <= set(cpu_ops.rule_headers())
    assert cpu_ops.rule_headers()["adamw"] == cpu_ops.RULES_DIR / "adamw" / "cpu.h"
    rules_dir = tmp_path / "rules"
    (rules_dir / "adamw").mkdir(parents=True)
    header = rules_dir / "adamw" / "cpu.h"
    header.write_text(cpu_ops.rule_headers()["adamw"].read_text())
    names = [cpu_ops.build_fingerprint(rules_dir)]
    header.write_text(header.read_text() + "\n// one more line\n")
    names.append(cpu_ops.build_fingerprint(rules_dir))
    (rules_dir / "sgd").mkdir()
    (rules_dir / "sgd" / "cpu.h").write_text(header.read_text())
    names.append(cpu_ops.build_fingerprint(rules_dir))
    template = tmp_path / "cpu_update.h"
    template.write_text((cpu_ops.BACKEND_DIR / "cpu_update.h").read_text())
    monkeypatch.setattr(cpu_ops, "TEMPLATE_HEADERS", [template])
    names.append(cpu_ops.build_fingerprint(rules_dir))
    template.write_text(template.read_text() + "\n// one more line\n")
    names.append(cpu_ops.build_fingerprint(rules_dir))
    assert len(set(names)) == len(names), names


def test_the_package_ships_the_source_and_the_rules_headers():
    """An installed package builds the ops from its own files: pyproject's package-data carries the .cpp, the
    update template's headers and every rule's header (a wheel built from it holds fused_stable/rules/adamw/cpu.h)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert package_data["fused_stable.backends.torch"] == ["*.cpp", "*.h"]
    assert package_data["fused_stable.rules"] == ["*/*.h"]


def low_precision_run(dtype, master_weights, steps=4, seed=9):
    """FusedAdamW on the torch backend: 3 steps over odd sizes of `dtype` params, clipped (0.5), weight decay."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [7, 4097, 65537 + 11]
    init = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(dtype) for n in sizes] for _ in range(steps)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = FusedAdamW(
        params, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, master_weights=master_weights, backend="torch"
    )
    for step in range(steps):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads[step])), "the grads were written"
    return init, grads, params, opt


@pytest.mark.parametrize("master_weights", [False, True], ids=["no-master", "master"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_params_take_the_compiled_update_within_torch_ops_floor(dtype, master_weights, monkeypatch):
    """bf16 / fp16 params with fp32 moments (issue 41 item 3): the compiled op updates them in place (read as
    fp32, stored rounded to nearest even; with master weights the fp32 master is updated and the param is its
    rounding), reads the clipped grads without writing them, and lands as close to fp64 AdamW (params rounded
    to `dtype` each step, or the master's rounding) as torch's ops do on the same run (the floor: `_fused_adamw_`
    on fp32 copies). Measured on this run: both within 1 ulp of the reference on every element."""
    init, grads, params, opt = low_precision_run(dtype, master_weights)
    assert all(isinstance(door, CompiledUpdate) for door in opt._plan.backend_cache.updates)
    round_to = None if master_weights else dtype
    exact, _, _ = reference_adamw_fp64(
        init, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, max_norm=0.5, round_to=round_to
    )
    ours = max(ulp_distance(p, e, dtype).max().item() for p, e in zip(params, exact))
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    _, _, torch_params, torch_opt = low_precision_run(dtype, master_weights)
    assert not any(isinstance(door, CompiledUpdate) for door in torch_opt._plan.backend_cache.updates)
    floor = max(ulp_distance(p, e, dtype).max().item() for p, e in zip(torch_params, exact))
    print(f"ulps {ours} floor {floor}")
    assert ours <= max(floor, 1), (ours, floor)
    if master_weights:  # the params are their masters' roundings
        for p in params:
            assert torch.equal(p.detach(), opt.state[p]["master_param"].to(dtype))


# ------------------------------------------------------------------------------------------------------------
# The one compiled update (updates.CompiledUpdate, cpu_update.h over rules/<rule>/cpu.h) against the exact reference
# (exact_reference.ExactUpdate) on the same run: the same compiled norm pass and host decisions, only the update
# differs, so every param, master, moment, code and scale must be bit-identical. AdamW with fp32 state takes
# torch.optim.AdamW's fp64 scalars (rules/adamw/torch.py's FP32_STATE_SCALARS), not the reference's: these runs
# give it the reference's (`step_scalars`), so its loop and element are checked bit for bit here and its scalars
# against fp64 AdamW above (and, since the one op, against the former op's bits by benchmarks/fingerprint.py).

# a matrix, a tail block, tensors spanning 2 and 4 of the 65536-element chunks, one under the 8-bit small-tensor
# rule (fp32 moments in "8bit"), and a transposed grad (read from a copy; fp32 AdamW state takes `_fused_adamw_`)
LOWBIT_SHAPES = [(64, 100), (9000,), (70001,), (3 * 65536 + 5,), (130,), (300, 257)]
LOWBIT_CASES = {
    "clipped": dict(weight_decay=0.1, max_grad_norm=1.0),
    "amsgrad-maximize": dict(amsgrad=True, maximize=True, weight_decay=0.01, max_grad_norm=50.0),
    "bf16-master-zscore-spike": dict(
        dtype=torch.bfloat16, master_weights=True, clip="zscore", zscore_warmup=2, spike_skip_threshold=3.0
    ),
    "fp16-tensor-lr-schedule": dict(
        dtype=torch.float16, lr=torch.tensor(1e-2), lr_schedule=schedules.warmup_cosine(8, 2), amsgrad=True
    ),
}


def lowbit_grads(params, step):
    gen = torch.Generator().manual_seed(2000 + step)
    scale = 40.0 if step == 5 else 1.0 + step % 3  # a spike at step 5 (the z-score case skips it)
    for k, p in enumerate(params):
        g = torch.randn(p.shape[::-1] if k == 5 else p.shape, generator=gen) * scale
        p.grad = (g.t() if k == 5 else g).to(p.dtype)


def lowbit_run(precision, steps=7, dtype=torch.float32, **kwargs):
    gen = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in LOWBIT_SHAPES]
    kwargs.setdefault("lr", 1e-2)
    opt = FusedAdamW(params, state_precision=precision, backend="torch", **kwargs)
    for step in range(steps):
        lowbit_grads(params, step)
        grads = [p.grad.clone() for p in params]
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads)), "the grads were written"
    return params, opt


def update_kinds(opt) -> list[str]:
    """The implementation updating each param, in param order."""
    kinds = [""] * len(opt._plan.local_params)
    for update in opt._plan.backend_cache.updates:
        for i in update.indices if update.indices is not None else range(len(kinds)):
            kinds[i] = type(update).__name__
    return kinds


def assert_bit_identical(run, reference, only=None):
    (params, opt), (ref_params, ref_opt) = run, reference
    for index, (p, q) in enumerate(zip(params, ref_params)):
        if only is not None and index not in only:
            continue
        assert torch.equal(p.detach(), q.detach())
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert sorted(state) == sorted(ref_state)
        for key, value in state.items():
            assert value.dtype == ref_state[key].dtype and torch.equal(value, ref_state[key]), (tuple(p.shape), key)


def exact_reference_only(monkeypatch):
    """Every update through the exact reference (no compiled op, no `_fused_adamw_`), the rest of the step
    (compiled norm pass, host decisions) unchanged."""
    monkeypatch.setattr(CompiledUpdate, "fits", staticmethod(lambda *args: False))
    monkeypatch.setattr(NativeUpdate, "fits", staticmethod(lambda *args: False))


def compiled_or_exact(monkeypatch):
    """fp32 AdamW state on the compiled op with the exact reference's scalars, and on the reference where the op
    does not fit (not `_fused_adamw_`): every update is then the reference's arithmetic."""
    monkeypatch.setattr(adamw_torch, "FP32_STATE_SCALARS", None)
    monkeypatch.setattr(NativeUpdate, "fits", staticmethod(lambda *args: False))


@pytest.mark.parametrize("case", list(LOWBIT_CASES), ids=list(LOWBIT_CASES))
@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
def test_adamw_update_is_the_exact_reference_bit_for_bit(precision, case, monkeypatch):
    """Params, masters, fp32 and bf16 moments (stochastic rounding included), 8-bit codes and scales all
    bit-identical to the exact reference's after 7 steps, with the clip active (the coefficient applied once),
    amsgrad, maximize, weight decay, master weights, a tensor lr with a schedule, and a z-score spike skip."""
    kwargs = LOWBIT_CASES[case]
    compiled_or_exact(monkeypatch)
    ours = lowbit_run(precision, **kwargs)
    kinds = update_kinds(ours[1])
    transposed = "ExactUpdate" if precision == "fp32" else "CompiledUpdate"  # (the grad laid out unlike its param)
    assert kinds == ["CompiledUpdate"] * 5 + [transposed], kinds
    if kwargs.get("max_grad_norm") == 1.0:
        assert float(ours[1].grad_norm) > 1.0  # the clip was active
    if "spike_skip_threshold" in kwargs:
        assert int(ours[1].spike_skips) == 1  # the spike was skipped: state and scales untouched by it
    exact_reference_only(monkeypatch)
    reference = lowbit_run(precision, **kwargs)
    assert set(update_kinds(reference[1])) == {"ExactUpdate"}
    assert_bit_identical(ours, reference)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
def test_adamw_update_does_not_depend_on_the_thread_count(precision):
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(lowbit_run(precision, steps=3, amsgrad=True))
    finally:
        torch.set_num_threads(threads)
    assert_bit_identical(*runs)


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["host-decisions", "tensor-lr"])
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_lowbit_skipped_step_leaves_codes_and_scales_untouched(precision, tensor_lr):
    """A non-finite grad: no param, code, scale or moment changes (also with a tensor lr, whose tensor decisions
    are read back to the host for the compiled update), and the next finite step applies."""
    lr = torch.tensor(1e-2) if tensor_lr else 1e-2
    params, opt = lowbit_run(precision, steps=2, lr=lr, amsgrad=True)
    before = [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    lowbit_grads(params, 2)
    params[2].grad[17] = float("nan")
    opt.step()
    assert bool(opt.last_step_skipped)
    for p, old_p, old_state in zip(params, *before):
        assert torch.equal(p.detach(), old_p)
        for key, value in opt.state[p].items():
            assert torch.equal(value, old_state[key]), key
    lowbit_grads(params, 3)
    opt.step()
    assert not bool(opt.last_step_skipped) and float(opt.state[params[0]]["step"]) == 3.0


@pytest.mark.parametrize("scalars", ["fp64-scalars", "reference-scalars"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tensors_of_one_group_at_different_steps(precision, scalars, monkeypatch):
    """A param without a grad at the first step is one step behind the others of its group: the compiled update
    computes each distinct step's scalars once and gives each tensor its own, the same bits as with each param in
    a group of its own (one step count per call), for the fp64 scalars of fp32 state and the reference's."""
    if scalars == "reference-scalars":
        monkeypatch.setattr(adamw_torch, "FP32_STATE_SCALARS", None)

    def run(split):
        gen = torch.Generator().manual_seed(21)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (5000, 300, 7000)]
        groups = [{"params": [p]} for p in params] if split else [{"params": params}]
        opt = FusedAdamW(groups, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, state_precision=precision)
        for step in range(4):
            for k, p in enumerate(params):
                p.grad = None if step == 0 and k == 1 else torch.randn(p.shape, generator=gen)
            opt.step()
        assert set(update_kinds(opt)) == {"CompiledUpdate"}
        return params, opt

    ours = run(split=False)
    assert [float(ours[1].state[p]["step"]) for p in ours[0]] == [4.0, 3.0, 4.0]
    assert_bit_identical(ours, run(split=True))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("optimizer", [FusedAdamW, FusedLion], ids=["adamw", "lion"])
def test_each_group_takes_the_compiled_update_where_it_fits(optimizer, precision, monkeypatch):
    """A non-contiguous param takes `_fused_adamw_` (AdamW's fp32 state) or the exact reference; a contiguous one
    the compiled op; a grad laid out unlike its param (a group of its own) keeps AdamW's fp32 state on
    `_fused_adamw_` (the same bits as before the one op) and is read from a copy by the op otherwise; without the
    compiled ops `_fused_adamw_` or the reference (`FUSED_STABLE_CPU_OPS=0`: test_the_switch_skips_the_build).
    The compiled op's and the reference's params agree bit for bit (with the reference's scalars)."""

    def mixed():
        gen = torch.Generator().manual_seed(3)
        shapes = [(96, 80), (5000,), (64, 80)]
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        params[0] = torch.nn.Parameter(params[0].detach().t())  # not contiguous
        groups = [{"params": params[:2]}, {"params": params[2:]}]
        opt = optimizer(groups, lr=1e-2, weight_decay=0.1, state_precision=precision, backend="torch")
        for _ in range(3):
            for k, p in enumerate(params):
                g = torch.randn(p.shape[::-1], generator=gen)
                p.grad = g.t() if k == 2 else g.t().contiguous().view(p.shape) if k == 0 else g.view(p.shape)
            opt.step()
        return params, opt

    monkeypatch.setattr(adamw_torch, "FP32_STATE_SCALARS", None)
    adamw_fp32 = optimizer is FusedAdamW and precision == "fp32"
    other = "NativeUpdate" if adamw_fp32 else "ExactUpdate"
    ours = mixed()
    assert update_kinds(ours[1]) == [other, "CompiledUpdate", "NativeUpdate" if adamw_fp32 else "CompiledUpdate"]
    with monkeypatch.context() as patch:
        exact_reference_only(patch)
        compiled = [k for k, kind in enumerate(update_kinds(ours[1])) if kind == "CompiledUpdate"]
        assert_bit_identical(ours, mixed(), only=compiled)
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    assert update_kinds(mixed()[1]) == ["NativeUpdate" if adamw_fp32 else "ExactUpdate"] * 3


def test_every_rule_with_a_header_has_its_op():
    """One op per rules/*/cpu.h, named after its folder, and none for a rule without one (Muon's folder)."""
    with_header = set(cpu_ops.rule_headers())
    assert {"adamw", "lion"} <= with_header
    registered = {s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("fused_stable::update_")}
    assert registered == {f"fused_stable::update_{rule}" for rule in with_header}
    for rule in rules.RULES.values():
        assert (cpu_ops.update_op(rule) is not None) == (rule.package.rpartition(".")[2] in with_header)
    assert cpu_ops.update_op(rules.RULES["muon"]) is None


# a rule's hyper-parameters that reach every branch of its element (the rest at the declaration's defaults)
RULE_OPTIONS = {"sgd": dict(momentum=0.9, dampening=0.2)}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("rule", sorted(set(cpu_ops.rule_headers()) - {"adamw"}))
def test_every_rules_header_gives_the_exact_references_update(rule, precision, monkeypatch):
    """A rule's cpu.h alone gives its compiled CPU update: params and every state equal the exact reference's bit
    for bit (no clip: the norm passes of the two paths sum in other orders), on a tensor large enough for 8-bit
    codes, an odd one and a transposed grad. (AdamW, which also has torch's `_fused_adamw_` and torch's fp64
    scalars for fp32 state, has its own tests above.)"""
    import fused_stable

    def run(compiled: bool):
        monkeypatch.setattr(cpu_ops, "available", real_available if compiled else (lambda: False))
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((96, 80), (37,), (9, 13))]
        opt = fused_stable.OPTIMIZERS[rule].cls(
            params, lr=1e-2, state_precision=precision, backend="torch", **RULE_OPTIONS.get(rule, {})
        )
        for _ in range(4):
            grads = [torch.randn(p.shape, generator=gen) for p in params]
            grads[2] = grads[2].t().contiguous().t()
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        kinds = {type(u).__name__ for u in opt._plan.backend_cache.updates}
        return params, opt, kinds

    real_available = cpu_ops.available
    ours, opt, kinds = run(True)
    assert kinds == {"CompiledUpdate"}, kinds
    theirs, reference, kinds = run(False)
    assert kinds == {"ExactUpdate"}, kinds
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == reference.state[q].keys()
        for key, value in opt.state[p].items():
            assert torch.equal(value, reference.state[q][key]), key


# ------------------------------------------------------------------------------------------------------------
# Lion (issue 35): the compiled update (rules/lion/cpu.h over cpu_update.h) against the exact reference
# (exact_reference.ExactUpdate) on the same run: the same compiled norm pass and decisions, only the update
# differs, so every param, master and exp_avg must be bit-identical.

# odd sizes around the 65536-element chunks, a matrix, a 1-element and an empty tensor: many tensors in one call
LION_SHAPES = [(64, 100), (7,), (9000,), (65537 + 11,), (3 * 65536 + 5,), (1,), (0,), (130, 3)]
LION_CASES = {
    "fp32-clipped": dict(weight_decay=0.1, max_grad_norm=1.0),
    "bf16": dict(dtype=torch.bfloat16, weight_decay=0.05, max_grad_norm=1.0),
    "bf16-master-zscore-spike": dict(
        dtype=torch.bfloat16, master_weights=True, clip="zscore", zscore_warmup=2, spike_skip_threshold=3.0
    ),
    "fp16": dict(dtype=torch.float16, max_grad_norm=2.0, lr_schedule=schedules.warmup_cosine(8, 2)),
    "fp16-master-tensor-lr-schedule": dict(
        dtype=torch.float16,
        master_weights=True,
        lr=torch.tensor(3e-3),
        lr_schedule=schedules.warmup_cosine(8, 2),
        weight_decay=0.1,
    ),
    "bf16-state-clipped": dict(state_precision="bf16", weight_decay=0.1, max_grad_norm=1.0),
    "8bit-state-bf16-master": dict(
        state_precision="8bit", dtype=torch.bfloat16, master_weights=True, max_grad_norm=1.0
    ),
    "8bit-state-fp16-tensor-lr-zscore": dict(
        state_precision="8bit",
        dtype=torch.float16,
        lr=torch.tensor(3e-3),
        lr_schedule=schedules.warmup_cosine(8, 2),
        clip="zscore",
        zscore_warmup=2,
        spike_skip_threshold=3.0,
    ),
}


def lion_run(steps=7, dtype=torch.float32, nan_at=None, **kwargs):
    """FusedLion on the torch backend over LION_SHAPES, `steps` steps of fresh grads (lowbit_grads' spike at
    step 5), and a NaN grad at step `nan_at` (a skipped step); the grads are checked unwritten each step."""
    gen = torch.Generator().manual_seed(12)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in LION_SHAPES]
    kwargs.setdefault("lr", 1e-3)
    opt = FusedLion(params, backend="torch", **kwargs)
    for step in range(steps):
        gen = torch.Generator().manual_seed(3000 + step)
        scale = 40.0 if step == 5 else 1.0 + step % 3
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * scale).to(dtype)
        if step == nan_at:
            params[3].grad[17] = float("nan")
        grads = [p.grad.clone() for p in params]
        opt.step()
        for p, g in zip(params, grads):  # not written (a NaN stays a NaN)
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
    return params, opt


@pytest.mark.parametrize("case", list(LION_CASES), ids=list(LION_CASES))
def test_lion_update_is_the_exact_reference_bit_for_bit(case, monkeypatch):
    """Params, fp32 masters and exp_avg (fp32, bf16 stochastically rounded, 8-bit codes and scales) bit-identical
    to the exact reference's after 7 steps: the clip active, weight decay, bf16 / fp16 params with and without
    masters, an lr schedule (a float and a tensor lr), a z-score spike skip."""
    kwargs = LION_CASES[case]
    ours = lion_run(**kwargs)
    assert set(update_kinds(ours[1])) == {"CompiledUpdate"}  # in 8bit: small tensors keep fp32 exp_avg
    if kwargs.get("max_grad_norm") == 1.0:
        assert float(ours[1].grad_norm) > 1.0  # the clip was active
    if "spike_skip_threshold" in kwargs:  # some steps skipped (the spikes), most applied
        assert int(ours[1].spike_skips) in (1, 2, 3)
    exact_reference_only(monkeypatch)
    reference = lion_run(**kwargs)
    assert set(update_kinds(reference[1])) == {"ExactUpdate"}
    assert_bit_identical(ours, reference)
    if kwargs.get("master_weights"):  # the params are their masters' roundings to nearest even
        for p in ours[0]:
            assert torch.equal(p.detach(), ours[1].state[p]["master_param"].to(p.dtype))


def test_lion_skipped_step_leaves_everything_untouched(monkeypatch):
    """A NaN grad at step 2: nothing moves on that step, and the run stays the reference's."""
    params, opt = lion_run(steps=3, weight_decay=0.1, max_grad_norm=1.0)
    before = [p.detach().clone() for p in params], [opt.state[p]["exp_avg"].clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    params[2].grad[1] = float("nan")
    opt.step()
    assert bool(opt.last_step_skipped)
    for p, old_p, old_m in zip(params, *before):
        assert torch.equal(p.detach(), old_p) and torch.equal(opt.state[p]["exp_avg"], old_m)
    ours = lion_run(steps=4, nan_at=2, weight_decay=0.1, max_grad_norm=1.0)
    exact_reference_only(monkeypatch)
    assert_bit_identical(ours, lion_run(steps=4, nan_at=2, weight_decay=0.1, max_grad_norm=1.0))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
def test_lion_update_does_not_depend_on_the_thread_count(precision):
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            kwargs = dict(dtype=torch.bfloat16, master_weights=True, max_grad_norm=1.0, state_precision=precision)
            runs.append(lion_run(steps=3, **kwargs))
    finally:
        torch.set_num_threads(threads)
    assert_bit_identical(*runs)


# ------------------------------------------------------------------------------------------------------------
# A new rule's fast CPU path is its header alone: a test-only rule (heavy-ball momentum, and an option that keeps
# the largest |momentum| as a second state) in a temporary rules folder, built by cpu_ops (no other file of it
# exists), against the same arithmetic in torch, bit for bit, in each state format.

TINY_RULE = """
#pragma once
#include <algorithm>
#include <cmath>
namespace fused_stable {
namespace tiny {
struct Rule {
  static constexpr int kNumScalars = 3;
  static constexpr bool kHasOption = true;
  static constexpr int num_states(bool keep_peak) { return keep_peak ? 2 : 1; }
  struct Scalars {
    float grad_mul, lr, beta;
    explicit Scalars(const float* row) : grad_mul(row[0]), lr(row[1]), beta(row[2]) {}
  };
  template <bool kKeepPeak>
  __attribute__((always_inline)) static inline void element(float& p, float g, float& m, float& peak, float&,
                                                             const Scalars& s) {
    g = g * s.grad_mul;
    m = m * s.beta + g;
    if (kKeepPeak) {
      peak = std::max(peak, std::fabs(m));
    }
    p = p - s.lr * m;
  }
};
}  // namespace tiny
}  // namespace fused_stable
"""

TINY_RULE_RUN = """
    import sys
    from pathlib import Path
    import torch
    from fused_stable.backends.torch import cpu_ops
    print("built", cpu_ops.build_and_load(Path(sys.argv[1]), {"tiny": (0b01, 0b01, 0b01, 0b01)}))
    calls = torch.load(sys.argv[2])
    for call in calls:
        torch.ops.fused_stable.update_tiny(*call)
    torch.save(calls, sys.argv[3])
"""

TINY_SIZES = (300, 65536 + 200)  # a partial block, and two chunks
TINY_ROW = torch.tensor([[0.75, 0.01, 0.9]])  # grad_mul, lr, beta
SIGNED_MOMENTUM = 0b01  # 8-bit: the momentum signed, the peak unsigned; bf16: the momentum stochastic


def tiny_call(fmt: int, keep_peak: bool, seed: int) -> list:
    """One op call's arguments: two fp32 params (the second with fp32 state fits any format's codes), states in
    `fmt` from seeded values, slot by slot."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in TINY_SIZES]
    grads = [torch.randn(n, generator=gen) for n in TINY_SIZES]
    values = [[torch.randn(n, generator=gen) for n in TINY_SIZES]]
    if keep_peak:
        values.append([v.abs() * 2 for v in values[0]])
    states, scales = [], []
    for slot, slot_values in enumerate(values):
        for v in slot_values:
            if fmt == Q8:
                codes, scale = state_format.ENCODERS[slot](tiny_blocks(v))  # slot 0 SIGNED (0), slot 1 UNSIGNED (1)
                states.append(codes.view(-1)[: v.numel()].clone())
                scales.append(scale)
            else:
                states.append(v.to(torch.bfloat16) if fmt == BF16 else v)
    keys = torch.tensor([12345, 678], dtype=torch.int64)
    first_elements = torch.tensor([0, 5 * 2**31 + 3], dtype=torch.int64)  # the second a shard's (its low 32 bits)
    return [params, grads, states, scales, [], TINY_ROW, keys, first_elements, fmt, keep_peak, SIGNED_MOMENTUM,
            SIGNED_MOMENTUM]  # fmt: skip


def tiny_blocks(v: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(state_format.num_blocks(v.numel()) * state_format.QUANT_BLOCK)
    padded[: v.numel()] = v
    return padded.view(-1, state_format.QUANT_BLOCK)


def tiny_expected(call: list) -> list:
    """The same update in torch's fp32 ops (each op rounded as the element's), the states decoded and stored as
    cpu_update.h does: bf16 momentum stochastically rounded with the reference's bits, 8-bit by block."""
    params, grads, states, scales, _, row, keys, first_elements, fmt, keep_peak = call[:10]
    grad_mul, lr, beta = row[0]
    n, num_states = len(params), 2 if keep_peak else 1
    new_params, new_states, new_scales = [], [[] for _ in range(num_states)], [[] for _ in range(num_states)]
    for t, (p, g) in enumerate(zip(params, grads)):
        slots = [states[slot * n + t] for slot in range(num_states)]
        if fmt == Q8:
            decoded = [
                state_format.DECODERS[k](tiny_blocks(s), scales[k * n + t]).view(-1)[: s.numel()]
                for k, s in enumerate(slots)
            ]
        else:
            decoded = [s.float() for s in slots]
        m = decoded[0] * beta + g * grad_mul
        new_params.append(p - lr * m)
        for k, value in enumerate([m, torch.maximum(decoded[1], m.abs())] if keep_peak else [m]):
            if fmt == Q8:
                codes, scale = state_format.ENCODERS[k](tiny_blocks(value))
                new_states[k].append(codes.view(-1)[: value.numel()])
                new_scales[k].append(scale)
            elif fmt == BF16 and k == 0:  # SIGNED_MOMENTUM: slot 0 rounds stochastically
                bits = state_format.random_bits(keys[t], first_elements[t] + torch.arange(value.numel()))
                new_states[k].append(state_format.round_stochastic_bf16(value, bits))
            else:
                new_states[k].append(value.to(torch.bfloat16) if fmt == BF16 else value)
    return new_params, sum(new_states, []), sum(new_scales, [])  # slot by slot, as the op's lists


def test_a_rule_header_alone_gives_its_op(tmp_path):
    """rules/tiny/cpu.h and nothing else: cpu_ops generates, builds and registers `fused_stable::update_tiny`
    (a fresh extensions folder, in a child process: this one holds the project's library), and the op is the
    rule's arithmetic bit for bit with and without its option, in fp32, bf16 and 8-bit state."""
    (tmp_path / "rules" / "tiny").mkdir(parents=True)
    (tmp_path / "rules" / "tiny" / "cpu.h").write_text(TINY_RULE)
    cases = [(FP32, False), (FP32, True), (BF16, True), (Q8, True), (Q8, False)]
    calls = [tiny_call(fmt, keep_peak, seed) for seed, (fmt, keep_peak) in enumerate(cases)]
    torch.save(calls, tmp_path / "calls.pt")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TINY_RULE_RUN), str(tmp_path / "rules"), str(tmp_path / "calls.pt"),
         str(tmp_path / "after.pt")],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    after = torch.load(tmp_path / "after.pt")
    for (fmt, keep_peak), before, ours in zip(cases, calls, after):
        params, states, scales = tiny_expected(before)
        assert all(torch.equal(a, b) for a, b in zip(ours[0], params)), (fmt, keep_peak, "params")
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours[2], states)), (fmt, keep_peak)
        assert all(torch.equal(a, b) for a, b in zip(ours[3], scales)), (fmt, keep_peak, "scales")
        assert all(torch.equal(a, b) for a, b in zip(ours[1], before[1])), "the grads were written"
