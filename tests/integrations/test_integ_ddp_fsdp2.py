"""FusedAdamW under real data parallelism (2 gloo CPU ranks): DDP with LoRA adapters and FSDP2 with a
fully sharded tiny Llama, both through ``wrap_model`` and ``shard_data``, give the same parameters and
grad norms as one process training on the whole batch; FSDP2 optimizer state round-trips through
torch.distributed.checkpoint, both raw ``state_dict()`` and the ``get/set_optimizer_state_dict`` API."""

from __future__ import annotations

import pytest
import torch
from integ_dist import spawn
from integ_models import tiny_llama

from fused_stable import FusedAdamW, schedules

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 10
LR = 1e-2
MAX_NORM = 0.05  # small enough that every step is clipped


def global_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def lora_model():
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(tiny_llama(), cfg)
    # LoRA B starts at zero, which makes A's first grads zero; start from a non-trivial point instead
    torch.manual_seed(3)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return model


def make_optimizer(model) -> FusedAdamW:
    # a decaying device-side schedule (lr x 1.0, 0.9, 0.8, ...): a resumed optimizer that lost its applied-step
    # count would restart it and take a different step
    return FusedAdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=LR,
        weight_decay=0.1,
        max_grad_norm=MAX_NORM,
        lr_schedule=schedules.warmup_linear(10, 0),
    )


def train(model, opt, batches, norms):
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.grad_norm.clone())


def _worker(rank: int, world_size: int, ckpt_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    from fused_stable.integrations import distributed

    info = distributed.init_distributed_from_env()  # the group is already up: it just reports it
    out: dict = {"info": (info.rank, info.world_size), "is_main": distributed.is_main_process()}
    rows = distributed.shard_data(list(range(GLOBAL_BATCH)))
    local_batches = [ids[rows] for ids in global_batches()]

    # DDP for adapters
    model = distributed.wrap_model(lora_model(), "lora")
    out["ddp_type"] = type(model).__name__
    opt = make_optimizer(model)
    norms: list = []
    train(model, opt, local_batches, norms)
    out["ddp_norms"] = torch.stack(norms)
    out["ddp_params"] = {
        n: p.detach().clone() for n, p in distributed.unwrap_model(model).named_parameters() if p.requires_grad
    }

    # FSDP2 for full fine-tuning
    model = distributed.wrap_model(tiny_llama(), "full")
    out["fsdp_all_dtensor"] = all(isinstance(p, DTensor) for p in model.parameters())
    opt = make_optimizer(model)
    norms = []
    train(model, opt, local_batches[:2], norms)

    # checkpoint after 2 steps, both ways
    raw_dir, api_dir = f"{ckpt_dir}/raw", f"{ckpt_dir}/api"
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=raw_dir)
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=api_dir
    )
    train(model, opt, local_batches[2:], norms)
    out["fsdp_norms"] = torch.stack(norms)
    out["fsdp_params"] = distributed.full_model_state_dict(model)
    out["fsdp_counters"] = (int(opt.applied_steps), int(opt.skipped_steps))
    final = [p.full_tensor() for p in model.parameters()]

    def max_diff(m):
        return max((p.full_tensor() - f).abs().max().item() for p, f in zip(m.parameters(), final))

    # raw state_dict(): load into a model/optimizer of the same structure (state created by one step)
    model2 = distributed.wrap_model(tiny_llama(seed=5), "full")
    opt2 = make_optimizer(model2)
    train(model2, opt2, local_batches[:1], [])
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(sd, checkpoint_id=raw_dir)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    out["raw_counters_loaded"] = (int(opt2.applied_steps), int(opt2.skipped_steps))
    train(model2, opt2, local_batches[2:], [])
    out["raw_resume_max_diff"] = max_diff(model2)

    # the distributed state_dict API: a fresh model and optimizer with no state
    model3 = distributed.wrap_model(tiny_llama(seed=6), "full")
    opt3 = make_optimizer(model3)
    sd = {"model": get_model_state_dict(model3), "optim": get_optimizer_state_dict(model3, opt3)}
    dcp.load(sd, checkpoint_id=api_dir)
    set_model_state_dict(model3, sd["model"])
    set_optimizer_state_dict(model3, opt3, sd["optim"])
    # the helpers drop FusedAdamW's own counters: the applied-step count comes back from the per-param steps
    out["api_applied_steps_loaded"] = int(opt3.applied_steps)
    train(model3, opt3, local_batches[2:], [])
    out["api_last_lr"] = float(opt3.last_lr)
    out["api_resume_max_diff"] = max_diff(model3)

    # a compiled step over DTensor params is refused at trace time and leaves the optimizer as it was
    model3(input_ids=local_batches[0], labels=local_batches[0]).loss.backward()
    before = [p.full_tensor().clone() for p in model3.parameters()]
    steps_before = int(opt3.applied_steps)
    try:
        torch.compile(lambda: opt3.step(), fullgraph=True)()
        out["compiled_refusal"] = None
    except Exception as exc:  # noqa: BLE001 - dynamo wraps what the trace raised
        out["compiled_refusal"] = str(exc).splitlines()[0]
    out["compiled_refusal_kept"] = int(opt3.applied_steps) == steps_before and all(
        torch.equal(p.full_tensor(), b) for p, b in zip(model3.parameters(), before)
    )
    opt3.step()  # the eager step still works
    out["eager_after_refusal"] = int(opt3.applied_steps) - steps_before
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    return spawn(_worker, 2, tmp_path_factory.mktemp("dp"), str(ckpt))


def reference(model_fn):
    model = model_fn()
    opt = make_optimizer(model)
    norms: list = []
    train(model, opt, global_batches(), norms)
    return model, torch.stack(norms)


def test_ranks_and_main_process(ranks):
    assert [r["info"] for r in ranks] == [(0, 2), (1, 2)]
    assert [r["is_main"] for r in ranks] == [True, False]


def test_ddp_lora_equals_single_process(ranks):
    ref_model, ref_norms = reference(lora_model)
    assert ranks[0]["ddp_type"] == "DistributedDataParallel"
    assert (ref_norms > MAX_NORM).all()
    for r in ranks:
        torch.testing.assert_close(r["ddp_norms"], ref_norms, rtol=1e-5, atol=0)
        ref = {n: p for n, p in ref_model.named_parameters() if p.requires_grad}
        assert r["ddp_params"].keys() == ref.keys() and ref
        for n, p in r["ddp_params"].items():
            torch.testing.assert_close(p, ref[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_fsdp2_equals_single_process(ranks):
    ref_model, ref_norms = reference(tiny_llama)
    assert all(r["fsdp_all_dtensor"] for r in ranks)
    assert (ref_norms > MAX_NORM).all()
    for r in ranks:
        # every rank computes the same global norm, equal to the unsharded one
        torch.testing.assert_close(r["fsdp_norms"], ref_norms, rtol=1e-5, atol=0)
        assert r["fsdp_counters"] == (STEPS, 0)
    full = ranks[0]["fsdp_params"]
    ref = ref_model.state_dict()
    assert full.keys() == ref.keys()
    # Adam divides each update by sqrt(v): an element whose grad is tiny next to the fp32 noise of a
    # different summation order (reduce-scatter vs one process) can move by a fraction of lr, so the
    # absolute tolerance is in units of lr (0.5% of one step); 99% of elements agree to 1e-6.
    for n, p in full.items():
        torch.testing.assert_close(p, ref[n], rtol=1e-5, atol=5e-3 * LR, msg=lambda m: f"{n}: {m}")
    close = sum(torch.isclose(p, ref[n], rtol=1e-5, atol=1e-6).sum().item() for n, p in full.items())
    assert close >= 0.99 * sum(p.numel() for p in full.values())


def test_fsdp2_checkpoint_round_trip_with_dcp(ranks):
    for r in ranks:
        assert r["raw_counters_loaded"] == (2, 0)
        assert r["raw_resume_max_diff"] == 0.0
        assert r["api_resume_max_diff"] == 0.0
        assert r["api_applied_steps_loaded"] == 2
        assert r["api_last_lr"] == pytest.approx(LR * schedules.warmup_linear(10, 0).factor(2), rel=1e-6)


def test_a_compiled_step_over_sharded_params_is_refused_and_changes_nothing(ranks):
    """docs/optimizer.md: a compiled step over FSDP2 (DTensor) params is refused with a clear error."""
    for r in ranks:
        assert "compiled step with sharded (DTensor / FSDP2) parameters is not supported" in r["compiled_refusal"]
        assert "RuntimeError" in r["compiled_refusal"]
        assert r["compiled_refusal_kept"]
        assert r["eager_after_refusal"] == 1
