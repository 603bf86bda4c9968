"""FusedAdafactor's compiled CPU op (rules/adafactor/cpu_matrix.cpp, `fused_stable::adafactor_factored`): the torch
backend's host path steps its contiguous fp32 matrices in three passes, and everything else with torch's for-loop.

The op's element arithmetic is torch's; its reductions (row, column, param and update norms) are fp64 sums rounded
once, where torch sums in fp32 in its own order, so it is not torch's bits: it is held to the floor measured in the
same test, torch's fp32 step against its fp64 one (|ours - fp64| <= 2 |torch fp32 - fp64| + one fp32 ulp). Its sums
are cut into fixed units of rows: the thread count changes no bit.
"""

from __future__ import annotations

import pytest
import torch

import fused_stable.rules.adafactor.torch as adafactor_torch
from fused_stable import FusedAdafactor
from fused_stable.backends.torch import cpu_ops

# odd sizes; 2-D to 4-D; rows or columns of one; matrices cut into several units of rows (at least 65536 elements:
# (300, 700) is 4 units, (2, 150, 1000) 3 per batch entry); vectors and a 0-D param stay on torch's for-loop
SHAPES = [(37, 53), (3, 5, 7), (2, 3, 4, 5), (64, 65), (1, 9), (9, 1), (300, 700), (2, 150, 1000), (1000,), (3,), ()]
OTHER_GROUP = dict(weight_decay=0.1, maximize=True, d=1.5, beta2_decay=-1.0, lr=0.02)
EPS = (1e-7, 1e-3)  # given: eps1's default is the dtype's machine epsilon, which differs between fp32 and fp64
STEPS = 5


@pytest.fixture(autouse=True)
def compiled_ops():
    assert cpu_ops.available(), "the compiled CPU ops did not build: these tests are about them"


def _params(dtype=torch.float32, shapes=SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)) for s in shapes]


def _groups(params: list) -> list[dict]:
    """Two groups: torch's defaults but eps, and every keyword changed (OTHER_GROUP)."""
    half = len(params) // 2
    return [{"params": params[:half], "eps": EPS}, {"params": params[half:], **OTHER_GROUP, "eps": EPS}]


def _run(opt, params, steps: int = STEPS, max_norm=None, scale: float = 30.0) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 + step)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(p.dtype)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()


@pytest.fixture
def taken(monkeypatch) -> list[int]:
    """The number of params each call of the compiled op was given."""
    calls = []
    real = adafactor_torch.factored_op

    def spy(params, *args):
        calls.append(len(params))
        return real(params, *args)

    monkeypatch.setattr(adafactor_torch, "factored_op", spy)
    return calls


def _floor_check(ours, ref32, ref64, what: str) -> None:
    for index, (a, b, c) in enumerate(zip(ours, ref32, ref64)):
        a, b, c = a.detach().double(), b.detach().double(), c.detach().double()
        excess = (a - c).abs() - 2 * (b - c).abs().max() - torch.finfo(torch.float32).eps * c.abs()
        assert not (excess > 0).any(), f"{what} {index} {tuple(c.shape)}: worst |diff| {(a - c).abs().max():.3e}"


@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["no-clip", "clip"])
def test_the_op_steps_the_fp32_matrices_within_the_floor(taken, max_norm):
    """5 steps of both groups, grads 30x the clip threshold with a clip: the params and the factored states within
    the floor of torch's fp32 step against its fp64 one; the op took every fp32 matrix (8 of 11), once a step."""
    ours = _params()
    opt = FusedAdafactor(_groups(ours), max_grad_norm=max_norm, backend="torch")
    _run(opt, ours, max_norm=max_norm)
    assert taken == [8] * STEPS
    refs = []
    for dtype in (torch.float32, torch.float64):
        params = _params(dtype)
        ref = torch.optim.Adafactor(_groups(params), eps=EPS)
        _run(ref, params, max_norm=max_norm)
        refs.append((params, ref))
    (ref32, opt32), (ref64, opt64) = refs
    _floor_check(ours, ref32, ref64, "param")
    for key in ("row_var", "col_var", "variance"):
        has = [i for i, p in enumerate(ours) if key in opt.state[p]]
        states = [[o.state[ps[i]][key] for i in has] for o, ps in ((opt, ours), (opt32, ref32), (opt64, ref64))]
        _floor_check(*states, key)
    moved = [not torch.equal(p, q) for p, q in zip(ours[:8], ref32[:8])]
    assert any(moved)  # not torch's for-loop under another name: its sums differ in the last bits


def test_the_thread_count_changes_no_bit(taken):
    """The sums are cut into fixed units of rows, added in unit order: 1 and 2 threads give the same bits."""
    runs = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            params = _params()
            opt = FusedAdafactor(_groups(params), max_grad_norm=1.0, backend="torch")
            _run(opt, params)
            runs.append((params, opt))
    finally:
        torch.set_num_threads(threads)
    (one, opt_one), (two, opt_two) = runs
    for index, (a, b) in enumerate(zip(one, two)):
        assert torch.equal(a, b), f"param {index}"
        assert all(torch.equal(opt_one.state[a][k], opt_two.state[b][k]) for k in opt_one.state[a]), f"state {index}"
    assert taken and all(n == 8 for n in taken)


def test_what_the_op_does_not_take_is_torchs_for_loop(taken):
    """bf16 matrices, vectors, 0-D params and a matrix whose grad is not contiguous: torch's for-loop, bit for bit
    torch.optim.Adafactor, with the compiled ops on."""
    shapes = [(7, 11), (1000,), (), (5, 9)]
    ours = _params(torch.bfloat16, shapes[:1]) + _params(shapes=shapes[1:])
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    # the bf16 param in its own group: torch's for-loop takes a group's eps1 from its first param's dtype
    opt = FusedAdafactor([{"params": ours[:1]}, {"params": ours[1:]}], backend="torch")
    ref = torch.optim.Adafactor([{"params": theirs[:1]}, {"params": theirs[1:]}])
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen).to(a.dtype)
            a.grad, b.grad = g, g.clone()
        ours[3].grad = torch.randn((9, 5), generator=gen).mT  # (5, 9), not contiguous
        theirs[3].grad = ours[3].grad.clone()
        assert ours[0].grad.is_contiguous() and not ours[3].grad.is_contiguous()
        opt.step()
        ref.step()
    assert taken == []
    for index, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"param {index}"
        assert all(torch.equal(opt.state[a][k], ref.state[b][k]) for k in ref.state[b]), f"state {index}"


def test_the_op_refuses_what_it_cannot_step():
    """One line that says what is wrong, and nothing written."""
    p, g = torch.zeros(4, 6), torch.ones(4, 6)
    row, col = torch.zeros(4, 1), torch.zeros(1, 6)
    op = torch.ops.fused_stable.adafactor_factored
    with pytest.raises(RuntimeError, match="scalars must be contiguous fp64"):
        op([p], [g], [row], [col], torch.zeros(1, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous fp32 CPU tensors of >= 2 dims"):
        op([torch.zeros(6)], [torch.ones(6)], [row], [col], torch.zeros(1, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="row_var"):
        op([p], [g], [torch.zeros(3, 1)], [col], torch.zeros(1, 8, dtype=torch.float64))
    assert not p.any() and not row.any() and not col.any()
