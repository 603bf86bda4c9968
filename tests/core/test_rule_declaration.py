"""A rule declares itself once (rules/declaration.py): what the machinery reads of it is derived, and the derived
values are the ones torch's optimizers use (keys, defaults, checks), checked here against torch itself."""

from __future__ import annotations

import inspect
import io
import pickle

import pytest
import torch

import fused_stable
from fused_stable import layout
from fused_stable.rules import CODECS, H_SIZE, RULES
from fused_stable.rules.declaration import SIGNED, UNSIGNED, HParam, Rule, State


def test_every_rule_of_the_registry_is_one_declaration():
    assert set(RULES) >= {"adamw", "lion", "muon"}
    for name, rule in RULES.items():
        assert isinstance(rule, Rule) and rule.name == name and rule.package == f"fused_stable.rules.{name}"
        assert rule.row_end <= H_SIZE
        assert sorted(rule.slot(name) for name in rule.row) == list(
            range(layout.FIRST_RULE_SLOT, rule.row_end)
        )  # no gap, no overlap
    assert H_SIZE == max(rule.row_end for rule in RULES.values())
    assert layout.H_LR < layout.H_SHOWN_LR < layout.FIRST_RULE_SLOT


def test_adamw_derives_torchs_keys_defaults_and_states():
    rule = RULES["adamw"]
    assert rule.state_names(False) == ("exp_avg", "exp_avg_sq")
    assert rule.state_names(True) == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert rule.option == "amsgrad"
    params = [torch.nn.Parameter(torch.randn(3))]
    reference = torch.optim.AdamW(params, amsgrad=True)
    params[0].grad = torch.ones(3)
    reference.step()
    assert set(reference.state[params[0]]) == set(rule.torch_state_keys)
    # the group defaults are torch.optim.AdamW's, key for key (so either loads the other's state dict)
    fused = fused_stable.FusedAdamW([torch.nn.Parameter(torch.randn(3))])
    torch_group = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))]).param_groups[0]
    fused_group = {k: v for k, v in fused.param_groups[0].items() if k != "state_precision"}
    assert fused_group.keys() == torch_group.keys()
    assert {k: v for k, v in fused_group.items() if k != "params"} == {
        k: v for k, v in torch_group.items() if k != "params"
    }
    assert rule.codecs == {"exp_avg": SIGNED, "exp_avg_sq": UNSIGNED, "max_exp_avg_sq": UNSIGNED}
    assert rule.stochastic_bf16 == frozenset({"exp_avg_sq"})


def test_lion_derives_lion_pytorchs_names():
    from lion_pytorch import Lion

    rule = RULES["lion"]
    assert rule.state_names() == ("exp_avg",) and rule.option is None
    assert rule.torch_state_keys == ("exp_avg",)  # lion-pytorch keeps no step
    signature = inspect.signature(Lion)
    for h in rule.hparams:
        assert signature.parameters[h.keyword].default == h.default, h.name


def test_a_state_name_shared_by_two_rules_has_one_codec():
    assert CODECS["exp_avg"] == SIGNED  # AdamW's and Lion's momentum: one codec, so their state dicts interload


def test_the_row_is_filled_from_the_declaration_in_float64():
    rule = RULES["adamw"]
    row = rule.hparam_row(0.5, (0.9, 0.999), 1e-8, 0.1, True, size=H_SIZE)
    assert len(row) == H_SIZE and row[layout.H_LR] == 0.5 and row[layout.H_SHOWN_LR] == 0.0
    assert row[rule.slot("one_minus_beta2")] == 1.0 - 0.999  # float64 on the host, not fp32
    assert row[rule.slot("grad_sign")] == -1.0  # maximize
    assert rule.hparam_row(torch.tensor(0.5), (0.9, 0.999), 1e-8, 0.1, False)[layout.H_LR] == 0.0  # copied on device


def test_a_declaration_with_an_undeclared_row_input_or_two_options_is_refused():
    with pytest.raises(TypeError, match="undeclared"):
        Rule("x", "X", "pkg", (State("m", SIGNED),), (HParam("lr", 1.0),), ("a",), ("beta",), lambda b: (b,))
    with pytest.raises(TypeError, match="at most one group option"):
        Rule(
            "x",
            "X",
            "pkg",
            (State("m", SIGNED, option="a"), State("v", UNSIGNED, option="b")),
            (HParam("lr", 1.0), HParam("a", False), HParam("b", False)),
            (),
            (),
            lambda: (),
        )


def test_defaults_refuse_a_keyword_the_rule_does_not_declare():
    with pytest.raises(TypeError, match="takes no hyper-parameter"):
        RULES["lion"].defaults(eps=1e-8)


def test_an_optimizer_pickled_before_the_classes_moved_still_loads():
    """Pickles name a class by module: those made when FusedAdamW lived in fused_stable/optim.py name it there."""
    p = torch.nn.Parameter(torch.randn(5))
    opt = fused_stable.FusedAdamW([p], lr=0.1, max_grad_norm=1.0)
    p.grad = torch.randn(5)
    opt.step()
    data = pickle.dumps(opt, protocol=2)  # GLOBAL opcodes name classes as text lines (no frames to keep in step)
    old = data.replace(b"cfused_stable.optimizers\nFusedAdamW\n", b"cfused_stable.optim\nFusedAdamW\n")
    assert old != data
    twin = pickle.load(io.BytesIO(old))
    assert type(twin) is fused_stable.FusedAdamW and twin.policy == opt.policy


def test_the_public_registry_lists_every_rule_with_its_class():
    assert set(fused_stable.OPTIMIZERS) == set(RULES)
    for name, entry in fused_stable.OPTIMIZERS.items():
        assert getattr(fused_stable, entry.title) is entry.cls and entry.title in fused_stable.__all__
        rules = {entry.cls.RULE, getattr(entry.cls, "MATRIX_RULE", None)}
        assert RULES[name] in rules, name


def test_an_optimizer_pickled_with_the_old_policy_name_still_loads():
    """Before the step's policy was StepPolicy, pickles held it as `rules`, of class layout.StepRules."""
    p = torch.nn.Parameter(torch.randn(5))
    opt = fused_stable.FusedAdamW([p], lr=0.1, max_grad_norm=1.0, spike_skip_threshold=9.0)
    old_class = pickle.dumps(opt.policy, protocol=2).replace(b"\nStepPolicy\n", b"\nStepRules\n")
    assert pickle.loads(old_class) == opt.policy
    state = opt.__getstate__()
    state["rules"] = state.pop("policy")
    twin = fused_stable.FusedAdamW.__new__(fused_stable.FusedAdamW)
    twin.__setstate__(state)
    assert twin.policy == opt.policy and "rules" not in twin.__dict__
