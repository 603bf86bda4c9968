"""fused_stable.integrations.deepspeed without processes: what prepare_config sets and refuses, and the refusal of
FusedAdamW's own policy when DeepSpeed's ZeRO wrapper code steps it (fused_stable/engines.py)."""

from __future__ import annotations

import json

import pytest
import torch

from fused_stable import FusedAdamW, schedules
from fused_stable.engines import drive, rules_in_use
from fused_stable.integrations.deepspeed import prepare_config


def test_prepare_config_sets_what_the_integration_needs(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    cfg = prepare_config(path)
    assert cfg["zero_allow_untested_optimizer"] is True and cfg["gradient_clipping"] == 0.0
    assert cfg["zero_optimization"]["compute_grad_norm"] is False  # DeepSpeed's fp64 norm off
    assert cfg["bf16"]["check_grad_overflow"] is False
    offload = prepare_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    assert offload["zero_force_ds_cpu_optimizer"] is False  # FusedAdamW is the offloaded CPU optimizer
    assert "compute_grad_norm" not in offload["zero_optimization"]  # DeepSpeed refuses it with offload / ZeRO-3
    given = {"zero_optimization": {"stage": 1}}
    prepare_config(given)
    assert given == {"zero_optimization": {"stage": 1}}, "the caller's dict was changed"


@pytest.mark.parametrize(
    "config, words",
    [
        ({"gradient_clipping": 1.0}, "max_grad_norm"),
        ({"fp16": {"enabled": True}}, "bf16"),
        ({"optimizer": {"type": "AdamW"}}, "client optimizer"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "NVMe"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "partial"),
        ({"zero_optimization": {"stage": 4}}, "stage must be"),
    ],
)
def test_prepare_config_refuses_what_it_cannot_take_over(config, words):
    with pytest.raises(ValueError, match=words):
        prepare_config(config)


def _step_from_module(opt, module_name: str):
    """opt.step() called from code whose module is `module_name` (as DeepSpeed's wrapper calls it)."""
    namespace = {"__name__": module_name, "opt": opt}
    code = compile("def call():\n    opt.step()\n", f"<{module_name}>", "exec")
    exec(code, namespace)
    return namespace["call"]()


def _optimizer(**policy):
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 0.5)
    return FusedAdamW([p], lr=0.1, **policy), p


@pytest.mark.parametrize(
    "policy",
    [{"max_grad_norm": 1.0}, {"clip": "zscore"}, {"spike_skip_threshold": 6.0}, {"lr_schedule": schedules.constant()}],
    ids=["max_grad_norm", "zscore", "spike_skip", "lr_schedule"],
)
def test_rules_refuse_under_zero_wrapper_code(policy):
    opt, p = _optimizer(**policy)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="fused_stable.integrations.deepspeed") as info:
        _step_from_module(opt, "deepspeed.runtime.zero.stage_1_and_2")
    assert rules_in_use(opt.policy)[0].split("=")[0] in str(info.value)
    assert torch.equal(p, before) and int(opt.applied_steps) == 0  # refused before anything changed


def test_no_refusal_without_rules_elsewhere_or_when_driven():
    opt, p = _optimizer()
    _step_from_module(opt, "deepspeed.runtime.zero.stage3")  # a plain AdamW: DeepSpeed's own clip is right
    assert int(opt.applied_steps) == 1
    opt, p = _optimizer(max_grad_norm=1.0)
    _step_from_module(opt, "deepspeed.runtime.engine")  # ZeRO 0: whole, all-reduced grads
    assert int(opt.applied_steps) == 1
    opt, p = _optimizer(max_grad_norm=1.0)
    drive(opt, None)  # the integration drives it
    _step_from_module(opt, "deepspeed.runtime.zero.stage_1_and_2")
    assert int(opt.applied_steps) == 1


@pytest.mark.parametrize(
    "zero, words",
    [
        ({"stage": 3}, "Muon groups do not run under ZeRO-3 yet: ZeRO-3 cuts each matrix into per-param partitions"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "Muon groups do not run with ZeRO-Offload yet"),
    ],
)
def test_fused_muon_is_refused_before_the_engine_is_built_where_it_does_not_run(zero, words):
    """FusedMuon runs at ZeRO 0-2 (test_integ_deepspeed.py); ZeRO-3 and ZeRO-Offload: one line, before deepspeed
    runs (never a silent fallback of the Muon params to AdamW, as LLaMA-Factory's use_muon under ZeRO-3)."""
    from fused_stable import FusedMuon
    from fused_stable.integrations import deepspeed as fs_deepspeed

    model = torch.nn.Linear(8, 8)
    opt = FusedMuon([{"params": [model.weight], "use_muon": True}, {"params": [model.bias], "use_muon": False}])
    with pytest.raises(ValueError, match=words):
        fs_deepspeed.initialize(model=model, optimizer=opt, config={"train_batch_size": 1, "zero_optimization": zero})


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(
    "what, words",
    [
        ("8bit", "Muon groups keep 8-bit momentum in blocks over whole matrices, and ZeRO {stage} steps flat"),
        ("experts", "Muon groups step 3-D expert stacks per expert, and the ZeRO {stage} exchange rebuilds 2-D"),
    ],
)
def test_fused_muon_8bit_momentum_and_expert_stacks_are_refused_at_zero_1_2(stage, what, words):
    """ZeRO 1-2 rebuilds 2-D matrices from flat partitions (deepspeed_muon.py): 8-bit momentum (blocks over whole
    matrices) and 3-D expert stacks are refused in one line before deepspeed runs, not stepped wrongly."""
    from fused_stable import FusedMuon
    from fused_stable.integrations import deepspeed as fs_deepspeed

    model = torch.nn.Linear(128, 64)
    weight = model.weight if what == "8bit" else torch.nn.Parameter(torch.zeros(2, 64, 128))
    precision = "8bit" if what == "8bit" else "fp32"
    opt = FusedMuon([{"params": [weight], "use_muon": True}], state_precision=precision)
    config = {"train_batch_size": 1, "zero_optimization": {"stage": stage}}
    with pytest.raises(ValueError, match=words.format(stage=stage)):
        fs_deepspeed.initialize(model=model, optimizer=opt, config=config)


def _muon_layout():
    from fused_stable.integrations.deepspeed_muon import Matrix

    # two flat groups on 3 ranks: (16, 8) + (16, 16) padded to 390 (130 a rank), (4, 16) + (16, 16) in 324 (108)
    return [Matrix(0, (16, 8), 0, 130), Matrix(0, (16, 16), 128, 130), Matrix(1, (4, 16), 0, 108)] + [
        Matrix(1, (16, 16), 64, 108)
    ]


def test_muon_pieces_cover_each_matrix_once_at_its_place_in_the_partitions():
    """deepspeed_muon.pieces: each matrix cut at its group's partition boundaries, every element once, in order."""
    from fused_stable.integrations.deepspeed_muon import pieces

    matrices = _muon_layout()
    cut = pieces(matrices)
    for index, m in enumerate(matrices):
        mine = [p for p in cut if p.matrix == index]
        assert [p.start for p in mine] == [0] + [sum(q.length for q in mine[:i]) for i in range(1, len(mine))]
        assert sum(p.length for p in mine) == m.numel
        for p in mine:  # the piece's place in its rank's partition is its place in the flat group
            assert p.rank * m.partition_size + p.local == m.offset + p.start
            assert 0 <= p.local and p.local + p.length <= m.partition_size
    # the (16, 16) of group 0 lies across ranks 0 and 1 (elements 128-383 of 130-element partitions)
    assert [(p.rank, p.local, p.length) for p in cut if p.matrix == 1] == [(0, 128, 2), (1, 0, 130), (2, 0, 124)]


def test_muon_owners_balance_newton_schulz_work_and_the_exchange_is_symmetric():
    """Owners by decreasing work to the least loaded rank; what rank r sends to owner q is what q expects from r."""
    from fused_stable.integrations.deepspeed_muon import Exchange, owners, pieces

    matrices = _muon_layout()
    owner = owners(matrices, 3)
    # work 1024, 4096, 256, 4096: the squares to ranks 0 and 1, the (16, 8) then the (4, 16) to the idle rank 2
    assert owner == [2, 0, 2, 1]
    assert owners(matrices, 2) == [0, 0, 1, 1]  # the (16, 8) to rank 0 (a tie), the (4, 16) to rank 1
    cut = pieces(matrices)
    plans = [Exchange.plan(cut, owner, rank, 3) for rank in range(3)]
    for r in range(3):
        for q in range(3):
            assert plans[r].outgoing_counts[q] == plans[q].incoming_counts[r]
    assert [plan.owned for plan in plans] == [[1], [3], [0, 2]]


def test_fused_adafactor_is_refused_before_the_engine_is_built():
    """FusedAdafactor (a matrix rule: column means and RMS norms over whole params) under ZeRO: one line, which
    offers only elementwise rules' classes."""
    from fused_stable import FusedAdafactor
    from fused_stable.integrations import deepspeed as fs_deepspeed

    model = torch.nn.Linear(8, 8)
    opt = FusedAdafactor(model.parameters())
    with pytest.raises(ValueError, match="Adafactor groups are updated after the fused step from whole params") as e:
        fs_deepspeed.initialize(model=model, optimizer=opt, config={"train_batch_size": 1})
    assert "FusedAdafactor under" not in str(e.value) and "FusedSGD" in str(e.value)
