"""FusedAdafactor (rules/adafactor, the second matrix rule) against torch.optim.Adafactor + clip_grad_norm_.

The update has three paths (rules/adafactor/torch.py): with the decisions on the CPU and the compiled CPU ops (the
torch backend's default) the fp32 matrices take the compiled op (rules/adafactor/cpu_matrix.cpp: torch's element
arithmetic, its sums in fp64: within the floor, tests/core/test_adafactor_cpu_op.py holds it there); without them
(the torch-ops backend) torch's for-loop step op for op (bit-identical to torch.optim.Adafactor(), whose default
foreach=None is the for-loop); with device decisions (`DECIDE_ON_HOST` off, what CUDA runs) it reads nothing on the
host and selects with torch.where, and its last add is torch's foreach one (bit-identical to
torch.optim.Adafactor(foreach=True)). The bit-for-bit tests run the two torch paths, the others all three.
With a clip, the fused clip coefficient may differ from clip_grad_norm_'s in its last fp32 bit (another summation
order): those runs are held to the floor measured in the same run (the fp32 reference against the fp64 one).
"""

from __future__ import annotations

import inspect
import io

import pytest
import torch

import fused_stable.rules.adafactor.torch as adafactor_torch
from fused_stable import OPTIMIZERS, FusedAdafactor, schedules
from fused_stable.backends.torch import cpu_ops
from fused_stable.integrations import optim_names
from tests.helpers import ulp_distance

# odd sizes; 2-D, 3-D and 4-D params (factored over the last two dims), rows or columns of one, 1-D and 0-D ones
SHAPES = [(37, 53), (3, 5, 7), (2, 3, 4, 5), (1000,), (3,), (1,), (), (64, 65), (1, 9), (9, 1), *[(7, 11)] * 6]
EMPTY = [(0,), (0, 4)]  # no element: torch's step divides by the numel and raises; the fused one leaves them
OTHER_GROUP = dict(weight_decay=0.1, maximize=True, d=1.5, beta2_decay=-1.0, eps=(1e-30, 1e-3), lr=0.02)
PATHS = ["host", "device"]  # the paths that are torch's bits
STATE_KEYS = ("row_var", "col_var", "variance")


def _take_path(monkeypatch, name: str) -> None:
    monkeypatch.setattr(adafactor_torch, "DECIDE_ON_HOST", name != "device")
    if name != "compiled":  # the torch-ops backend: no compiled op, torch's for-loop
        monkeypatch.setattr(cpu_ops, "available", lambda: False)


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The update's torch paths on CPU: host decisions without the compiled ops (torch's for-loop) and device
    decisions (torch.where)."""
    _take_path(monkeypatch, request.param)
    return request.param


@pytest.fixture(params=["compiled", *PATHS])
def any_path(request, monkeypatch):
    """Every path, the compiled op's too (for the tests that compare the fused step with itself or a floor)."""
    _take_path(monkeypatch, request.param)
    return request.param


def _reference(path: str):
    """torch's implementation each path matches bit for bit (see the module doc)."""
    return dict(foreach=path == "device")


def _params(dtype=torch.float32, shapes=SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)) for s in shapes]


def _grads(step: int, scale: float = 3.0, dtype=torch.float32, shapes=SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(dtype) for s in shapes]


def _groups(params: list, **other) -> list[dict]:
    """Two groups: torch's defaults, and every keyword changed (OTHER_GROUP)."""
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], **OTHER_GROUP, **other}]


def _run(opt, params, steps: int, first: int = 0, scale: float = 3.0, max_norm=None, lrs=None, dtype=torch.float32):
    for step in range(first, first + steps):
        for p, g in zip(params, _grads(step, scale, dtype, [tuple(p.shape) for p in params])):
            p.grad = g.to(p.dtype)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        if lrs is not None:
            for group, lr in zip(opt.param_groups, lrs[step]):
                group["lr"] = lr
        opt.step()


def _assert_same(ours, opt, theirs, ref) -> None:
    for index, (p, q) in enumerate(zip(ours, theirs)):
        assert torch.equal(p, q), f"param {index} {tuple(q.shape)}: {(p - q).abs().max():.3g} off"
        assert set(opt.state[p]) == set(ref.state[q]), f"state keys of param {index}"
        for key in STATE_KEYS + ("step",):
            if key in ref.state[q]:
                assert torch.equal(opt.state[p][key], ref.state[q][key]), f"{key} of param {index} {tuple(q.shape)}"


def _bit_for_bit(path: str, dtype) -> None:
    ours, theirs = _params(dtype), _params(dtype)
    opt = FusedAdafactor(_groups(ours), backend="torch")
    ref = torch.optim.Adafactor(_groups(theirs), **_reference(path))
    _run(opt, ours, 6, dtype=dtype)
    _run(ref, theirs, 6, dtype=dtype)
    _assert_same(ours, opt, theirs, ref)
    assert opt.state[ours[1]]["row_var"].shape == (3, 5, 1) and opt.state[ours[1]]["col_var"].shape == (3, 1, 7)
    assert opt.state[ours[0]]["row_var"].dtype == dtype


def test_matches_torch_bit_for_bit(path):
    """6 steps, two groups (torch's defaults; every keyword changed): params and every state bit-identical, the
    states torch's (row_var [..., R, 1] and col_var [..., 1, C] for >= 2-D, variance below)."""
    _bit_for_bit(path, torch.float32)


def test_bf16_params_match_torch_on_the_host_path(monkeypatch):
    """bf16 params and states: torch's for-loop bit for bit."""
    monkeypatch.setattr(adafactor_torch, "DECIDE_ON_HOST", True)  # with the compiled ops: bf16 is not the op's
    _bit_for_bit("host", torch.bfloat16)


def test_bf16_params_on_the_device_path_are_within_an_ulp_of_torch(monkeypatch):
    """The device path's bf16 add is torch's vectorised CPU arithmetic (alpha in bf16, the sum in fp32, rounded once);
    torch's scalar loop over a tensor's last elements rounds the product as well, so an element there may be an ulp
    off after a step (measured: 5 of 7,831 elements, in the tails); the states bit-identical."""
    monkeypatch.setattr(adafactor_torch, "DECIDE_ON_HOST", False)
    ours, theirs = _params(torch.bfloat16), _params(torch.bfloat16)
    opt = FusedAdafactor(_groups(ours), backend="torch")
    ref = torch.optim.Adafactor(_groups(theirs))
    _run(opt, ours, 1, dtype=torch.bfloat16)
    _run(ref, theirs, 1, dtype=torch.bfloat16)
    off = 0
    for p, q in zip(ours, theirs):
        assert not p.numel() or int(ulp_distance(p, q, torch.bfloat16).max()) <= 1
        off += int((p != q).sum())
        assert all(torch.equal(opt.state[p][k], ref.state[q][k]) for k in ref.state[q])
    assert off <= 10, off


def test_a_param_with_no_element_is_left_alone(path):
    """torch's step divides by the numel of 0 and raises; the fused step leaves such a param (and the others step)."""
    empty = _params(shapes=EMPTY[:1])
    with pytest.raises(ZeroDivisionError):
        _run(torch.optim.Adafactor(empty), empty, 1)
    ours = _params(shapes=SHAPES[:2] + EMPTY)
    opt = FusedAdafactor(ours, backend="torch")
    _run(opt, ours, 2)
    theirs = _params(shapes=SHAPES[:2])
    ref = torch.optim.Adafactor(theirs, **_reference(path))
    _run(ref, theirs, 2)
    _assert_same(ours[:2], opt, theirs, ref)
    assert opt.state[ours[3]]["row_var"].shape == (0, 1) and not opt.state[ours[3]]["col_var"].any()


def _floor_check(ours, ref32, ref64, what: str) -> None:
    """|ours - fp64| <= 2 * |fp32 reference - fp64| (per tensor) + one fp32 ulp of the fp64 value."""
    for index, (a, b, c) in enumerate(zip(ours, ref32, ref64)):
        a, b, c = a.detach().double(), b.detach().double(), c.detach().double()
        floor = (b - c).abs().max()
        excess = (a - c).abs() - 2 * floor - torch.finfo(torch.float32).eps * c.abs()
        assert not (excess > 0).any(), f"{what} {index} {tuple(c.shape)}: worst |diff| {(a - c).abs().max():.3e}"


def _reference_runs(max_norm=None, lrs=None) -> list:
    runs = []
    for dtype in (torch.float32, torch.float64):
        params = _params(dtype)
        # eps1 given: its default is the dtype's machine epsilon, which differs between fp32 and fp64
        ref = torch.optim.Adafactor(_groups(params, eps=(1e-7, 1e-3)), eps=(1e-7, 1e-3))
        _run(ref, params, 5, scale=30.0, max_norm=max_norm, lrs=lrs)
        runs.append((params, ref))
    return runs


def test_matches_clip_grad_norm_then_torch(any_path):
    """Grads 30x over the clip threshold: the clip comes before the second moments (as clip_grad_norm_ then
    Adafactor.step), params and states within the floor of the fp32 reference against the fp64 one."""
    ours = _params()
    opt = FusedAdafactor(_groups(ours, eps=(1e-7, 1e-3)), eps=(1e-7, 1e-3), max_grad_norm=1.0, backend="torch")
    _run(opt, ours, 5, scale=30.0)
    (ref32, opt32), (ref64, opt64) = _reference_runs(max_norm=1.0)
    _floor_check(ours, ref32, ref64, "param")
    for key in STATE_KEYS:
        has = [i for i, p in enumerate(ours) if key in opt.state[p]]
        states = [[o.state[ps[i]][key] for i in has] for o, ps in ((opt, ours), (opt32, ref32), (opt64, ref64))]
        _floor_check(*states, key)
    assert float(opt.grad_norm) > 30.0  # the clip was active


def test_the_device_schedule_is_torch_with_the_same_lrs(any_path):
    """lr_schedule (warm-up + cosine, on the device) equals torch stepped with those lrs set by hand (the
    schedule's factor is fp32: within the floor)."""
    schedule = schedules.warmup_cosine(total_steps=6, warmup_steps=2, min_lr_ratio=0.1)
    ours = _params()
    opt = FusedAdafactor(_groups(ours, eps=(1e-7, 1e-3)), eps=(1e-7, 1e-3), lr_schedule=schedule, backend="torch")
    _run(opt, ours, 5, scale=30.0)
    lrs = [[1e-2 * schedule.factor(step), OTHER_GROUP["lr"] * schedule.factor(step)] for step in range(5)]
    (ref32, _), (ref64, _) = _reference_runs(lrs=lrs)
    _floor_check(ours, ref32, ref64, "param")
    unscheduled = _params()
    _run(FusedAdafactor(_groups(unscheduled), backend="torch"), unscheduled, 5, scale=30.0)
    assert not torch.equal(ours[0], unscheduled[0])  # the schedule reached the update


def _snapshot(opt, params) -> tuple[list, list]:
    return [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


def _assert_unchanged(opt, params, snapshot) -> None:
    before, states = snapshot
    for index, (p, b, s) in enumerate(zip(params, before, states)):
        assert torch.equal(p.detach(), b), f"param {index} moved on a skipped step"
        for key, value in s.items():
            assert torch.equal(opt.state[p][key], value), f"{key} of param {index} moved on a skipped step"


def test_a_non_finite_step_changes_nothing(any_path):
    """An inf in one grad (a NaN in another) skips the step: every param, state and `step` bit-identical."""
    params = _params()
    opt = FusedAdafactor(_groups(params), max_grad_norm=1.0, backend="torch")
    _run(opt, params, 2)
    snapshot = _snapshot(opt, params)
    grads = _grads(5)
    grads[0][3, 4], grads[3][7] = float("inf"), float("nan")
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    assert int(opt.skipped_steps) == 1 and bool(opt.last_step_skipped)
    _assert_unchanged(opt, params, snapshot)
    _run(opt, params, 1, first=6)  # and the next finite step applies
    assert not torch.equal(params[0].detach(), snapshot[0][0])


def test_a_spike_is_skipped_like_a_non_finite_step(any_path):
    params = _params()
    options = dict(zscore_warmup=4, zscore_threshold=3.0, spike_skip_threshold=6.0)
    opt = FusedAdafactor(_groups(params), backend="torch", **options)
    _run(opt, params, 6, scale=1.0)
    snapshot = _snapshot(opt, params)
    _run(opt, params, 1, first=6, scale=100.0)
    assert int(opt.spike_skips) == 1 and int(opt.skipped_steps) == 0
    _assert_unchanged(opt, params, snapshot)


def _saved(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_resuming_from_a_saved_state_dict_is_the_uninterrupted_run(any_path):
    whole = _params()
    _run(FusedAdafactor(_groups(whole), max_grad_norm=1.0, backend="torch"), whole, 4)
    first = _params()
    opt = FusedAdafactor(_groups(first), max_grad_norm=1.0, backend="torch")
    _run(opt, first, 2)
    params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = FusedAdafactor(_groups(params), max_grad_norm=1.0, backend="torch")
    resumed.load_state_dict(_saved(opt.state_dict()))
    _run(resumed, params, 2, first=2)
    for index, (a, b) in enumerate(zip(params, whole)):
        assert torch.equal(a, b), f"param {index}: the resumed run left the uninterrupted one"


def test_torch_state_dicts_load_both_ways(path):
    """torch.optim.Adafactor's state dict loads into FusedAdafactor and torch_state_dict() into torch's, through
    torch.save / torch.load(weights_only=True); the next steps are torch's, bit for bit."""
    ours, theirs = _params(), _params()
    opt = FusedAdafactor(_groups(ours), backend="torch")
    ref = torch.optim.Adafactor(_groups(theirs), **_reference(path))
    _run(opt, ours, 2)
    _run(ref, theirs, 2)
    from_torch = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    loaded = FusedAdafactor(_groups(from_torch), backend="torch")
    loaded.load_state_dict(_saved(ref.state_dict()))
    from_ours = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    back = torch.optim.Adafactor(_groups(from_ours), **_reference(path))
    back.load_state_dict(_saved(opt.torch_state_dict()))
    for group in back.param_groups:  # the loaded groups say foreach=None (ours): the path's implementation again
        group["foreach"] = _reference(path)["foreach"]
    for optimizer, params in ((ref, theirs), (loaded, from_torch), (back, from_ours)):
        _run(optimizer, params, 2, first=2)
    _assert_same(from_torch, loaded, theirs, ref)
    _assert_same(from_torch, loaded, from_ours, back)


def test_a_tensor_lr_is_its_value(any_path):
    """torch takes a 1-element tensor lr (and reads it every step): the same step as its float, changes included."""
    floats, tensors = _params(), _params()
    lr = torch.tensor(2.0**-6)  # a tensor lr is fp32: values exact in fp32, so the float is the same number
    a = FusedAdafactor(floats, lr=2.0**-6, weight_decay=0.1, backend="torch")
    b = FusedAdafactor(tensors, lr=lr, weight_decay=0.1, backend="torch")
    _run(a, floats, 2)
    _run(b, tensors, 2)
    a.param_groups[0]["lr"] = 2.0**-8
    lr.fill_(2.0**-8)
    _run(a, floats, 2, first=2)
    _run(b, tensors, 2, first=2)
    assert all(torch.equal(p, q) for p, q in zip(floats, tensors))


def test_keywords_defaults_and_checks_are_torchs():
    """The signature's names, kinds and defaults (the step options after them), and torch's ValueErrors."""
    theirs = inspect.signature(torch.optim.Adafactor).parameters
    ours = inspect.signature(FusedAdafactor).parameters
    for name, parameter in theirs.items():
        assert (ours[name].kind, ours[name].default) == (parameter.kind, parameter.default), name
    p = [torch.nn.Parameter(torch.zeros(2, 3))]
    for kwargs, words in (
        (dict(lr=-1.0), "Learning rate should be >= 0"),
        (dict(beta2_decay=0.1), "beta2_decay should be <= 0"),
        (dict(eps=(-1.0, 1e-3)), "epsilon1 should be >= 0"),
        (dict(eps=(None, -1.0)), "epsilon2 should be >= 0"),
        (dict(d=0.5), "Clipping threshold d should be >= 1"),
        (dict(weight_decay=-0.1), "weight_decay should be >= 0"),
    ):
        for cls in (torch.optim.Adafactor, FusedAdafactor):
            with pytest.raises(ValueError, match=words):
                cls(p, **kwargs)
    opt = FusedAdafactor(p, lr=0.5, d=2.0)
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == {
        **{k: v for k, v in torch.optim.Adafactor(p, lr=0.5, d=2.0).param_groups[0].items() if k != "params"},
        "state_precision": "fp32",
    }


def test_refusals_say_why(tmp_path):
    """What FusedAdafactor does not do is refused in one line, before anything changes."""
    p = torch.nn.Parameter(torch.zeros(4, 4))
    for precision in ("bf16", "8bit"):
        with pytest.raises(ValueError, match="rows \\+ cols values per matrix"):
            FusedAdafactor([p], state_precision=precision)
    with pytest.raises(ValueError, match="keeps no fp32 master weights"):
        FusedAdafactor([p], master_weights=True)
    opt = FusedAdafactor([p], backend="torch")
    p.grad = torch.ones(4, 4)

    @torch.compile(fullgraph=True)
    def step():
        opt.step()

    with pytest.raises(Exception, match="does not run inside torch.compile"):
        step()
    assert not p.detach().any()
    # the HF Trainer's `adafactor` is transformers' algorithm: refused, saying so; torch's is a rule= away
    with pytest.raises(ValueError, match="transformers' own Adafactor"):
        optim_names.lookup("adafactor")
    assert OPTIMIZERS["adafactor"].cls is FusedAdafactor and not OPTIMIZERS["adafactor"].optim_names


def test_fsdp2_dtensor_params_are_refused(tmp_path):
    """A matrix rule steps whole params (Adafactor's column means and RMS norms): a DTensor (FSDP2's shard) in a
    group of one is refused in one line, by the one check every matrix rule shares. Muon brings row shards whole
    to an owner rank (matrix_exchange.py): its groups take Shard(0) and Replicate and refuse any other placement."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fused_stable import FusedMuon

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match="FusedAdafactor's Adafactor groups do not run under FSDP2 yet"):
            FusedAdafactor([p])
        FusedMuon([{"params": [p], "use_muon": True}])  # Shard(0): accepted
        FusedMuon([{"params": [distribute_tensor(torch.zeros(4, 6), mesh, [Replicate()])], "use_muon": True}])
        columns = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)]))
        with pytest.raises(ValueError, match=r"Muon group: param 0 of shape \(4, 6\) is placed as \(Shard\(dim=1\),\)"):
            FusedMuon([{"params": [columns], "use_muon": True}])
        # 8-bit codes run in blocks over whole matrices; a 3-D stack's Shard(0) splits experts: both one line
        with pytest.raises(ValueError, match="8-bit momentum is coded in blocks over each whole matrix"):
            FusedMuon([{"params": [p], "use_muon": True}], state_precision="8bit")
        FusedMuon([{"params": [p], "use_muon": True}], state_precision="bf16")
        experts = torch.nn.Parameter(distribute_tensor(torch.zeros(2, 4, 6), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match="3-D expert stacks are stepped per expert, and under FSDP2"):
            FusedMuon([{"params": [experts], "use_muon": True}])
    finally:
        dist.destroy_process_group()
