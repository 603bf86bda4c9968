"""FusedMuon (issue 35 item 4): Muon for the use_muon=True groups, AdamW for the rest, one fused step.

The reference is torch.optim.Muon + torch.optim.AdamW (foreach=False) + clip_grad_norm_ over both. The Muon side is
torch's arithmetic op for op (tests/core/test_muon_parts.py: bit for bit given the same clip coefficient), so here
the reference runs on the grads times the coefficient the fused step took, recomputed from its `grad_norm` read-out
as the decision kernel computes it (fp32 `min(1, max_norm / (norm + 1e-6))`): the Muon params must then be equal
bit for bit, the AdamW ones within an fp32 ulp or two (the compiled AdamW against torch's for-loop, as in
test_rule_parity). Against clip_grad_norm_'s own coefficient, which sums the squares in another order, the
difference is measured against a floor: torch's Muon run with that coefficient moved by one fp32 ulp.
"""

from __future__ import annotations

import io

import pytest
import torch
from helpers import WITH_TENSOR_DECISIONS

from fused_stable import FusedMuon, muon_param_groups, schedules

MUON_SHAPES = [(64, 32), (64, 32), (32, 96), (96, 32), (17, 5)]
ADAMW_SHAPES = [(16,), (10, 8), (0,), (1,)]
STEPS = 4
MAX_NORM = 1.0


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for shape in MUON_SHAPES + ADAMW_SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=gen) * 3 for shape in MUON_SHAPES + ADAMW_SHAPES]


def _groups(params, **muon):
    n = len(MUON_SHAPES)
    return [
        {"params": params[:n], "use_muon": True, "lr": 0.02, "weight_decay": 0.1, **muon},
        {"params": params[n:], "use_muon": False, "lr": 1e-2, "weight_decay": 0.05},
    ]


def _fused(backend, steps=STEPS, grads=_grads, **options):
    params = [torch.nn.Parameter(p.clone()) for p in _params()]
    muon_options = options.pop("muon", {})
    opt = FusedMuon(_groups(params, **muon_options), max_grad_norm=MAX_NORM, backend=backend, **options)
    coefficients = []
    for step in range(steps):
        for p, g in zip(params, grads(step)):
            p.grad = g.clone()
        opt.step()
        norm = opt.grad_norm.clone()
        one = torch.tensor(1.0)
        coefficients.append(torch.minimum(one, torch.tensor(MAX_NORM) / (norm + torch.tensor(1e-6))))
    return params, opt, coefficients


def _reference(coefficients=None, nudge=0, steps=STEPS, **muon_options):
    """torch.optim.Muon + AdamW on the grads times `coefficients` (None: clip_grad_norm_'s), each moved by `nudge`
    fp32 ulps."""
    params = [torch.nn.Parameter(p.clone()) for p in _params()]
    n = len(MUON_SHAPES)
    muon = torch.optim.Muon(params[:n], lr=0.02, weight_decay=0.1, **muon_options)
    adamw = torch.optim.AdamW(params[n:], lr=1e-2, weight_decay=0.05, foreach=False)
    for step in range(steps):
        grads = _grads(step)
        if coefficients is None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            coefficient = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        else:
            coefficient = coefficients[step]
        for _ in range(abs(nudge)):
            coefficient = torch.nextafter(coefficient, coefficient * (2.0 if nudge > 0 else 0.0))
        for p, g in zip(params, grads):
            p.grad = g * coefficient
        muon.step()
        adamw.step()
    return params, muon


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
def test_muon_and_adamw_groups_match_torch_with_the_same_clip(backend):
    ours, opt, coefficients = _fused(backend)
    theirs, reference = _reference(coefficients)
    n = len(MUON_SHAPES)
    for index, (a, b) in enumerate(zip(ours[:n], theirs[:n])):
        assert torch.equal(a, b), f"Muon param {index}: {(a - b).abs().max():.3g} off"
        assert torch.equal(opt.state[a]["momentum_buffer"], reference.state[b]["momentum_buffer"])
    for a, b in zip(ours[n:], theirs[n:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(float(c) < 1.0 for c in coefficients), "the grads are clipped on every step"


def test_against_clip_grad_norm_the_coefficient_differs_in_its_last_bits_only():
    """clip_grad_norm_'s coefficient differs from the fused one in its last bits (fp32 sums of per-tensor norms
    against the fused norm pass's sum of squares; measured: 0, 2, 0, 1 ulps on these 4 steps): given the same
    coefficient the runs are equal bit for bit (above), so that is the whole difference. bf16 Newton-Schulz turns
    it into bf16-sized changes of some update elements: measured 1.7e-4 after 4 steps, against Muon's step of
    lr x sqrt(3) = 0.035 per element on the tall matrix; allowed 1% of a step per step (1.4e-3)."""
    ours, _, coefficients = _fused("torch")
    exact, _ = _reference(None)
    for step, coefficient in enumerate(coefficients):
        grads = _grads(step)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        theirs = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        assert abs(coefficient.view(torch.int32).item() - theirs.view(torch.int32).item()) <= 2, step
    assert _largest_difference(ours, exact) <= STEPS * 0.01 * 0.02 * 3**0.5


def _largest_difference(xs, ys) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(xs, ys) if a.numel())


@pytest.mark.parametrize("backend", WITH_TENSOR_DECISIONS)
@pytest.mark.parametrize("where", ["muon", "adamw"])
def test_a_non_finite_grad_in_either_kind_skips_the_whole_step(backend, where):
    """One inf (in a Muon matrix or in an AdamW tensor) skips the step for every group: params, momentum buffers,
    moments and `step` bit-identical; and the next step goes on from there (nothing poisoned)."""

    def grads(step):
        g = _grads(step)
        if step == 2:
            g[0 if where == "muon" else len(MUON_SHAPES)][0] = float("inf")
        return g

    params, opt, _ = _fused(backend, steps=2)
    before = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for p, g in zip(params, grads(2)):
        p.grad = g.clone()
    opt.step()
    assert int(opt.skipped_steps) == 1
    for index, (p, b, s) in enumerate(zip(params, before, states)):
        assert torch.equal(p.detach(), b), f"param {index} moved on a skipped step"
        for key, value in s.items():
            assert torch.equal(opt.state[p][key], value), f"{key} of param {index} moved on a skipped step"
    for p, g in zip(params, _grads(3)):
        p.grad = g.clone()
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_the_lr_schedule_scales_the_muon_step_too():
    """warm-up + cosine on the device: the Muon groups step with lr x the schedule's factor, as torch.optim.Muon
    with that lr set by hand (the factor enters after Newton-Schulz: within fp32 rounding of the product)."""
    schedule = schedules.warmup_cosine(total_steps=6, warmup_steps=2, min_lr_ratio=0.1)
    ours, _, coefficients = _fused("torch", lr_schedule=schedule)
    params = [torch.nn.Parameter(p.clone()) for p in _params()]
    n = len(MUON_SHAPES)
    muon = torch.optim.Muon(params[:n], lr=0.02, weight_decay=0.1)
    for step in range(STEPS):
        muon.param_groups[0]["lr"] = 0.02 * schedule.factor(step)
        for p, g in zip(params[:n], _grads(step)[:n]):
            p.grad = g * coefficients[step]
        muon.step()
    for a, b in zip(ours[:n], params[:n]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ours[0], _fused("torch")[0][0]), "the schedule changed the Muon steps"


@pytest.mark.parametrize("options", [dict(nesterov=False), dict(adjust_lr_fn="match_rms_adamw", ns_steps=3)])
def test_muon_keywords_are_torchs(options):
    ours, _, coefficients = _fused("torch", muon=options)
    theirs, _ = _reference(coefficients, **options)
    for a, b in zip(ours[: len(MUON_SHAPES)], theirs):
        assert torch.equal(a, b)


def test_resuming_from_a_state_dict_is_the_uninterrupted_run(tmp_path):
    whole, _, _ = _fused("torch")
    first, opt, _ = _fused("torch", steps=2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = FusedMuon(_groups(params), max_grad_norm=MAX_NORM, backend="torch")
    resumed.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for step in (2, 3):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        resumed.step()
    for index, (a, b) in enumerate(zip(params, whole)):
        assert torch.equal(a, b), f"param {index}"


def test_refusals_say_what_to_do():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"use_muon=True \(Muon: 2-D hidden matrices\) or use_muon=False"):
        FusedMuon([{"params": [p]}])
    conv = torch.nn.Parameter(torch.zeros(4, 3, 3, 3))
    with pytest.raises(ValueError, match="Reshape it to 2-D"):
        FusedMuon([{"params": [conv], "use_muon": True}])
    with pytest.raises(TypeError, match="muon_param_groups"):
        FusedMuon([p])


def test_muon_param_groups_of_a_real_model_train():
    """A tiny Llama through muon_param_groups: its hidden projections in the Muon group, the rest AdamW; a step
    moves both kinds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(config)
    opt = FusedMuon(muon_param_groups(model, lr=0.02), max_grad_norm=1.0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert "model.layers.0.self_attn.q_proj.weight" in moved and "model.embed_tokens.weight" in moved
    assert "momentum_buffer" in opt.state[model.model.layers[0].mlp.up_proj.weight]
    assert "exp_avg" in opt.state[model.model.embed_tokens.weight]


def test_bf16_momentum_buffers_with_state_precision_bf16():
    """state_precision="bf16": the Muon groups' momentum buffers are bf16 (the AdamW groups' moments too), and the
    run stays near the fp32 one (bf16 rounding of a momentum that moves 5% a step: measured 2e-3 of a param after
    4 steps of 0.035; allowed 1e-2). 8-bit momentum: tests/core/test_muon_lowbit.py."""
    ours, opt, _ = _fused("torch", state_precision="bf16")
    wide, _, _ = _fused("torch")
    n = len(MUON_SHAPES)
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.bfloat16 for p in ours[:n])
    assert opt.state[ours[n]]["exp_avg"].dtype == torch.bfloat16
    assert _largest_difference(ours, wide) < 1e-2


def test_state_dicts_load_from_and_into_torch_optim_muon(tmp_path):
    """A FusedMuon of Muon groups only and torch.optim.Muon over the same matrices read each other's state dicts
    (momentum_buffer under torch's key; torch keeps no `step`, counted from the load): after a load both step on
    bit for bit, in both directions."""
    n = len(MUON_SHAPES)

    def pair():
        ours = [torch.nn.Parameter(p.clone()) for p in _params()[:n]]
        theirs = [torch.nn.Parameter(p.clone()) for p in _params()[:n]]
        fused = FusedMuon([{"params": ours, "use_muon": True, "lr": 0.02}], backend="torch")
        return ours, fused, theirs, torch.optim.Muon(theirs, lr=0.02)

    def step(params, opt, index):
        for p, g in zip(params, _grads(index)[:n]):
            p.grad = g.clone()
        opt.step()

    ours, fused, theirs, reference = pair()
    for index in range(2):
        step(theirs, reference, index)
    torch.save(reference.state_dict(), tmp_path / "torch.pt")
    fused.load_state_dict(torch.load(tmp_path / "torch.pt", weights_only=True))
    for p, q in zip(ours, theirs):
        p.data.copy_(q.data)
    step(ours, fused, 2)
    step(theirs, reference, 2)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs)), "torch's state loaded into FusedMuon"
    assert fused.param_groups[0]["use_muon"] is True

    other, _, back, reference_back = pair()
    torch.save(fused.state_dict(), tmp_path / "fused.pt")
    reference_back.load_state_dict(torch.load(tmp_path / "fused.pt", weights_only=True))
    for p, q in zip(back, ours):
        p.data.copy_(q.data)
    step(back, reference_back, 3)
    step(ours, fused, 3)
    assert all(torch.equal(p, q) for p, q in zip(ours, back)), "FusedMuon's state loaded into torch.optim.Muon"


@pytest.mark.parametrize(
    "dtype, precision, buffer_dtype",
    [(torch.float32, "bf16", torch.bfloat16), (torch.bfloat16, "fp32", torch.bfloat16)],
    ids=["bf16-momentum", "bf16-params"],
)
def test_a_resumed_run_keeps_the_momentum_dtype_and_the_trajectory(dtype, precision, buffer_dtype):
    """The momentum buffers' dtype is the Muon rule's (bf16 in a bf16 group; the param's dtype otherwise, as
    torch's): a state dict round trip (torch.save / torch.load) keeps it, so the resumed run is the uninterrupted
    one bit for bit. (torch's loader would cast a bf16 buffer of an fp32 param to fp32.)"""

    def make(params):
        return FusedMuon(_groups(params), max_grad_norm=MAX_NORM, state_precision=precision, backend="torch")

    def run(params, opt, steps):
        for step in steps:
            for p, g in zip(params, _grads(step)):
                p.grad = g.to(dtype)
            opt.step()

    init = [t.to(dtype) for t in _params()]
    whole = [torch.nn.Parameter(t.clone()) for t in init]
    run(whole, make(whole), range(4))
    first = [torch.nn.Parameter(t.clone()) for t in init]
    opt = make(first)
    run(first, opt, range(2))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = make(first)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    muon = [p for g in resumed.param_groups if g["use_muon"] for p in g["params"]]
    assert muon and all(resumed.state[p]["momentum_buffer"].dtype == buffer_dtype for p in muon)
    run(first, resumed, range(2, 4))
    for index, (a, b) in enumerate(zip(first, whole)):
        assert torch.equal(a, b), f"param {index}"
