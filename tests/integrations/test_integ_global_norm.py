"""fused_stable.sharding: the global sum of squares over DTensor shards and the param checks, on real gloo
process groups (2 and 4 CPU ranks), against torch's own norms of the full tensors; and their public names in
fused_stable.integrations.distributed."""

from __future__ import annotations

import math

import pytest
import torch
from integ_dist import spawn

from fused_stable import sharding
from fused_stable.integrations import distributed as fused_distributed


def _no_host_sync_mode(record: dict):
    """A dispatch mode that fails on any device->host read (.item(), bool(), .tolist() all go through
    aten._local_scalar_dense) and counts the collectives issued."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoHostSync(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                raise AssertionError("global_sumsq read a device value on the host")
            if "allreduce" in str(func):
                record["allreduces"] = record.get("allreduces", 0) + 1
            return func(*args, **(kwargs or {}))

    return NoHostSync()


def _local_sumsq(params) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    def local(g):
        return g.to_local() if isinstance(g, DTensor) else g

    return torch.stack([local(p.grad).float().pow(2).sum() for p in params])


def _reference_sumsq(params) -> float:
    """Sum of squares of the full gradients, gathered with DTensor's own redistribution."""
    from torch.distributed.tensor import DTensor

    total = 0.0
    for p in params:
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        total += g.double().pow(2).sum().item()
    return total


def _param(full_grad: torch.Tensor, mesh, placements):
    """A DTensor param (or a plain one when mesh is None) whose grad is ``full_grad`` laid out likewise."""
    from torch.distributed.tensor import distribute_tensor

    if mesh is None:
        p = torch.nn.Parameter(torch.zeros_like(full_grad))
        p.grad = full_grad.clone()
        return p
    p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full_grad), mesh, placements))
    p.grad = distribute_tensor(full_grad, mesh, placements)
    return p


def _two_rank_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: dict = {}
    mesh = init_device_mesh("cpu", (world_size,))

    # 1. FSDP2 on a model whose dims do not divide evenly: rank 1 holds empty shards of the last layer.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    sharding.validate_params(params)
    torch.manual_seed(100 + rank)  # each rank its own batch, as in data parallel training
    model(torch.randn(4, 3)).pow(2).sum().backward()
    out["fsdp2_local_shapes"] = [tuple(p.grad.to_local().shape) for p in params]
    record: dict = {}
    with _no_host_sync_mode(record):
        total = sharding.global_sumsq(_local_sumsq(params), params)
    out["fsdp2_sumsq"] = total
    out["fsdp2_allreduces"] = record.get("allreduces", 0)
    ref_norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    out["fsdp2_clip_norm"] = (ref_norm.full_tensor() if isinstance(ref_norm, DTensor) else ref_norm).item()

    # 2. Every placement kind in one list, in interleaved order; the plain tensor is the same on both
    # ranks (a replicated, non-DTensor param) and must be counted once, as must the Replicate one.
    torch.manual_seed(1)
    grads = [torch.randn(8, 4) for _ in range(6)]
    layout = [
        (mesh, [Shard(0)]),
        (mesh, [Replicate()]),
        (None, None),
        (mesh, [Shard(1)]),
        (mesh, [_StridedShard(0, split_factor=2)]),
        (mesh, [Shard(0)]),
    ]
    mixed = [_param(g, m, pl) for g, (m, pl) in zip(grads, layout)]
    sharding.validate_params(mixed)
    record = {}
    with _no_host_sync_mode(record):
        out["mixed_sumsq"] = sharding.global_sumsq(_local_sumsq(mixed), mixed)
    out["mixed_allreduces"] = record.get("allreduces", 0)
    out["mixed_reference"] = _reference_sumsq(mixed)
    out["mixed_expected"] = sum(g.double().pow(2).sum().item() for g in grads)

    # 3. Non-finite values on one rank only must reach every rank.
    for name, bad_rank, bad in (("inf", 1, float("inf")), ("nan", 0, float("nan"))):
        p = _param(torch.ones(4, 2), mesh, [Shard(0)])
        if rank == bad_rank:
            p.grad.to_local()[0, 0] = bad
        ok = _param(torch.ones(4, 2), mesh, [Shard(0)])
        out[f"nonfinite_{name}"] = sharding.global_sumsq(_local_sumsq([ok, p]), [ok, p])

    # 4. Bad input, each with its message.
    errors = {}

    def capture(key, fn):
        try:
            fn()
        except (TypeError, ValueError) as e:
            errors[key] = (type(e).__name__, str(e))

    flat = FSDP1(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))
    capture("fsdp1_flat", lambda: sharding.validate_params(list(flat.parameters())))
    orig = FSDP1(torch.nn.Linear(4, 4), device_id=torch.device("cpu"), use_orig_params=True)
    capture("fsdp1_orig", lambda: sharding.validate_params(list(orig.parameters())))
    mesh2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("rep", "shard"))
    two_meshes = [_param(torch.ones(4, 2), mesh, [Shard(0)]), _param(torch.ones(4, 2), mesh2d, [Replicate(), Shard(0)])]
    capture("two_meshes", lambda: sharding.validate_params(two_meshes))
    partial = torch.nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh, [Partial()]))
    capture("partial_param", lambda: sharding.validate_params([partial]))
    p = _param(torch.ones(4, 2), mesh, [Replicate()])
    p.grad = DTensor.from_local(torch.ones(4, 2), mesh, [Partial()])
    capture("partial_grad", lambda: sharding.global_sumsq(torch.ones(1), [p]))
    # the same checks through the optimizer itself
    from fused_stable import FusedAdamW

    capture("optim_fsdp1_flat", lambda: FusedAdamW(flat.parameters()))
    capture("optim_fsdp1_orig", lambda: FusedAdamW(orig.parameters()))
    capture("optim_two_meshes", lambda: FusedAdamW(two_meshes))
    out["errors"] = errors
    # Two meshes in separate groups are allowed: the global norm still combines them correctly.
    out["two_meshes_sumsq"] = sharding.global_sumsq(_local_sumsq(two_meshes), two_meshes)
    return out


def _four_rank_worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(2)
    grads = [torch.randn(8, 8) for _ in range(6)]
    layout = [
        [Replicate(), Shard(0)],  # HSDP: replicated across dp, sharded in tp
        [Shard(0), Shard(1)],  # sharded on both dims
        [Shard(0), Replicate()],
        [Replicate(), Replicate()],
        [_StridedShard(0, split_factor=2), Shard(0)],  # FSDP over TP, as fully_shard makes it
        [Replicate(), Shard(0)],
    ]
    params = [_param(g, mesh, pl) for g, pl in zip(grads, layout)]
    sharding.validate_params(params)
    record: dict = {}
    with _no_host_sync_mode(record):
        total = sharding.global_sumsq(_local_sumsq(params), params)
    out = {
        "sumsq": total,
        "allreduces": record.get("allreduces", 0),
        "reference": _reference_sumsq(params),
        "expected": sum(g.double().pow(2).sum().item() for g in grads),
    }
    sub = [_param(grads[0], mesh["dp"], [Shard(0)]), _param(grads[1], mesh["tp"], [Shard(0)])]
    try:
        sharding.validate_params(sub)
    except ValueError as e:
        out["submesh_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(_two_rank_worker, 2, tmp_path_factory.mktemp("norm2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(_four_rank_worker, 4, tmp_path_factory.mktemp("norm4"))


def test_fsdp2_global_norm_matches_clip_grad_norm(two_ranks):
    # rank 1's shard of the 1-row layer is empty: the sum must still be complete
    assert two_ranks[1]["fsdp2_local_shapes"][2] == (0, 5)
    for r in two_ranks:
        assert r["fsdp2_sumsq"].dim() == 0 and r["fsdp2_sumsq"].dtype == torch.float32
        assert math.sqrt(r["fsdp2_sumsq"].item()) == pytest.approx(r["fsdp2_clip_norm"], rel=1e-6)
    # all FSDP2 params share (mesh, Shard on dim 0): exactly one collective
    assert [r["fsdp2_allreduces"] for r in two_ranks] == [1, 1]


def test_mixed_placements_reduce_only_sharded_dims(two_ranks):
    for r in two_ranks:
        assert r["mixed_reference"] == pytest.approx(r["mixed_expected"], rel=1e-9)
        assert r["mixed_sumsq"].item() == pytest.approx(r["mixed_expected"], rel=1e-6)
        # Shard(0), Shard(1), _StridedShard: one stacked all-reduce over the single mesh dim
        assert r["mixed_allreduces"] == 1


@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_nonfinite_shard_on_one_rank_reaches_all_ranks(two_ranks, kind):
    check = math.isinf if kind == "inf" else math.isnan
    assert all(check(r[f"nonfinite_{kind}"].item()) for r in two_ranks)


def test_separate_meshes_still_sum_correctly(two_ranks):
    for r in two_ranks:
        assert r["two_meshes_sumsq"].item() == pytest.approx(16.0)


@pytest.mark.parametrize(
    "case, exc, words",
    [
        ("fsdp1_flat", "TypeError", ["FSDP1", "fully_shard"]),
        ("fsdp1_orig", "TypeError", ["FSDP1", "fully_shard"]),
        ("two_meshes", "ValueError", ["2 different device meshes", "own param group"]),
        ("partial_param", "ValueError", ["Partial"]),
        ("partial_grad", "ValueError", ["Partial", "redistribute"]),
    ],
)
def test_bad_layouts_get_clear_errors(two_ranks, case, exc, words):
    for r in two_ranks:
        assert case in r["errors"], f"{case} was accepted"
        name, msg = r["errors"][case]
        assert name == exc
        for w in words:
            assert w in msg


@pytest.mark.parametrize(
    "case, exc, words",
    [
        ("optim_fsdp1_flat", "TypeError", ["FSDP1", "fully_shard"]),
        ("optim_fsdp1_orig", "TypeError", ["FSDP1", "fully_shard"]),
        ("optim_two_meshes", "ValueError", ["different device meshes"]),
    ],
)
def test_fused_adamw_rejects_bad_layouts(two_ranks, case, exc, words):
    test_bad_layouts_get_clear_errors(two_ranks, case, exc, words)


def test_2d_mesh_reduces_each_sharded_dim_once(four_ranks):
    for r in four_ranks:
        assert r["reference"] == pytest.approx(r["expected"], rel=1e-9)
        assert r["sumsq"].item() == pytest.approx(r["expected"], rel=1e-6)
        # one stacked all-reduce per mesh dim on which anything is sharded (dp and tp)
        assert r["allreduces"] == 2
        assert "different device meshes" in r["submesh_error"]


def test_plain_tensors_count_as_they_are():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    sharding.validate_params(params)
    total = sharding.global_sumsq(_local_sumsq(params), params)
    assert total.dim() == 0 and total.item() == pytest.approx(4.0 * 7)


def test_local_sumsq_shape_is_checked():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="one entry per param"):
        sharding.global_sumsq(torch.ones(2), [p])


def test_the_public_names_stay_in_integrations_distributed():
    """Users import global_sumsq and validate_params from fused_stable.integrations.distributed (docs); they now
    live in the core (sharding.py), which FusedAdamW imports without reaching up into integrations/."""
    assert fused_distributed.global_sumsq is sharding.global_sumsq
    assert fused_distributed.validate_params is sharding.validate_params
    assert {"global_sumsq", "validate_params"} <= set(fused_distributed.__all__)
