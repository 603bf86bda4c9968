"""Optimizer state that does not depend on the mesh (issue 36 item 4), on real gloo ranks.

Until then a parameter's state format was decided from its local shard and its 8-bit blocks were cut from the
shard: 8-bit state raised on the first FSDP2 step with 2 ranks (the scales sized for the whole param, checked
against the shard), and a tensor under 4096 elements per shard got fp32 moments on 2 ranks but 8-bit on one.

Here the params are Shard(0) DTensors (FSDP2's layout) of the shapes of the issue's 3-layer MLP (96->64->256->8)
and the grads are the same seeded full tensors on every mesh, so each element's update is the same arithmetic
on any mesh (no clipping: the global norm's all-reduce sums in another order on another mesh). A run on 2 ranks
saves through torch.distributed.checkpoint after 2 steps and goes on; the same checkpoint resumed on 1 and on
4 ranks must continue that trajectory bit for bit, and the 2-rank run must equal one process without DTensors
bit for bit: params, codes, scales, moments. A fully_shard model with backward runs 8-bit state too.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from integ_dist import spawn
from integ_sharded import full_state, run_steps, save_or_resume, seeded

from fused_stable import FusedAdamW, FusedLion, FusedSGD

SHAPES = [(64, 96), (64,), (256, 64), (256,), (8, 256), (8,)]
STEPS, SAVE_AT = 4, 2
PRECISIONS = ["fp32", "bf16", "8bit"]
# every update rule runs the same trajectories (issue 35: a rule's options under every engine)
OPTIMIZERS = {
    "adamw": lambda params, precision: FusedAdamW(
        params, lr=1e-2, weight_decay=0.1, state_precision=precision, backend="torch"
    ),
    "lion": lambda params, precision: FusedLion(
        params, lr=1e-3, weight_decay=0.1, state_precision=precision, backend="torch"
    ),
    "sgd": lambda params, precision: FusedSGD(
        params, lr=1e-2, momentum=0.9, weight_decay=0.1, state_precision=precision, backend="torch"
    ),
}
CASES = [f"{rule}-{precision}" for rule in OPTIMIZERS for precision in PRECISIONS]
# bf16's stochastic rounding (AdamW's exp_avg_sq, Lion's exp_avg) hashes each element's index in its whole param
# (sharding.element_offset): every mesh draws the same bits, so bf16 is bit for bit too (until 2026-12-07 it hashed
# the local index: AdamW's params were 1.2e-4 apart after 4 steps, Lion's 1-4 elements a sign flip apart)


def full_params():
    return seeded(SHAPES, 0)


def make_optimizer(params, precision, rule="adamw"):
    return OPTIMIZERS[rule](params, precision)


def _worker(rank: int, world_size: int, ckpt_dir: str, mode: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded(t):
        return distribute_tensor(t, mesh, [Shard(0)])

    out: dict = {}
    for case in CASES:
        rule, precision = case.split("-")
        params = [torch.nn.Parameter(sharded(t)) for t in full_params()]
        opt = make_optimizer(params, precision, rule)
        advance = partial(run_steps, opt, params, SHAPES, to_param=sharded)
        save_or_resume(opt, params, mode, f"{ckpt_dir}/{case}", advance, SAVE_AT)
        run_steps(opt, params, SHAPES, range(SAVE_AT, STEPS), sharded)
        out[case] = {
            "params": [p.full_tensor().detach().clone() for p in params],
            "state": full_state(opt, params),
            # the first state of the rule's (exp_avg, SGD's momentum_buffer)
            "formats": {i: str(opt.state[p][opt.RULE.states[0].name].dtype) for i, p in enumerate(params)},
        }
    if mode == "save":
        out["fully_shard"] = _fully_shard_mlp_steps()
        out["unaligned"] = _unaligned_8bit_step(sharded)
    return out


def _unaligned_8bit_step(sharded) -> tuple[str, bool]:
    """A (33, 200) param on 2 ranks: shard 1 starts at element 3400, inside a block. Refused before any state or
    param changes, on every rank alike (no rank waits in a collective for another)."""
    param = torch.nn.Parameter(sharded(torch.ones(33, 200)))
    opt = make_optimizer([param], "8bit")
    param.grad = sharded(torch.ones(33, 200))
    try:
        opt.step()
        message = ""
    except ValueError as exc:
        message = str(exc)
    kept = not opt.state[param] and bool(torch.equal(param.full_tensor(), torch.ones(33, 200)))
    return message, kept


def _fully_shard_mlp_steps() -> str:
    """The issue's repro: three fully_shard'ed Linear layers with 8-bit state, backward and three steps."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = FusedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, state_precision="8bit")
    for _ in range(3):
        model(torch.randn(4, 96)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return str(model[1].weight.to_local().dtype) + " " + str(opt.state[model[1].weight]["exp_avg"].dtype)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    saved = spawn(_worker, 2, tmp_path_factory.mktemp("two"), ckpt, "save")
    one = spawn(_worker, 1, tmp_path_factory.mktemp("one"), ckpt, "resume")
    four = spawn(_worker, 4, tmp_path_factory.mktemp("four"), ckpt, "resume")
    return saved, one, four


def single_process(case):
    rule, precision = case.split("-")
    params = [torch.nn.Parameter(t) for t in full_params()]
    opt = make_optimizer(params, precision, rule)
    run_steps(opt, params, SHAPES, range(STEPS), lambda g: g)
    return {"params": [p.detach() for p in params], "state": full_state(opt, params)}


def assert_equal_runs(actual, expected, what):
    for index, (a, b) in enumerate(zip(actual["params"], expected["params"])):
        assert torch.equal(a, b), f"{what}: param {index} {(a - b).abs().max():.3g} off"
    assert actual["state"].keys() == expected["state"].keys(), what
    for key, value in expected["state"].items():
        assert actual["state"][key].dtype == value.dtype, f"{what}: state {key}"
        assert torch.equal(actual["state"][key], value), f"{what}: state {key}"


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_hold_what_one_process_holds(runs, case):
    saved, _, _ = runs
    reference = single_process(case)
    for rank in saved:
        assert_equal_runs(rank[case], reference, f"{case}, 2 ranks vs one process")
    if case.endswith("8bit"):  # (64, 96): 6144 elements, 3072 per shard: 8-bit, as on one process
        assert saved[0][case]["formats"][0] == "torch.int8" and saved[0][case]["formats"][1] == "torch.float32"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mesh", ["one", "four"])
def test_a_two_rank_checkpoint_resumes_on_another_mesh_bit_for_bit(runs, case, mesh):
    saved, one, four = runs
    for rank in one if mesh == "one" else four:
        assert_equal_runs(rank[case], saved[0][case], f"{case}, resumed on {mesh}")


def test_fully_sharded_mlp_runs_8bit_state(runs):
    saved, _, _ = runs
    assert [rank["fully_shard"] for rank in saved] == ["torch.float32 torch.int8"] * 2


def test_8bit_state_whose_shards_split_a_block_is_refused_in_one_line(runs):
    saved, _, _ = runs
    for rank in saved:
        message, kept = rank["unaligned"]
        assert "(33, 200) sharded 2 ways: shard 1 starts at element 3400, not on a 128-element block" in message
        assert "state_precision='bf16'" in message
        assert kept
