"""CUDA-only checks of the compiled Triton kernels; skipped cleanly where there is no CUDA device.

Run on a GPU machine by benchmarks/gpu_check.sh: parity with torch, no host syncs, CUDA-graph replay,
launches per step.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close

import fused_stable
from fused_stable import FusedAdamW, schedules

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = [(0,), (1,), (1023,), (1025,), (65537,), (300, 301), (), (3, 5, 7), (0,)]


def cuda_params(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).to(dtype)) for s in shapes]


@pytest.mark.parametrize("max_norm", [1.0, None])
def test_cuda_parity_with_torch(max_norm):
    ours = cuda_params(SHAPES)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.1, max_grad_norm=max_norm)
    assert opt.backend == "triton"
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for _ in range(8):
        for a, b in zip(ours, theirs):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        ref.step()
    for a, b in zip(ours, theirs):
        assert_close(a, b, 1e-5, 1e-6, "param")
        if b.numel():
            assert_close(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"], 1e-5, 1e-9, "exp_avg_sq")


def test_cuda_skip_on_nonfinite_and_no_sync():
    params = cuda_params([(4097,), (33,)], torch.bfloat16)
    opt = FusedAdamW(
        params, lr=1e-2, max_grad_norm=1.0, master_weights=True, lr_schedule=schedules.warmup_cosine(10, 2)
    )
    scaler = fused_stable.GradScaler("cuda", init_scale=2.0**8)
    for step in range(6):
        opt.zero_grad()
        loss = sum((p.float() * (step + 1)).square().sum() for p in params)
        if step == 3:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert opt.skipped_steps.item() == 1
    assert opt.applied_steps.item() == 5


def replay_against_eager(opt_e, opt_g, eager, graphed, grads, between=None) -> None:
    """Eager steps of `opt_e` on `eager` beside one captured step of `opt_g` on `graphed`, replayed on static grads:
    the first step of each list eagerly (on a side stream for the graphed side: it builds and caches the tables),
    then the capture, then one eager step and one replay per later entry of `grads`; `between(index)` runs before
    each of those (a change both sides must see)."""
    static_grads = [torch.zeros_like(p) for p in graphed]
    for p, g in zip(graphed, static_grads):
        p.grad = g
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for g, s in zip(grads[0], static_grads):
            s.copy_(g)
        opt_g.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_g.step()
    for p, g in zip(eager, grads[0]):
        p.grad = g.clone()
    opt_e.step()
    for index, step_grads in enumerate(grads[1:]):
        if between is not None:
            between(index)
        for p, g in zip(eager, step_grads):
            p.grad = g.clone()
        opt_e.step()
        for s, g in zip(static_grads, step_grads):
            s.copy_(g)
        graph.replay()
    torch.cuda.synchronize()


def cuda_grads(params, steps, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [[torch.randn(p.shape, device="cuda", generator=gen) for p in params] for _ in range(steps)]


def test_cuda_graph_replay_equals_eager():
    eager = cuda_params([(1025,), (7, 9)], seed=1)
    graphed = [torch.nn.Parameter(p.detach().clone()) for p in eager]
    kwargs = dict(
        lr=torch.tensor(1e-2, device="cuda"),
        max_grad_norm=1.0,
        capturable=True,
        lr_schedule=schedules.warmup_linear(20, 3),
    )
    opt_e, opt_g = FusedAdamW(eager, **kwargs), FusedAdamW(graphed, **kwargs)
    replay_against_eager(opt_e, opt_g, eager, graphed, cuda_grads(eager, 8, seed=5))
    for a, b in zip(graphed, eager):
        assert_close(a, b, 0, 0, "graph replay vs eager")
    assert opt_g.applied_steps.item() == opt_e.applied_steps.item() == 8


def test_cuda_graph_replays_see_a_tensor_lr_filled_between_them():
    """The captured path's cache (the hyper-parameter table, uploaded before capture) holds no lr of its own for
    a tensor lr: filling it between replays reaches the next replay, as in eager steps (issue 38's class of bug).
    A float hyper-parameter changed after capture cannot reach a replay (no Python runs): documented."""
    eager = cuda_params([(1025,), (7, 9)], seed=2)
    graphed = [torch.nn.Parameter(p.detach().clone()) for p in eager]
    lrs = [torch.tensor(1e-2, device="cuda") for _ in range(2)]
    opt_e = FusedAdamW(eager, lr=lrs[0], max_grad_norm=1.0, capturable=True)
    opt_g = FusedAdamW(graphed, lr=lrs[1], max_grad_norm=1.0, capturable=True)

    def fill_lrs(index):
        for lr in lrs:
            lr.fill_(1e-2 * (index + 2))

    grads = cuda_grads(eager, 6, seed=6)
    replay_against_eager(opt_e, opt_g, eager, graphed, grads, between=fill_lrs)
    for a, b in zip(graphed, eager):
        assert_close(a, b, 0, 0, "graph replay vs eager, lr filled between replays")
    assert float(opt_g.last_lr) == float(opt_e.last_lr) == pytest.approx(1e-2 * len(grads))


def test_cuda_launches_per_step_do_not_grow_with_tensor_count():
    from torch.profiler import ProfilerActivity, profile

    def kernels_per_step(n):
        params = cuda_params([(100 + i,) for i in range(n)])
        opt = FusedAdamW(params, lr=1e-3, max_grad_norm=1.0)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower())

    assert kernels_per_step(4) == kernels_per_step(400) == 3


def test_cuda_clip_grad_norm_matches_torch():
    ours = cuda_params([(1025,), (65537,), (0,)], seed=3)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a) * 3
        b.grad = a.grad.clone()
    total_ours = fused_stable.clip_grad_norm_(ours, 1.0)
    total_theirs = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert_close(total_ours, total_theirs, 1e-5, 1e-6, "total norm")
    for a, b in zip(ours, theirs):
        assert_close(a.grad, b.grad, 1e-5, 1e-7, "clipped grad")


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()


def _recipe_step(model, opt, scaler, x, y):
    """docs/optimizer.md's CUDA-graph recipe: grads keep their storage (zeroed in place), fp16 autocast, GradScaler."""
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def test_cuda_graph_of_a_whole_step_with_grad_scaler_replays_like_eager():
    from torch.profiler import ProfilerActivity, profile

    models = [_mlp(0), _mlp(0)]
    opts = [
        FusedAdamW(
            m.parameters(),
            lr=torch.tensor(1e-3, device="cuda"),
            max_grad_norm=1.0,
            capturable=True,
            lr_schedule=schedules.warmup_cosine(50, 5),
        )
        for m in models
    ]
    scalers = [fused_stable.GradScaler("cuda", init_scale=2.0**10), fused_stable.GradScaler("cuda", init_scale=2.0**10)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [
        (torch.randn(32, 64, device="cuda", generator=gen), torch.randn(32, 8, device="cuda", generator=gen))
        for _ in range(10)
    ]
    static_x, static_y = torch.zeros_like(batches[0][0]), torch.zeros_like(batches[0][1])

    eager_model, eager_opt, eager_scaler = models[0], opts[0], scalers[0]
    model, opt, scaler = models[1], opts[1], scalers[1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the eager warm-up builds state, the step's tables and the grads
        for x, y in batches[:3]:
            static_x.copy_(x), static_y.copy_(y)
            _recipe_step(model, opt, scaler, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _recipe_step(model, opt, scaler, static_x, static_y)

    for x, y in batches[:3]:
        _recipe_step(eager_model, eager_opt, eager_scaler, x, y)
    for i, (x, y) in enumerate(batches[3:]):
        _recipe_step(eager_model, eager_opt, eager_scaler, x, y)
        static_x.copy_(x), static_y.copy_(y)
        if i == len(batches) - 4:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
        else:
            graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert_close(a, b, 1e-6, 1e-7, "graph replay vs eager")
    assert opt.applied_steps.item() == eager_opt.applied_steps.item() == len(batches)
    assert scaler.get_scale() == eager_scaler.get_scale()
    # replaying costs the host one graph launch: no kernel is launched from the host
    names = [e.name for e in prof.events()]
    assert names.count("cudaGraphLaunch") == 1, sorted(set(names))
    assert not any(n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx") for n in names)


def test_cuda_capture_refuses_an_upload_with_a_clear_error():
    params = cuda_params([(1025,), (7,)])
    opt = FusedAdamW(params, lr=torch.tensor(1e-2, device="cuda"), max_grad_norm=1.0, capturable=True)
    with pytest.raises(RuntimeError, match="one eager step"):  # first step: the plan and tables do not exist yet
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    assert not opt.state
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="CUDA graph is being captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            params[0].grad = torch.ones_like(params[0])  # new grad storage allocated inside the capture
            opt.step()


def test_cuda_step_runs_on_the_current_stream():
    eager, streamed = cuda_params([(4097,), (33,)], seed=2), cuda_params([(4097,), (33,)], seed=2)
    opts = [FusedAdamW(ps, lr=1e-2, max_grad_norm=1.0) for ps in (eager, streamed)]
    side = torch.cuda.Stream()
    for _ in range(3):
        grads = [torch.randn_like(p) for p in eager]
        for a, b, g in zip(eager, streamed, grads):
            a.grad, b.grad = g.clone(), g.clone()
        opts[0].step()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            opts[1].step()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for a, b in zip(eager, streamed):
        assert_close(a, b, 0, 0, "side-stream step")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_step_runs_on_the_params_device_whatever_device_is_current():
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(4)
    init = [torch.randn(s, generator=gen) for s in [(4097,), (300, 7)]]
    ours = [torch.nn.Parameter(t.to("cuda:1")) for t in init]
    theirs = [torch.nn.Parameter(t.to("cuda:1")) for t in init]
    opt, ref = FusedAdamW(ours, lr=1e-2, max_grad_norm=1.0), torch.optim.AdamW(theirs, lr=1e-2)
    torch.cuda.set_device(0)
    for step in range(3):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen).to("cuda:1")
            a.grad, b.grad = g.clone(), g.clone()
        if step == 2:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                opt.step()
                torch.cuda.synchronize(1)
        else:
            opt.step()
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        ref.step()
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    for a, b in zip(ours, theirs):
        assert_close(a, b, 1e-5, 1e-6, "param on cuda:1")
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()]
    assert kernels and all(e.device_index == 1 for e in kernels), [(e.name, e.device_index) for e in kernels]
