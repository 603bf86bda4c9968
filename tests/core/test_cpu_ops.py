"""The CPU step's compiled ops (fused_stable/backends/torch/cpu_ops.py, cpu_step.cpp): the norm pass against an fp64
reference, the update against fp64 AdamW with torch's own error as the floor, grads never written, `step`
advanced only when applied, the same sums whatever the thread count, and the build's fallback (a real failed
build: no compiler); AdamW's bf16 / 8-bit op and Lion's op against the exact reference, bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import reference_adamw_fp64, ulp_distance

from fused_stable import FusedAdamW, FusedLion, schedules
from fused_stable.backends.torch import cpu_ops
from fused_stable.backends.torch.updates import CompiledLionUpdate, CompiledUpdate, LowbitUpdate

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the compiled CPU ops could not be built here")

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
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    max_sqs = [torch.zeros_like(p) for p in params] if amsgrad else []
    steps = [torch.zeros(()) for _ in params]
    for step in range(3):
        before = [g.clone() for g in grads[step]]
        cpu_ops.adamw(
            ours, grads[step], exp_avgs, exp_avg_sqs, max_sqs, steps, lr=hp["lr"], beta1=0.9, beta2=0.99,
            weight_decay=0.1, eps=1e-8, maximize=maximize, grad_mul=0.37,
        )  # fmt: skip
        assert all(torch.equal(g, b) for g, b in zip(grads[step], before)), "the grads were written"
    assert all(s.item() == 3.0 for s in steps)
    floor = max((t.double() - e).abs().max().item() for t, e in zip(torch_fp32, exact) if e.numel())
    worst = max((o.double() - e).abs().max().item() for o, e in zip(ours, exact) if e.numel())
    assert worst <= 2 * floor + 1e-9, (worst, floor)


def test_adamw_refuses_lists_of_other_lengths_and_dtypes():
    p = torch.zeros(4)
    with pytest.raises(RuntimeError, match="one tensor per param"):
        cpu_ops.adamw(
            [p], [], [p.clone()], [p.clone()], [], [torch.zeros(())], lr=1e-3, beta1=0.9, beta2=0.999,
            weight_decay=0.0, eps=1e-8, maximize=False, grad_mul=1.0,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        cpu_ops.adamw(
            [p], [p.double()], [p.clone()], [p.clone()], [], [torch.zeros(())], lr=1e-3, beta1=0.9, beta2=0.999,
            weight_decay=0.0, eps=1e-8, maximize=False, grad_mul=1.0,
        )  # fmt: skip


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


def test_the_build_name_covers_the_rules_headers(tmp_path, monkeypatch):
    """The source includes the rule's element (rules/adamw/cpu.h): a change to a header must rebuild, so the
    build's name hashes every rule's header as it hashes the source."""
    assert cpu_ops.INCLUDE_DIR / "adamw" / "cpu.h" in cpu_ops.HEADERS
    header = tmp_path / "cpu.h"
    header.write_text(cpu_ops.HEADERS[0].read_text())
    monkeypatch.setattr(cpu_ops, "HEADERS", [header])
    same = cpu_ops.build_fingerprint()
    header.write_text(header.read_text() + "\n// one more line\n")
    assert cpu_ops.build_fingerprint() != same


def test_the_package_ships_the_source_and_the_rules_headers():
    """An installed package builds the ops from its own files: pyproject's package-data carries the .cpp and
    every rule's header (a wheel built from it holds fused_stable/rules/adamw/cpu.h)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert package_data["fused_stable.backends.torch"] == ["*.cpp"]
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
# bf16 and 8-bit state (issue 36 item 1): the compiled op (cpu_ops.adamw_lowbit, updates.LowbitUpdate) against
# the exact reference (exact_reference.ExactUpdate) on the same run: the same compiled norm pass and host
# decisions, only the update door differs, so every code, scale, moment and param must be bit-identical.

# a matrix, a tail block, tensors spanning 2 and 4 of the 65536-element chunks, one under the 8-bit small-tensor
# rule (fp32 moments in "8bit": the fp32 op), and a transposed grad (read from a copy)
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


def lowbit_doors(opt):
    return [type(door).__name__ for door in opt._plan.backend_cache.updates]


def assert_bit_identical(run, reference):
    (params, opt), (ref_params, ref_opt) = run, reference
    for p, q in zip(params, ref_params):
        assert torch.equal(p.detach(), q.detach())
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert sorted(state) == sorted(ref_state)
        for key, value in state.items():
            assert value.dtype == ref_state[key].dtype and torch.equal(value, ref_state[key]), (tuple(p.shape), key)


def exact_reference_only(monkeypatch):
    """Every bf16 / 8-bit update through the exact reference, the rest of the step unchanged."""
    monkeypatch.setattr(LowbitUpdate, "fits", staticmethod(lambda *args: False))


@pytest.mark.parametrize("case", list(LOWBIT_CASES), ids=list(LOWBIT_CASES))
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_lowbit_update_is_the_exact_reference_bit_for_bit(precision, case, monkeypatch):
    """Codes, scales, bf16 moments (stochastic rounding included), masters and params all bit-identical to the
    exact reference's after 7 steps, with the clip active (the coefficient applied once), amsgrad, maximize,
    weight decay, master weights, a tensor lr with a schedule, and a z-score spike skip."""
    kwargs = LOWBIT_CASES[case]
    ours = lowbit_run(precision, **kwargs)
    assert "LowbitUpdate" in lowbit_doors(ours[1]) and "ExactUpdate" not in lowbit_doors(ours[1])
    if kwargs.get("max_grad_norm") == 1.0:
        assert float(ours[1].grad_norm) > 1.0  # the clip was active
    if "spike_skip_threshold" in kwargs:
        assert int(ours[1].spike_skips) == 1  # the spike was skipped: state and scales untouched by it
    exact_reference_only(monkeypatch)
    reference = lowbit_run(precision, **kwargs)
    assert "LowbitUpdate" not in lowbit_doors(reference[1])
    assert_bit_identical(ours, reference)


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_lowbit_update_does_not_depend_on_the_thread_count(precision):
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


def test_lowbit_doors_fall_back_to_the_exact_reference(monkeypatch):
    """A non-contiguous param's bf16 / 8-bit state takes the exact reference (which walks any layout), the rest
    the compiled op, in one step that agrees with the reference everywhere; without the compiled ops every
    bf16 / 8-bit update is the reference's (`FUSED_STABLE_CPU_OPS=0`: test_the_switch_skips_the_build)."""

    def mixed(precision):
        gen = torch.Generator().manual_seed(3)
        params = [
            torch.nn.Parameter(torch.randn(80, 96, generator=gen).t()),
            torch.nn.Parameter(torch.randn(5000, generator=gen)),
        ]
        opt = FusedAdamW(params, lr=1e-2, state_precision=precision, backend="torch")
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return params, opt

    for precision in ("bf16", "8bit"):
        ours = mixed(precision)
        assert sorted(lowbit_doors(ours[1])) == ["ExactUpdate", "LowbitUpdate"]
        with monkeypatch.context() as patch:
            exact_reference_only(patch)
            assert_bit_identical(ours, mixed(precision))
        with monkeypatch.context() as patch:
            patch.setattr(cpu_ops, "available", lambda: False)
            assert lowbit_doors(mixed(precision)[1]) == ["ExactUpdate", "ExactUpdate"]


def test_lowbit_adamw_refuses_wrong_lists():
    p, codes = torch.zeros(256), torch.zeros(256, dtype=torch.int8)
    scalars, keys = torch.zeros(1, 8), torch.zeros(1, dtype=torch.int64)
    lists = ([codes], [codes.to(torch.uint8)], [])
    with pytest.raises(RuntimeError, match="scales in 8bit only"):
        cpu_ops.adamw_lowbit([p], [p], lists, ([], [], []), masters=None, scalars=scalars, keys=keys, state_format=2)
    with pytest.raises(RuntimeError, match="one per block of 128"):
        scales = ([torch.zeros(3)], [torch.zeros(2)], [])
        cpu_ops.adamw_lowbit([p], [p], lists, scales, masters=None, scalars=scalars, keys=keys, state_format=2)
    with pytest.raises(RuntimeError, match="state format's dtypes"):
        cpu_ops.adamw_lowbit([p], [p], lists, ([], [], []), masters=None, scalars=scalars, keys=keys, state_format=1)


# ------------------------------------------------------------------------------------------------------------
# Lion (issue 35): the compiled op (cpu_ops.lion, rules/lion/cpu.h, updates.CompiledLionUpdate) against the exact
# reference (exact_reference.ExactUpdate) on the same run: the same compiled norm pass and decisions, only the
# update door differs, so every param, master and exp_avg must be bit-identical.

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


def lion_reference_only(monkeypatch):
    """Every Lion update through the exact reference, the rest of the step (compiled norm pass) unchanged."""
    monkeypatch.setattr(CompiledLionUpdate, "fits", staticmethod(lambda *args: False))


@pytest.mark.parametrize("case", list(LION_CASES), ids=list(LION_CASES))
def test_lion_update_is_the_exact_reference_bit_for_bit(case, monkeypatch):
    """Params, fp32 masters and exp_avg (fp32, bf16 stochastically rounded, 8-bit codes and scales) bit-identical
    to the exact reference's after 7 steps: the clip active, weight decay, bf16 / fp16 params with and without
    masters, an lr schedule (a float and a tensor lr), a z-score spike skip."""
    kwargs = LION_CASES[case]
    ours = lion_run(**kwargs)
    assert set(lowbit_doors(ours[1])) == {"CompiledLionUpdate"}  # in 8bit: small tensors keep fp32 exp_avg
    if kwargs.get("max_grad_norm") == 1.0:
        assert float(ours[1].grad_norm) > 1.0  # the clip was active
    if "spike_skip_threshold" in kwargs:  # some steps skipped (the spikes), most applied
        assert int(ours[1].spike_skips) in (1, 2, 3)
    lion_reference_only(monkeypatch)
    reference = lion_run(**kwargs)
    assert set(lowbit_doors(reference[1])) == {"ExactUpdate"}
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
    lion_reference_only(monkeypatch)
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


def test_lion_door_is_taken_only_where_it_fits(monkeypatch):
    """A non-contiguous param and a build without the compiled ops take the exact reference; the contiguous
    tensors of the same step the compiled op (fp32, bf16 or 8-bit exp_avg), and the step agrees with the
    reference."""

    def mixed(**kwargs):
        gen = torch.Generator().manual_seed(4)
        params = [
            torch.nn.Parameter(torch.randn(80, 96, generator=gen).t()),
            torch.nn.Parameter(torch.randn(5000, generator=gen)),
        ]
        opt = FusedLion(params, lr=1e-2, weight_decay=0.1, backend="torch", **kwargs)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return params, opt

    for precision in ("fp32", "bf16", "8bit"):
        ours = mixed(state_precision=precision)
        assert sorted(lowbit_doors(ours[1])) == ["CompiledLionUpdate", "ExactUpdate"], precision
        with monkeypatch.context() as patch:
            lion_reference_only(patch)
            assert_bit_identical(ours, mixed(state_precision=precision))
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    assert lowbit_doors(mixed()[1]) == ["ExactUpdate", "ExactUpdate"]


def test_lion_door_on_tensor_decisions_is_the_reference():
    """`on_tensors` (the 0-dim tensor decisions) delegates to the exact reference of the same tensors: the same
    bits as the compiled `on_host`, and a skip leaves everything untouched."""
    params, opt = lion_run(steps=2, dtype=torch.bfloat16, master_weights=True)
    (door,) = opt._plan.backend_cache.updates
    state = [p.detach().clone() for p in params] + [t.clone() for p in params for t in opt.state[p].values()]
    grads = [torch.randn(p.shape).to(p.dtype) for p in params]
    hp = opt.hparam_rows()[0]
    grad_mul, skip, lr_factor = (torch.tensor(x) for x in (0.5, 1.0, 0.8))
    after = [p.detach() for p in params] + [t for p in params for t in opt.state[p].values()]
    with torch.no_grad():
        door.on_tensors(grads, hp, grad_mul, skip, lr_factor, grad_mul.reciprocal())
        assert all(torch.equal(a, b) for a, b in zip(after, state))
        door.on_tensors(grads, hp, grad_mul, torch.tensor(0.0), lr_factor, grad_mul.reciprocal())
        by_tensors = [t.clone() for t in after]
        assert not all(torch.equal(a, b) for a, b in zip(by_tensors, state))  # applied
        for t, old in zip(after, state):
            t.copy_(old)
        door.on_host(grads, hp, grad_mul.numpy(), lr_factor.numpy(), None)
    assert all(torch.equal(a, b) for a, b in zip(after, by_tensors))


def test_lion_op_refuses_wrong_lists():
    p, scalars = torch.zeros(256), torch.zeros(7)
    with pytest.raises(RuntimeError, match="one tensor per param"):
        cpu_ops.lion([p], [p], [], masters=None, scalars=scalars)
    with pytest.raises(RuntimeError, match="7 contiguous fp32"):
        cpu_ops.lion([p], [p], [p.clone()], masters=None, scalars=torch.zeros(8))
    with pytest.raises(RuntimeError, match="in the state format's dtype"):
        cpu_ops.lion([p], [p], [p.to(torch.bfloat16)], masters=None, scalars=scalars)
    codes = torch.zeros(256, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="scales in 8bit only"):
        cpu_ops.lion([p], [p], [codes], masters=None, scalars=scalars, state_format=2)
    with pytest.raises(RuntimeError, match="one per block of 128"):
        cpu_ops.lion([p], [p], [codes], masters=None, scalars=scalars, state_format=2, exp_avg_scales=[torch.zeros(3)])
