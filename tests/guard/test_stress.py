"""The stress suite on a short budget: the scenarios are reproducible, the faults are real (an fp16 overflow
really gives inf gradients, a NaN batch really kills the usual recipe), and the command writes its outputs."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from fused_stable import stress, strict_json

SHORT = dict(
    steps=60, pretrain_steps=20, log_every=5, snapshot_every=10, examples=400
)  # faults at step 30: after the 25-step warm-up of the norm statistics


@pytest.fixture(scope="module")
def short():
    torch.set_num_threads(1)
    cfg = stress.StressConfig(**SHORT)
    return cfg, stress.build_workload(cfg)


def test_runs_are_reproducible(short):
    cfg, work = short
    scenario = stress.scenarios(cfg)["poisoned_batch"]
    first = stress.run_one(work, cfg, scenario, "guarded")
    second = stress.run_one(work, cfg, scenario, "guarded")
    assert first.losses == second.losses and len(first.losses) == cfg.steps
    assert first.skipped_steps == second.skipped_steps == 1  # the poisoned batch: a spike skipped on the device


def test_nan_batch_kills_the_usual_recipe_not_the_guarded_one(short):
    cfg, work = short
    results = [
        stress.run_one(work, cfg, stress.scenarios(cfg)[name], recipe)
        for name in ("clean", "nan_injection")
        for recipe in stress.RECIPES
    ]
    stress.judge(results)
    by = {(r.scenario, r.recipe): r for r in results}
    assert by["nan_injection", "usual"].status == "diverged" and math.isnan(by["nan_injection", "usual"].final_loss)
    guarded = by["nan_injection", "guarded"]
    assert guarded.status == "ok" and guarded.skipped_steps == 1 and guarded.rolled_back == 0
    # one skipped step: the guarded run ends where its clean run does, within noise
    assert guarded.final_loss == pytest.approx(by["clean", "guarded"].final_loss, rel=0.1)
    # no fault: the fused step is torch's clip + AdamW in the same fp32 arithmetic, so the two recipes' losses
    # agree to a few ulps (measured: <= 1.5e-7 relative, 1-2 fp32 ulps, over these 10 steps); 1e-6 leaves room
    # for summation order and still sees an lr one schedule step off or a lost bias correction (>= 1e-4)
    assert by["clean", "guarded"].losses[:10] == pytest.approx(by["clean", "usual"].losses[:10], rel=1e-6)


# the two recipes' clean losses over their first 10 steps, max relative difference measured on this workload
# (2026-12-06, 2 Intel Xeon cores): adamw 1.8e-7, lion 3.2e-7, muon 6.8e-7 (torch Muon's bf16 Newton-Schulz
# amplifies one-ulp differences of the clipped grads, docs/FACTS), sgd 1.9e-7, adafactor 1.5e-7; ~3-5x the floor.
# Lion's floor is its sign: lion-pytorch against itself with every momentum element moved one ulp (a random
# direction each step) moves these losses by up to 7.0e-5 (three seeds, 2026-12-07, 2 AMD EPYC cores), since an
# interpolation that cancels to near zero flips its sign and the weight moves 2 lr. The fused momentum rounds
# differently where a CPU's kernels fuse a multiply-add (one ulp in 45k of 77k elements after 15 steps, AMD
# EPYC): 2.5e-6 there, 3.2e-7 on the Xeon. So Lion's tolerance is 3e-4, ~4x that floor; another rule's update is
# 1.3e-2 (AdamW) to 7.2e-2 (SGD) away from lion-pytorch's here
RULE_TOLERANCE = {"lion": 3e-4, "muon": 3e-6, "sgd": 1e-6, "adafactor": 1e-6}


@pytest.mark.parametrize("optim", list(RULE_TOLERANCE))
def test_both_recipes_take_the_suites_rule_and_the_guard_skips_a_nan_batch(short, optim):
    """`--optim lion|muon|sgd|adafactor`: the usual recipe steps lion-pytorch's Lion / torch's Muon + AdamW /
    torch's SGD / torch's Adafactor, the guarded one the fused class of the same rule; on clean data they
    follow each other (the guarded recipe on another rule would not), and the guarded run
    skips the NaN batch on the device and ends where its clean run does."""
    cfg = dataclasses.replace(short[0], optim=optim)
    work = short[1]
    runs = {
        (name, recipe): stress.run_one(work, cfg, stress.scenarios(cfg)[name], recipe)
        for name, recipe in (("clean", "usual"), ("clean", "guarded"), ("nan_injection", "guarded"))
    }
    stress.judge(list(runs.values()))
    usual, guarded = runs["clean", "usual"].losses[:10], runs["clean", "guarded"].losses[:10]
    assert guarded == pytest.approx(usual, rel=RULE_TOLERANCE[optim])
    nan = runs["nan_injection", "guarded"]
    assert nan.status == "ok" and nan.skipped_steps == 1 and nan.rolled_back == 0
    assert nan.final_loss == pytest.approx(runs["clean", "guarded"].final_loss, rel=0.1)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--optim", "adam"], "--optim"),
        (["--optim", "adafactor", "--state-precision", "bf16"], "factored second moments"),
    ],
)
def test_a_rule_the_suite_cannot_run_is_one_line(tmp_path, capsys, argv, problem):
    assert stress.main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fused-stable stress: error:") and problem in err[0], err
    assert not (tmp_path / "out").exists()


def test_muon_on_a_pretrained_model_steps_its_lora_factors_in_both_recipes():
    """`--optim muon --model <pretrained>`: the suite trains LoRA there, whose factors are the only hidden
    matrices that train, so both recipes put them on Muon (`muon_lora`, as sft's `--muon_lora true`), not on
    AdamW beside a Muon group with nothing in it."""
    from fused_stable.stress.runs import RULES
    from fused_stable.train.config.keys import TrainConfig
    from fused_stable.train.model.adapters import apply_tuner
    from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model

    torch.manual_seed(0)
    model = apply_tuner(build_tiny_model(build_byte_tokenizer()), TrainConfig(model="tiny", tuner="lora"))
    factors = {id(p) for name, p in model.named_parameters() if "lora_" in name and p.requires_grad}
    assert factors
    usual = RULES["muon"].usual(model, 1e-3)  # every trainable param is a factor: torch Muon alone
    assert [type(opt) for opt in usual] == [torch.optim.Muon]
    assert {id(p) for p in usual[0].param_groups[0]["params"]} == factors
    fused = RULES["muon"].fused(model, 1e-3)
    on_muon = {id(p) for group in fused.param_groups if group["use_muon"] for p in group["params"]}
    assert on_muon == factors


def test_fp16_emulation_overflows_like_fp16():
    model = torch.nn.Linear(4, 4)
    hooks = stress.fp16_grad_hooks(model)
    (model(torch.ones(1, 4)).sum() * 2.0**20).backward()  # grads of 2**20 > 65504: inf in fp16
    assert all(torch.isinf(p.grad).all() for p in model.parameters())
    model.zero_grad()
    (model(torch.ones(1, 4)).sum() * 2.0**-30).backward()  # 2**-30 < 6e-8: flushed to 0 in fp16
    assert all((p.grad == 0).all() for p in model.parameters())
    for h in hooks:
        h.remove()


def test_command_writes_table_json_and_png(tmp_path, capsys):
    code = stress.main(
        [
            "--scenarios",
            "lr_too_high",
            "--steps",
            "20",
            "--pretrain-steps",
            "10",
            "--log-every",
            "5",
            "--output-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "| lr_too_high | guarded |" in out and "| clean | usual |" in out
    data = json.loads((tmp_path / "stress.json").read_text(), parse_constant=refuse_constant)  # strict JSON
    assert {(r["scenario"], r["recipe"]) for r in data["results"]} == {
        (s, r) for s in ("clean", "lr_too_high") for r in stress.RECIPES
    }
    # the documented verdict: "diverged" = final loss (mean of the last 10 steps) not finite or above 2x the
    # clean run's of the same recipe; "stopped" = the guard gave up (5 rollbacks, not reached in 20 steps)
    # (non-finite numbers are written as the strings "NaN" / "Infinity", which float() reads back)
    clean = {r["recipe"]: float(r["final_loss"]) for r in data["results"] if r["scenario"] == "clean"}
    for r in data["results"]:
        losses, final = [float(x) for x in r["losses"]], float(r["final_loss"])
        assert len(losses) >= 10 and r["wall_s"] > 0
        assert final == pytest.approx(sum(losses[-10:]) / 10, rel=1e-9, nan_ok=True)
        bad = not math.isfinite(final) or final > 2.0 * clean[r["recipe"]]
        assert r["status"] == ("diverged" if bad else "ok"), r
    statuses = {(r["scenario"], r["recipe"]): r["status"] for r in data["results"]}
    assert statuses[("clean", "usual")] == statuses[("clean", "guarded")] == "ok"
    assert os.path.getsize(tmp_path / "stress.png") > 10_000


def refuse_constant(constant):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_stress_json_is_strict_and_gives_nonfinite_losses_back(tmp_path):
    """A diverged run's NaN losses and an inf final loss: stress.json parses with a strict parser, holds them
    as "NaN" / "Infinity", and `fused_stable.strict_json.loads` gives the floats back."""
    cfg = stress.StressConfig()
    results = [
        stress.RunResult("clean", "usual", losses=[2.0, 1.5], final_loss=1.75),
        stress.RunResult("nan_injection", "usual", losses=[2.0, math.nan], final_loss=math.nan, status="diverged"),
        stress.RunResult("lr_too_high", "usual", losses=[2.0, math.inf], final_loss=math.inf, status="diverged"),
    ]
    path = str(tmp_path / "stress.json")
    stress.write_json(path, cfg, stress.scenarios(cfg), results, stress.Workload(None, [], [], {}), 1.0, True)
    text = open(path).read()
    raw = json.loads(text, parse_constant=refuse_constant)
    assert raw["results"][1]["losses"] == [2.0, "NaN"] and raw["results"][2]["final_loss"] == "Infinity"
    back = strict_json.loads(text)["results"]
    assert math.isnan(back[1]["final_loss"]) and math.isnan(back[1]["losses"][1])
    assert back[2]["losses"] == [2.0, math.inf] and back[0]["final_loss"] == 1.75 and back[0]["status"] == "ok"


def test_bad_scenario_is_one_line(capsys):
    assert stress.main(["--scenarios", "meteor"]) == 2
    assert "unknown scenario 'meteor'" in capsys.readouterr().err


def test_the_verdict_rule_at_its_boundaries():
    """README / docs/guard.md: "diverged" = a non-finite final loss or one above 2x the same recipe's clean run;
    "stopped" (the guard gave up) is kept. The recorded runs never come near 2x, so the rule is checked on
    made-up results, at the boundary."""

    def result(scenario, recipe, final, status="ok"):
        return stress.RunResult(scenario, recipe, final_loss=final, status=status)

    results = [
        result("clean", "usual", 2.0),
        result("clean", "guarded", 3.0),
        result("at_2x", "usual", 4.0),
        result("above_2x", "usual", math.nextafter(4.0, math.inf)),
        result("at_2x", "guarded", 6.0),
        result("nan", "usual", math.nan),
        result("inf", "guarded", math.inf),
        result("gave_up", "guarded", math.nan, status="stopped"),
        # a scenario that ends on other data is not compared with the clean run's loss: non-finite only
        result("distribution_shift", "usual", 5.0),
        result("distribution_shift", "guarded", math.nan),
    ]
    stress.judge(
        results, other_data=[n for n, s in stress.scenarios(stress.StressConfig()).items() if s.ends_on_other_data]
    )
    assert {(r.scenario, r.recipe): r.status for r in results} == {
        ("clean", "usual"): "ok",
        ("clean", "guarded"): "ok",
        ("at_2x", "usual"): "ok",
        ("above_2x", "usual"): "diverged",
        ("at_2x", "guarded"): "ok",
        ("nan", "usual"): "diverged",
        ("inf", "guarded"): "diverged",
        ("gave_up", "guarded"): "stopped",
        ("distribution_shift", "usual"): "ok",
        ("distribution_shift", "guarded"): "diverged",
    }


def test_a_pretrained_model_takes_its_own_defaults_and_explicit_options_win():
    parse = stress.build_parser().parse_args
    tiny = stress.config_from_args(parse([]))
    assert tiny == stress.StressConfig()
    real = stress.config_from_args(parse(["--model", "smollm2-135m", "--steps", "40"]))
    assert real.model == "smollm2-135m" and stress.is_real(real) and real.steps == 40
    for name, value in stress.REAL_MODEL_DEFAULTS.items():
        if name != "steps":
            assert getattr(real, name) == value, name
    # the faults sit in the middle of the real suite's steps, after its norm statistics warmed up
    mid = stress.scenarios(real)["poisoned_batch"].poison_at
    assert mid == 20 and real.zscore_warmup < stress.scenarios(real)["fp16_overflow_storm"].storm[0]


def test_the_table_shows_what_the_model_still_knows():
    rows = [
        stress.RunResult("clean", "usual", final_loss=1.25, general_after=0.5, task_after=1.0),
        stress.RunResult("clean", "guarded", final_loss=1.5, general_after=0.25, task_after=0.75),
    ]
    before = {"general": {"accuracy": 0.559, "n": 34}, "identity": {"accuracy": 0.0, "n": 12}}
    table = stress.format_table(rows, before).splitlines()
    assert table[0].startswith("| scenario | recipe | outcome | final loss | general after | task after |")
    assert table[1].count("---") == table[0].count(" | ") + 1  # one separator cell per column
    assert table[2].startswith("| base model | - | - | - | 0.559 | 0.000 |")
    assert table[3].startswith("| clean | usual | ok | 1.250 | 0.500 | 1.000 | 0 |")
    assert "general after" not in stress.format_table([stress.RunResult("clean", "usual", final_loss=1.0)])


def test_an_unknown_model_is_one_line(tmp_path, capsys):
    assert stress.main(["--model", str(tmp_path / "no-such-model"), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fused-stable stress: error:") and "no-such-model" in err[0]
    assert not (tmp_path / "out").exists()
