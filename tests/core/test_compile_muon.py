"""FusedMuon's step inside torch.compile (issue 50 item 3): the Muon groups are updated inside the compiled step's
custom op (compiled.py), right after the fused step, from its decisions, with the groups' hyper-parameters read
when the op runs: the same bits as eager steps on the eager, aot_eager and inductor backends, fp32 and 8-bit
momentum, through a skipped step, a hand-written lr and a changed momentum; the Gram products by blocks too."""

from __future__ import annotations

import pytest
import torch
from helpers import count_symmetric_products
from torch._dynamo.utils import counters

from fused_stable import FusedAdafactor, FusedMuon
from fused_stable.rules import muon
from fused_stable.rules.muon import newton_schulz

SHAPES = [(128, 64), (64, 96), (17, 5), (16,)]


def _run(backend, precision, steps=5):
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]
    groups = [{"params": params[:3], "use_muon": True, "lr": 0.02}, {"params": params[3:], "use_muon": False}]
    opt = FusedMuon(groups, max_grad_norm=1.0, state_precision=precision, backend="torch")
    step = opt.step if backend is None else torch.compile(opt.step, backend=backend)
    for index in range(steps):
        gen = torch.Generator().manual_seed(100 + index)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 3
        if index == 2:
            params[0].grad[0, 0] = float("inf")  # a skipped step
        if index == 3:
            opt.param_groups[0]["lr"] = 0.01  # a hand-written lr
        if index == 4:
            opt.param_groups[0]["momentum"] = 0.9  # a changed momentum
        step()
    return params, opt, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("precision", ["fp32", "8bit"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_compiled_fused_muon_step_is_the_eager_step_bit_for_bit(backend, precision):
    eager, eager_opt, _ = _run(None, precision)
    ours, opt, graphs = _run(backend, precision)
    assert int(opt.skipped_steps) == 1
    for index, (a, b) in enumerate(zip(ours, eager)):
        assert torch.equal(a, b), f"param {index}"
        for key, value in eager_opt.state[b].items():
            assert torch.equal(opt.state[a][key], value), f"{key} of param {index}"
    # recompiles (measured): the first trace, then one per float that changes for the first time (the lr, the
    # momentum): dynamo specialises on a float until it changes once, then takes it as an input (docs/optimizer.md)
    assert graphs == 3, graphs


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_schedulers_lr_reaches_every_compiled_step(backend):
    """torch's LambdaLR writes the Muon group's lr before every step: each compiled step takes it (bit for bit the
    eager run), in 2 graphs over 8 steps (the trace, and one retrace when the lr first changes)."""

    def run(compile_backend):
        torch._dynamo.reset()
        counters.clear()
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES[:2]]
        opt = FusedMuon([{"params": params, "use_muon": True, "lr": 0.02}], backend="torch")
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        step = opt.step if compile_backend is None else torch.compile(opt.step, backend=compile_backend)
        for index in range(8):
            gen = torch.Generator().manual_seed(100 + index)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            step()
            scheduler.step()
        return params, counters["stats"]["unique_graphs"]

    eager, _ = run(None)
    ours, graphs = run(backend)
    assert all(torch.equal(a, b) for a, b in zip(ours, eager))
    assert graphs == 2, graphs


def test_fused_adafactor_stays_refused_inside_torch_compile():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = FusedAdafactor([p], backend="torch")
    p.grad = torch.ones(4, 4)
    with pytest.raises(Exception, match="does not run inside torch.compile"):
        torch.compile(opt.step, fullgraph=True)()


def test_a_compiled_step_runs_the_gram_products_by_blocks(monkeypatch):
    """FUSED_STABLE_NEWTON_SCHULZ_BLOCKS=1 (a CPU without AMX's choice) on a 384-row Gram side: inside the compiled
    step's op the Gram products go by blocks (both, every iteration, every step), the eager step's bits."""
    monkeypatch.setenv(newton_schulz.BLOCKS_ENV, "1")
    calls = count_symmetric_products(monkeypatch)

    def run(backend):
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(384, 400), (16,)]]
        groups = [{"params": params[:1], "use_muon": True}, {"params": params[1:], "use_muon": False}]
        opt = FusedMuon(groups, max_grad_norm=1.0, backend="torch")
        step = opt.step if backend is None else torch.compile(opt.step, backend=backend)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            step()
        return params

    eager = run(None)
    calls.clear()
    compiled = run("eager")
    assert len(calls) == 3 * 2 * muon.NS_STEPS, len(calls)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
