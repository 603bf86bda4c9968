"""The Muon rule's parts (fused_stable/rules/muon) against torch.optim.Muon (torch 2.13), the oracle:

- orthogonalize equals `_zeropower_via_newtonschulz` bit for bit, per matrix, strides included, at 1 and 2 threads;
- MuonSide equals torch.optim.Muon (and clip_grad_norm_ + Muon) bit for bit with fp32 params over several steps;
  bf16 buffers bit for bit, bf16 params within one bf16 ulp per step (rounded once where torch rounds twice);
- a skipped step leaves params and buffers bit-identical, whatever the grads hold;
- the lr factor scales the step; the lr adjustment, the group checks and the model split.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
import transformers
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from fused_stable.rules import muon
from fused_stable.rules.muon.newton_schulz import ShapeBatches, orthogonalize
from fused_stable.rules.muon.param_groups import muon_param_groups
from fused_stable.rules.muon.torch import MuonSide

SHAPES = [(64, 64), (32, 96), (96, 32), (1, 50), (50, 1), (1, 1), (37, 53), (53, 37), (2, 3), (768, 256)]
ONE = torch.tensor(1.0)
ZERO = torch.tensor(0.0)


@pytest.fixture(autouse=True, params=["host", "device"])
def decisions(request, monkeypatch):
    """Every MuonSide test on both paths: the CPU's host decisions (skipped steps return, applied ones update in
    place) and the device path (compute, then torch.where on the skip), which CUDA takes."""
    from fused_stable.rules.muon import torch as muon_torch

    monkeypatch.setattr(muon_torch, "DECIDE_ON_HOST", request.param == "host")
    return request.param


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}thread")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads, -0.0), dtype and shape included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def test_defaults_and_state_name_are_torchs():
    signature = inspect.signature(torch.optim.Muon.__init__).parameters
    assert {key: signature[key].default for key in muon.DEFAULTS} == muon.DEFAULTS
    source = inspect.getsource(torch.optim._muon)
    assert 'state["momentum_buffer"]' in source and muon.RULE.state_names() == ("momentum_buffer",)


def test_importing_the_rule_imports_no_triton():
    code = "import sys, fused_stable.rules.muon; print('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


# ---------------------------------------------------------------- Newton-Schulz


def _matrices(dtype=torch.float32):
    torch.manual_seed(0)
    out = []
    for shape in SHAPES:  # three per shape, the last all zeros
        out += [torch.randn(shape, dtype=dtype) * 3, torch.randn(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_orthogonalize_equals_torchs_newton_schulz_bit_for_bit(threads, dtype):
    updates = _matrices(dtype)
    kept = [u.clone() for u in updates]
    got = orthogonalize(updates, muon.NS_COEFFICIENTS, muon.NS_STEPS, muon.EPS)
    for u, result in zip(updates, got):
        expected = _zeropower_via_newtonschulz(u.clone(), muon.NS_COEFFICIENTS, muon.NS_STEPS, muon.EPS)
        assert same_bits(result, expected), f"{tuple(u.shape)}: {(result.float() - expected.float()).abs().max()}"
        assert result.stride() == expected.stride(), tuple(u.shape)  # a tall one is the .T of a contiguous result
    assert all(same_bits(u, k) for u, k in zip(updates, kept)), "an input was changed (bf16: divided in place)"
    assert not any(r.abs().sum() for r in got[2::3]), "a zero matrix stays zero"


def test_shape_batches_group_once_and_cut_long_groups():
    batches = ShapeBatches([(4, 5), (5, 4), (4, 5), (4, 5), (1, 1)], max_matrices=2)
    assert batches.batches == (((4, 5), (0, 2)), ((4, 5), (3,)), ((5, 4), (1,)), ((1, 1), (4,)))
    updates = _matrices()
    cut = ShapeBatches([u.shape for u in updates], max_matrices=2)
    got = orthogonalize(updates, muon.NS_COEFFICIENTS, 3, muon.EPS, batches=cut)
    whole = orthogonalize(updates, muon.NS_COEFFICIENTS, 3, muon.EPS)
    assert all(same_bits(a, b) for a, b in zip(got, whole))
    with pytest.raises(ValueError, match="2-D"):
        ShapeBatches([(2, 3, 4)])
    with pytest.raises(ValueError, match="built for 5"):
        orthogonalize(updates, muon.NS_COEFFICIENTS, 3, muon.EPS, batches=batches)


# ---------------------------------------------------------------- MuonSide against torch.optim.Muon


def _pair(dtype, options, buffer_dtype=None):
    """torch.optim.Muon over copies of the params, and a MuonSide over the others with zero buffers."""
    torch.manual_seed(1)
    params = [torch.randn(shape, dtype=dtype) for shape in SHAPES[:-1] + [(37, 53)]]  # two (37, 53)
    reference = [p.clone().requires_grad_() for p in params]
    buffers = [torch.zeros_like(p, dtype=buffer_dtype or dtype) for p in params]
    return (
        reference,
        torch.optim.Muon(reference, **options),
        params,
        buffers,
        MuonSide(params, buffers, [options] * len(params)),
    )


def _grads(params, scale=3.0):
    return [torch.randn(p.shape, dtype=p.dtype) * scale for p in params]


def _torch_step(reference, opt, grads, max_norm=None):
    for p, g in zip(reference, grads):
        p.grad = g.clone()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(reference, max_norm)
    opt.step()


def _assert_same_as_torch(reference, opt, params, buffers):
    for i, (r, p, buf) in enumerate(zip(reference, params, buffers)):
        assert same_bits(p, r.detach()), f"param {i} {tuple(p.shape)}: {(p - r.detach()).abs().max()}"
        assert same_bits(buf, opt.state[r]["momentum_buffer"]), f"buffer {i} {tuple(p.shape)}"


OPTIONS = {
    "defaults": {},
    "nesterov-off": {"nesterov": False, "lr": 0.02},
    "match-rms-adamw": {"adjust_lr_fn": "match_rms_adamw", "lr": 3e-4, "weight_decay": 0.01},
    "original-ns3-momentum0.8": {"adjust_lr_fn": "original", "ns_steps": 3, "momentum": 0.8, "lr": 0.05},
    "no-decay-coefficients": {"weight_decay": 0.0, "ns_coefficients": (3.0, -3.2, 1.2), "eps": 1e-5},
    # 1 - lr * wd rounded from fp64 (0.91) is not fp32's 1 - 0.09 (0.90999997): the decay's scalar is torch's
    "large-decay": {"lr": 0.3, "weight_decay": 0.3},
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_muon_side_equals_torch_muon_bit_for_bit_fp32(threads, options):
    reference, opt, params, buffers, side = _pair(torch.float32, options)
    for _ in range(4):
        grads = _grads(params)
        _torch_step(reference, opt, grads)
        side.step(grads, ONE, ZERO, ONE)
        _assert_same_as_torch(reference, opt, params, buffers)


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_grad_mul_is_the_clip_before_the_momentum(nesterov):
    reference, opt, params, buffers, side = _pair(torch.float32, {"nesterov": nesterov})
    for scale in (30.0, 0.01, 30.0):  # clipped, not clipped, clipped
        grads = _grads(params, scale)
        _torch_step(reference, opt, grads, max_norm=1.0)
        # torch's clip_grad_norm_'s multiplier, as the fused step computes it over all groups' grads
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        side.step(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0), ZERO, ONE)
        _assert_same_as_torch(reference, opt, params, buffers)


def test_bf16_buffers_equal_torchs_and_params_are_within_one_rounding_of_the_old_param():
    reference, opt, params, buffers, side = _pair(torch.bfloat16, {"lr": 0.02})
    worst = 0.0
    for _ in range(3):
        for r, p in zip(reference, params):  # each step from the same params: the per-step difference
            r.data.copy_(p)
        old = [p.float() for p in params]
        grads = _grads(params)
        _torch_step(reference, opt, grads)
        side.step(grads, ONE, ZERO, ONE)
        for r, p, buf, p0 in zip(reference, params, buffers, old):
            assert same_bits(buf, opt.state[r]["momentum_buffer"])
            # torch rounds p * decay to bf16, then the sum; MuonSide only the sum (from fp32): the two differ by
            # at most one rounding of p * decay and one of the result, i.e. eps * (|p| + |result|)
            diff = (p.float() - r.detach().float()).abs()
            bound = torch.finfo(torch.bfloat16).eps * (p0.abs() + r.detach().float().abs())
            worst = max(worst, float((diff / bound).max()))
    # measured: 0.71 of the bound (in ulps of the result alone: up to 58, where the update cancels most of p)
    assert 0 < worst <= 1


def test_a_skipped_step_leaves_params_and_buffers_bit_identical():
    reference, opt, params, buffers, side = _pair(torch.float32, {"lr": 0.02})
    grads = _grads(params)
    _torch_step(reference, opt, grads)
    side.step(grads, ONE, ZERO, ONE)
    params[0][0, :3] = torch.tensor([-0.0, 0.0, -1.5])  # signed zeros survive too
    reference[0].data[0, :3] = torch.tensor([-0.0, 0.0, -1.5])
    before = [t.clone() for t in params + buffers]
    bad = _grads(params)
    bad[0][0, 0], bad[3][0, 1], bad[6][2, 2] = float("inf"), float("nan"), float("-inf")
    side.step(bad, torch.tensor(float("nan")), ONE, ONE)  # a non-finite norm makes the multiplier NaN too
    assert all(same_bits(a, b) for a, b in zip(params + buffers, before))
    grads = _grads(params)  # the next step is torch's next step: nothing was poisoned
    _torch_step(reference, opt, grads)
    side.step(grads, ONE, ZERO, ONE)
    _assert_same_as_torch(reference, opt, params, buffers)


def test_lr_factor_scales_the_step():
    # a power of two scales lr and lr * weight_decay exactly: equal to torch's Muon at lr * factor, bit for bit
    reference, opt, params, buffers, side = _pair(torch.float32, {"lr": 0.04 * 0.25})
    _, _, scaled, scaled_buffers, scaled_side = _pair(torch.float32, {"lr": 0.04})
    for _ in range(2):
        grads = _grads(params)
        _torch_step(reference, opt, grads)
        scaled_side.step(grads, ONE, ZERO, torch.tensor(0.25))
        _assert_same_as_torch(reference, opt, scaled, scaled_buffers)
    before = [p.clone() for p in scaled]
    scaled_side.step(_grads(params), ONE, ZERO, ZERO)  # factor 0: no decay, no update; the momentum moves
    assert all(same_bits(a, b) for a, b in zip(scaled, before))
    assert not all(same_bits(a, b) for a, b in zip(scaled_buffers, buffers))


def test_muon_side_refuses_what_it_cannot_step():
    p = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="buffer 0"):
        MuonSide([p], [torch.zeros(4, 3)], [{}])
    with pytest.raises(ValueError, match="conv weight"):
        MuonSide([torch.zeros(2, 3, 3, 3)], [torch.zeros(2, 3, 3, 3)], [{}])
    with pytest.raises(ValueError, match="momentum"):
        MuonSide([p], [torch.zeros(3, 4)], [{"momentum": -0.1}])
    with pytest.raises(ValueError, match="none of them None"):
        MuonSide([p], [torch.zeros(3, 4)], [{}]).step([None], ONE, ZERO, ONE)


# ---------------------------------------------------------------- lr adjustment and group checks


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_adjusted_lr_is_torchs(adjust_lr_fn):
    for shape in SHAPES + [(4096, 11008), (11008, 4096)]:
        assert muon.adjusted_lr(0.02, adjust_lr_fn, shape) == _adjust_lr(0.02, adjust_lr_fn, torch.Size(shape))
    assert muon.adjusted_lr(1.0, "match_rms_adamw", (16, 64)) == 0.2 * 8
    assert muon.adjusted_lr(1.0, None, (64, 16)) == 2.0 and muon.adjusted_lr(1.0, None, (16, 64)) == 1.0
    with pytest.raises(ValueError, match="'original' or 'match_rms_adamw'"):
        muon.adjusted_lr(0.02, "moonlight", (4, 4))


REFUSED = {
    "lr": ({"lr": -1e-3}, "lr must be >= 0"),
    "lr-nan": ({"lr": float("nan")}, "lr must be >= 0"),
    "lr-tensor": ({"lr": torch.tensor(1e-3)}, "lr must be a real number"),
    "weight_decay": ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    "momentum": ({"momentum": -0.5}, "momentum must be >= 0"),
    "eps": ({"eps": -1e-7}, "eps must be >= 0"),
    "nesterov": ({"nesterov": 1}, "nesterov must be True or False"),
    "ns_steps-100": ({"ns_steps": 100}, "ns_steps must be an int from 1 to 99"),
    "ns_steps-0": ({"ns_steps": 0}, "ns_steps must be an int"),
    "ns_steps-float": ({"ns_steps": 5.0}, "ns_steps must be an int"),
    "ns_coefficients": ({"ns_coefficients": (3.4, -4.7)}, "ns_coefficients must be 3 finite numbers"),
    "adjust_lr_fn": ({"adjust_lr_fn": "moonlight"}, "adjust_lr_fn must be None"),
    "conv": ({"params": [torch.zeros(8, 3, 3, 3)]}, r"conv weight.*Reshape it to 2-D.*AdamW group"),
    "bias": ({"params": [torch.zeros(8)]}, "2-D matrices and 3-D stacks of them .* only; biases"),
    "5-D": ({"params": [torch.zeros(2, 2, 2, 2, 2)]}, "2-D matrices and 3-D stacks of them .* only"),
    "int": ({"params": [torch.zeros(2, 2, dtype=torch.int32)]}, "real floating point"),
}


@pytest.mark.parametrize("group, message", REFUSED.values(), ids=REFUSED.keys())
def test_check_muon_group_refuses(group, message):
    with pytest.raises(ValueError, match=message):
        muon.check_muon_group(group)


def test_check_muon_group_accepts_torchs_defaults():
    muon.check_muon_group({"params": [torch.zeros(3, 4)], **muon.DEFAULTS})
    muon.check_muon_group({"params": [torch.zeros(3, 4)], "ns_coefficients": [3.0, -3.0, 1.0], "momentum": 0.0})


# ---------------------------------------------------------------- the model split


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_muon_param_groups_put_exactly_the_hidden_projections_in_muon(tied):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config)
    model.model.layers[1].mlp.down_proj.weight.requires_grad_(False)  # frozen: in no group
    groups = muon_param_groups(model, lr=0.02, adamw_lr=3e-4, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = sorted(names[id(p)] for p in groups[0]["params"])
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    expected = sorted(
        f"model.layers.{i}.{'self_attn' if k < 4 else 'mlp'}.{name}.weight"
        for i in range(2)
        for k, name in enumerate(projections)
        if (i, name) != (1, "down_proj")
    )
    assert muon_names == expected
    assert groups[0]["use_muon"] is True and groups[0]["lr"] == 0.02 and groups[0]["momentum"] == 0.9
    adamw_names = sorted(names[id(p)] for p in groups[1]["params"])
    assert groups[1]["use_muon"] is False and groups[1]["lr"] == 3e-4
    assert "model.embed_tokens.weight" in adamw_names and ("lm_head.weight" in adamw_names) is not tied
    assert all(
        p.ndim == 1 for n, p in model.named_parameters() if n in adamw_names and "embed" not in n and "lm_head" not in n
    )
    seen = [id(p) for g in groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == sum(p.requires_grad for p in model.parameters())


def test_muon_param_groups_refuse_an_unknown_keyword():
    with pytest.raises(ValueError, match="unknown Muon keywords \\['momentun'\\]"):
        muon_param_groups(torch.nn.Linear(3, 4), momentun=0.9)


class _NamedOddly(torch.nn.Module):
    """A model without transformers' getters, whose embeddings and head are found by type, name and tying."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(10, 8)  # by type
        self.pos_embed = torch.nn.Parameter(torch.zeros(4, 8))  # by name, as LLaMA-Factory's "embed"
        self.hidden = torch.nn.Linear(8, 8)
        self.lora_A = torch.nn.Linear(8, 2, bias=False)  # a LoRA factor
        self.lm_head = torch.nn.Linear(8, 10, bias=False)  # by module name
        self.decoder = torch.nn.Linear(8, 10, bias=False)
        self.decoder.weight = self.tok.weight  # tied to the embedding: seen once, as tok.weight


def test_muon_param_groups_find_embeddings_and_heads_by_type_name_and_tying():
    model = _NamedOddly()
    muon_group, adamw_group = muon_param_groups(model)
    assert muon_group["params"] == [model.hidden.weight]
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in adamw_group["params"]) == [
        "hidden.bias",
        "lm_head.weight",
        "lora_A.weight",
        "pos_embed",
        "tok.weight",
    ]
