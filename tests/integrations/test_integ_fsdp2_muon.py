"""FusedMuon under FSDP2 (issue 50 item 1), on real gloo ranks: Muon groups of Shard(0) DTensor params, each
matrix's direction brought whole to its owner rank for Newton-Schulz (fused_stable/matrix_exchange.py).

The params are Shard(0) DTensors (FSDP2's layout) of a Muon + AdamW model with matrices of one shape batched
together, a tall one, a wide one and one whose rows do not split evenly (9 rows: 5 + 4 on 2 ranks, 3 + 3 + 3 + 0
on 4); the grads are the same seeded full tensors on every mesh. The matrix reaching Newton-Schulz at its owner is
then the tensor one process stacks, so without an active clip the 2-rank run equals one process bit for bit, on
host decisions (in place) and on device decisions (stacks and selects, DECIDE_ON_HOST off). With the clip active
the global norm's all-reduce sums in another order: within the floor measured here (one process against itself
with max_grad_norm moved one fp32 ulp). A torch.distributed.checkpoint taken on 2 ranks resumes on 1 and 4 ranks bit
for bit; a non-finite grad in one rank's shard skips the step on both ranks (params and momentum unchanged); a
fully_shard model steps as one process does; state_bytes() is the local bytes opt.state holds.

One spawn per mesh size (2, then 1 and 4 resuming); every rank gets a process-group timeout, so a rank that
waits alone in a collective (one rank skipping alone) fails the run instead of hanging it.
"""

from __future__ import annotations

import functools
import math
import os
from datetime import timedelta
from functools import partial

import pytest
import torch
from helpers import count_symmetric_products
from integ_dist import spawn
from integ_floor import scale_ulps
from integ_sharded import full_state, grads_at, run_steps, save_or_resume, seeded

from fused_stable import FusedMuon
from fused_stable.rules import muon
from fused_stable.rules.muon import newton_schulz
from fused_stable.rules.muon import torch as muon_torch

# (384, 400): a Gram side of two row blocks, where the Gram products go by blocks (newton_schulz.symmetric_product)
SHAPES = [(64, 96), (64, 96), (96, 64), (9, 40), (256, 64), (384, 400), (64,), (96,)]
STEPS, SAVE_AT, SKIP_AT = 4, 2, 1
# randn grads: norm ~180, clip active; "exact-fp32": Newton-Schulz in fp32 (a CPU without bf16 products' choice);
# "exact-blocks": the Gram products by row blocks (the choice of a CPU whose bf16 products are not AMX's)
MAX_GRAD_NORM = {"exact-host": None, "exact-device": None, "exact-fp32": None, "exact-blocks": None, "clipped": 1.0}


def newton_schulz_for(case: str) -> None:
    """The case's Newton-Schulz dtype (the suite pins torch's bf16; the fp32 case sends fp32 on the wire too) and
    Gram products (by blocks in the blocks case, whatever this CPU's choice; else this CPU's choice)."""
    os.environ[newton_schulz.ENV] = "fp32" if case == "exact-fp32" else "bf16"
    if case == "exact-blocks":
        os.environ[newton_schulz.BLOCKS_ENV] = "1"
    else:
        os.environ.pop(newton_schulz.BLOCKS_ENV, None)


TIMEOUT = timedelta(seconds=60)


def full_params():
    return seeded(SHAPES, 0)


def make_optimizer(params, max_grad_norm=None):
    matrices = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    groups = [{"params": matrices, "use_muon": True, "lr": 2e-2}, {"params": rest, "use_muon": False, "lr": 1e-2}]
    return FusedMuon(groups, max_grad_norm=max_grad_norm, backend="torch")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard; `step` is a plain tensor


def local_copies(opt, params):
    """This rank's shards of the params and of every state (no collective)."""
    shards = [p.to_local().detach().clone() for p in params]
    states = {(i, k): _local(v).clone() for i, p in enumerate(params) for k, v in opt.state[p].items()}
    return shards, states


def _worker(rank: int, world_size: int, ckpt_dir: str, mode: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded(t):
        return distribute_tensor(t, mesh, [Shard(0)])

    out: dict = {}
    blocked = count_symmetric_products()
    for case, max_grad_norm in MAX_GRAD_NORM.items():
        muon_torch.DECIDE_ON_HOST = case != "exact-device"
        newton_schulz_for(case)
        blocked.clear()
        params = [torch.nn.Parameter(sharded(t)) for t in full_params()]
        opt = make_optimizer(params, max_grad_norm)
        advance = partial(run_steps, opt, params, SHAPES, to_param=sharded)
        save_or_resume(opt, params, mode, f"{ckpt_dir}/{case}", advance, SAVE_AT)
        run_steps(opt, params, SHAPES, range(SAVE_AT, STEPS), sharded)
        out[case] = {"params": [p.full_tensor().detach().clone() for p in params], "state": full_state(opt, params)}
        out[case]["symmetric_products"] = len(blocked)
        if mode == "save":
            held = sum(_local(v).nbytes for p in params for v in opt.state[p].values())
            out[case]["state_bytes"] = (opt.state_bytes(), held)
    muon_torch.DECIDE_ON_HOST = True
    newton_schulz_for("")
    if mode == "save":
        out["fully_shard"] = _fully_shard_steps()
        for decisions in ("host", "device"):  # last: a rank skipping alone would leave the other waiting
            out[f"skip-{decisions}"] = _one_rank_non_finite(rank, sharded, decisions)
    return out


def _one_rank_non_finite(rank, sharded, decisions) -> dict:
    """Step SKIP_AT with an inf in rank 1's rows of a Muon matrix only: every rank's shards of every param and
    state before and after that step (no collective after it)."""
    muon_torch.DECIDE_ON_HOST = decisions == "host"
    params = [torch.nn.Parameter(sharded(t)) for t in full_params()]
    opt = make_optimizer(params, max_grad_norm=1.0)
    run_steps(opt, params, SHAPES, range(SKIP_AT), sharded)
    before = local_copies(opt, params)
    for p, g in zip(params, grads_at(SHAPES, SKIP_AT)):
        p.grad = sharded(g)
    if rank == 1:
        params[2].grad.to_local()[0, 0] = math.inf
    opt.step()
    muon_torch.DECIDE_ON_HOST = True
    return {"before": before, "after": local_copies(opt, params)}


class _Mlp(torch.nn.Sequential):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(torch.nn.Linear(40, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def _mlp_steps(model, opt):
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        model(torch.randn(16, 40, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _mlp_optimizer(model):
    from fused_stable import muon_param_groups

    return FusedMuon(muon_param_groups(model), max_grad_norm=1e3, backend="torch")  # the clip on, not active


def _fully_shard_steps() -> list[torch.Tensor]:
    """fully_shard per layer and root, the same batch on every rank (FSDP2's mean of equal grads is exact)."""
    from torch.distributed.fsdp import fully_shard

    model = _Mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    _mlp_steps(model, _mlp_optimizer(model))
    return [p.full_tensor().detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    saved = spawn(_worker, 2, tmp_path_factory.mktemp("two"), ckpt, "save", timeout=TIMEOUT)
    one = spawn(_worker, 1, tmp_path_factory.mktemp("one"), ckpt, "resume", timeout=TIMEOUT)
    four = spawn(_worker, 4, tmp_path_factory.mktemp("four"), ckpt, "resume", timeout=TIMEOUT)
    return saved, one, four


def single_process(case, max_grad_norm=None):
    params = [torch.nn.Parameter(t) for t in full_params()]
    muon_torch.DECIDE_ON_HOST = case != "exact-device"
    newton_schulz_for(case)
    try:
        opt = make_optimizer(params, MAX_GRAD_NORM[case] if max_grad_norm is None else max_grad_norm)
        run_steps(opt, params, SHAPES, range(STEPS), lambda g: g)
    finally:
        muon_torch.DECIDE_ON_HOST = True
        newton_schulz_for("")
    return {"params": [p.detach() for p in params], "state": full_state(opt, params)}


def assert_equal_runs(actual, expected, what):
    for index, (a, b) in enumerate(zip(actual["params"], expected["params"])):
        assert torch.equal(a, b), f"{what}: param {index} {(a - b).abs().max():.3g} off"
    assert actual["state"].keys() == expected["state"].keys(), what
    for key, value in expected["state"].items():
        assert torch.equal(actual["state"][key], value), f"{what}: state {key}"


@pytest.mark.parametrize("case", ["exact-host", "exact-device", "exact-blocks"])
def test_two_ranks_equal_one_process_bit_for_bit(runs, case):
    saved, _, _ = runs
    reference = single_process(case)
    for rank in saved:
        assert_equal_runs(rank[case], reference, f"{case}, 2 ranks vs one process")


def test_the_blocks_case_runs_the_gram_products_by_blocks(runs):
    """In the blocks case the (384, 400) matrix's owner rank (one of the two) runs both Gram products of every
    iteration by blocks, on every step: the case is not the default run under another name."""
    saved, _, _ = runs
    counts = sorted(rank["exact-blocks"]["symmetric_products"] for rank in saved)
    assert counts == [0, 2 * STEPS * muon.NS_STEPS], counts


def test_two_ranks_with_fp32_newton_schulz_follow_one_process_within_fp32_rounding(runs):
    """Newton-Schulz in fp32 (the choice of a CPU without bf16 products; its wire dtype too): the 2-rank run is the
    one-process fp32 run within 2 fp32 ulps of each param's scale (measured 0.53 on two params, 0 on the rest:
    fp32 products may round differently with their operands' alignment, which a bf16 result hides), and far from
    the bf16 run (each Muon param at least 100 ulps off it, measured 440-950: not bf16's run under another name)."""
    saved, _, _ = runs
    reference, bf16 = single_process("exact-fp32"), single_process("exact-host")
    for rank in saved:
        for index, (a, b) in enumerate(zip(rank["exact-fp32"]["params"], reference["params"])):
            assert scale_ulps(a, b) <= 2, f"param {index}: {scale_ulps(a, b):.3g} ulps off one process"
    muon = [i for i, shape in enumerate(SHAPES) if len(shape) == 2]
    assert min(scale_ulps(reference["params"][i], bf16["params"][i]) for i in muon) > 100


@functools.cache
def clip_floor() -> float:
    """One process against itself with max_grad_norm one fp32 ulp higher (the clip coefficient moves by about
    the ulp that another summation order of the norm moves it): the largest param difference after STEPS steps,
    over the model (a param's own can be 0: bf16 Newton-Schulz swallows a small change)."""
    reference = single_process("clipped")["params"]
    moved = single_process("clipped", MAX_GRAD_NORM["clipped"] * (1 + 2**-23))["params"]
    floor = max(float((a - b).abs().max()) for a, b in zip(reference, moved))
    assert floor > 0, "one ulp of the clip moved nothing: no floor"
    return floor


def assert_within_floor(actual, expected, floor, what):
    """Measured: the 2-rank run 1.17e-4 off one process (params 0 and 1; the others equal), 0.49x the floor
    (2.39e-4); resumed on 1 and on 4 ranks, the same 1.17e-4 off the 2-rank run; allowed 2x the floor."""
    off = max(float((a - b).abs().max()) for a, b in zip(actual["params"], expected["params"]))
    assert off <= 2 * floor, f"{what}: params {off:.3g} off, floor {floor:.3g}"


def test_clipped_two_ranks_follow_one_process_within_the_floor(runs):
    saved, _, _ = runs
    reference, floor = single_process("clipped"), clip_floor()
    for rank in saved:
        assert_within_floor(rank["clipped"], reference, floor, "clipped, 2 ranks vs one process")


@pytest.mark.parametrize("case", list(MAX_GRAD_NORM))
@pytest.mark.parametrize("mesh", ["one", "four"])
def test_a_two_rank_checkpoint_resumes_on_another_mesh(runs, case, mesh):
    """Bit for bit without an active clip; with it, within the clip's floor (each mesh sums the norm its way)."""
    saved, one, four = runs
    for rank in one if mesh == "one" else four:
        if case == "clipped":
            assert_within_floor(rank[case], saved[0][case], clip_floor(), f"{case}, resumed on {mesh}")
        else:
            assert_equal_runs(rank[case], saved[0][case], f"{case}, resumed on {mesh}")


@pytest.mark.parametrize("decisions", ["host", "device"])
def test_a_non_finite_grad_on_one_rank_skips_on_every_rank(runs, decisions):
    saved, _, _ = runs
    for index, rank in enumerate(saved):
        (params_before, states_before), (params_after, states_after) = (
            rank[f"skip-{decisions}"]["before"],
            rank[f"skip-{decisions}"]["after"],
        )
        for i, (a, b) in enumerate(zip(params_after, params_before)):
            assert torch.equal(a, b), f"rank {index}: param {i} moved on a skipped step"
        for key, value in states_before.items():
            if key[1] != "step":
                assert torch.equal(states_after[key], value), f"rank {index}: state {key} moved on a skipped step"
        assert states_after[(0, "momentum_buffer")].abs().sum() > 0  # the step before it was applied


def test_state_bytes_are_the_local_bytes_opt_state_holds(runs):
    saved, _, _ = runs
    for rank in saved:
        for case in MAX_GRAD_NORM:
            counted, held = rank[case]["state_bytes"]
            assert counted == held, f"{case}: state_bytes() {counted}, opt.state holds {held}"
    assert saved[0]["exact-host"]["state_bytes"] != saved[1]["exact-host"]["state_bytes"]  # 9 rows: 5 + 4


def test_a_fully_shard_model_steps_as_one_process(runs):
    saved, _, _ = runs
    model = _Mlp()
    _mlp_steps(model, _mlp_optimizer(model))
    for rank in saved:
        for index, (a, b) in enumerate(zip(rank["fully_shard"], model.parameters())):
            assert torch.equal(a, b.detach()), f"param {index}: {(a - b).abs().max():.3g} off"


def test_owners_are_balanced_by_size():
    """Costliest first, each to the rank with the least cost so far (Muon's cost: newton_schulz_work): the
    Newton-Schulz work spread over the ranks."""
    from fused_stable.matrix_exchange import balanced_owners

    assert balanced_owners([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # loads 110 and 110
    assert balanced_owners([4, 4, 4, 4, 4], 4) == [0, 1, 2, 3, 0]  # equal sizes: round-robin
