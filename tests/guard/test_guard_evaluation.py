"""The guard's evaluation checks on synthetic numbers (docs/guard.md, "What is watched"): an evaluation's
eval_loss or retention_loss above `eval_rise` x its best so far (the model before its first step included)
alerts, at the factor itself it does not; each policy answers it (skip has nothing to skip: it warns; rollback
cuts the lr); after a data shift the evaluations take the new data's level as their reference; the bests travel
in the guard's state. The trainer-level tests (a real rise on the tiny model) are in test_guard_trainer.py."""

from __future__ import annotations

import json
import math

import pytest
from test_guard import Run

from fused_stable.guard import (
    ACTION_REBASELINE,
    ACTION_ROLLBACK,
    ACTION_STOP,
    ACTION_WARN,
    DATA_SHIFT,
    EVAL_LOSS_RISE,
    EVALUATED,
    LOSS_RISE,
    NONFINITE_GRADS,
    RETENTION_LOSS_RISE,
    Guard,
    GuardConfig,
)

RISE = GuardConfig().eval_rise


def evaluate(run: Run, **values) -> object:
    """One logging interval (5 steps) whose last row carries an evaluation's values; the guard's decision."""
    run.run(5, row_at={run.step + 5: values})
    return run.decisions[-1]


def kinds(decision) -> list[str]:
    return [a.kind for a in decision.alerts]


def test_the_alert_kinds_and_fields():
    assert EVALUATED == {"eval_loss": EVAL_LOSS_RISE, "retention_loss": RETENTION_LOSS_RISE}
    assert EVAL_LOSS_RISE == "eval_loss_rise" and RETENTION_LOSS_RISE == "retention_loss_rise"


@pytest.mark.parametrize("key", ["eval_loss", "retention_loss"])
def test_a_rise_above_the_factor_alerts_at_the_factor_it_does_not(key):
    run = Run("warn", log_every=5)
    run.run(20)
    run.guard.eval_reference({key: 2.0})  # before the first step
    assert kinds(evaluate(run, **{key: 1.6})) == []  # lower: the new best
    assert run.guard.best_eval[key] == 1.6
    assert kinds(evaluate(run, **{key: 1.6 * RISE})) == []  # exactly the factor: no alert
    decision = evaluate(run, **{key: math.nextafter(1.6 * RISE, math.inf)})
    assert kinds(decision) == [EVALUATED[key]]
    alert = decision.alerts[0]
    assert alert.value == pytest.approx(RISE) and alert.threshold == RISE and alert.action == ACTION_WARN
    assert alert.step == alert.detected_at == run.step and alert.loss == pytest.approx(1.6 * RISE)
    assert "rose to" in alert.describe() and ("retention" in alert.describe()) == (key == "retention_loss")
    assert run.guard.best_eval[key] == 1.6  # a rise is not a new best


def test_the_reference_before_the_first_step_counts_as_best():
    run = Run("warn", log_every=5)
    run.run(20)
    run.guard.eval_reference({"retention_loss": 0.5, "eval_loss": 3.0})
    decision = evaluate(run, retention_loss=0.7, eval_loss=2.0)  # the first evaluation in training: already 1.4x
    assert kinds(decision) == [RETENTION_LOSS_RISE] and decision.alerts[0].value == pytest.approx(1.4)
    # without the reference the first evaluation is only the best so far
    fresh = Run("warn", log_every=5)
    fresh.run(20)
    assert kinds(evaluate(fresh, retention_loss=0.7)) == [] and fresh.guard.best_eval == {"retention_loss": 0.7}


def test_each_loss_has_its_own_best_and_one_factor():
    run = Run("warn", log_every=5)
    run.run(20)
    run.guard.eval_reference({"eval_loss": 1.0, "retention_loss": 0.5})
    decision = evaluate(run, eval_loss=1.2, retention_loss=0.7)  # 1.2x (below 1.3) and 1.4x
    assert kinds(decision) == [RETENTION_LOSS_RISE]
    decision = evaluate(run, eval_loss=1.4, retention_loss=0.5)
    assert kinds(decision) == [EVAL_LOSS_RISE]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nonfinite_evaluation_alerts(bad):
    run = Run("warn", log_every=5)
    run.run(20)
    run.guard.eval_reference({"eval_loss": 1.0})
    assert kinds(evaluate(run, eval_loss=bad)) == [EVAL_LOSS_RISE]
    assert run.guard.best_eval == {"eval_loss": 1.0}


def test_a_zero_factor_turns_the_alerts_off():
    run = Run("warn", log_every=5, eval_rise=0)
    run.run(20)
    run.guard.eval_reference({"eval_loss": 1.0})
    assert kinds(evaluate(run, eval_loss=50.0)) == []


@pytest.mark.parametrize(
    "policy, action, alert_action, cut_lr",
    [
        ("warn", "continue", ACTION_WARN, False),
        ("skip", "continue", ACTION_WARN, False),  # nothing for the optimizer to skip: a warning
        ("stop", "stop", ACTION_STOP, False),
        ("rollback", "rollback", ACTION_ROLLBACK, True),  # the lr may be the cause: cut it
    ],
)
def test_each_policy_answers_a_rise(policy, action, alert_action, cut_lr):
    run = Run(policy, log_every=5)
    run.run(20)
    run.guard.eval_reference({"retention_loss": 0.5})
    decision = evaluate(run, retention_loss=1.0)
    assert decision.action == action and decision.cut_lr is cut_lr
    assert [(a.kind, a.action) for a in decision.alerts] == [(RETENTION_LOSS_RISE, alert_action)]


def test_a_rollback_for_an_evaluation_cuts_the_lr_by_eval_lr_factor_a_spike_by_lr_factor():
    """The probes see damage a check late, when the lr has done it: their rollback cuts deeper (0.25 by default)
    than a loss or grad spike's (0.5); both factors are the user's to set."""
    run = Run("rollback", log_every=5, skip_z=1e9)  # no device skip: the grad spike gets through
    run.run(20)
    run.guard.eval_reference({"retention_loss": 0.5})
    decision = evaluate(run, retention_loss=1.0)
    assert decision.cut_lr and decision.lr_factor == 0.25
    run.guard.apply_rollback(run.opt, decision.cut_lr, lr_factor=decision.lr_factor)
    assert run.guard.lr_scale == 0.25 and run.opt.base_lrs() == [pytest.approx(2.5e-4)]
    run.run(10)
    decision = run.run(10, grad_scale={run.step + 2: 100.0})
    assert decision.action == "rollback" and decision.lr_factor == 0.5
    run.guard.apply_rollback(run.opt, decision.cut_lr, lr_factor=decision.lr_factor)
    assert run.guard.lr_scale == 0.125
    own = Run("rollback", log_every=5, eval_lr_factor=0.1)
    own.run(20)
    own.guard.eval_reference({"eval_loss": 0.5})
    assert evaluate(own, eval_loss=1.0).lr_factor == 0.1


def test_after_a_data_shift_the_evaluations_follow_the_new_data():
    """A rollback whose restored model finds the new data bad is a data shift: the held-out losses move with the
    new data too, so until the guard's statistics are warm again each evaluation is the reference; then a rise
    from the level the new data settled at alerts again."""
    run = Run("rollback", log_every=5)
    run.run(40)
    run.guard.eval_reference({"eval_loss": 1.0})
    shifted = {s: 5.0 for s in range(41, 300)}
    decision = run.run(5, loss_at=shifted)
    assert decision.action == "rollback"
    run.guard.apply_rollback(run.opt, cut_lr=decision.cut_lr)
    run.run(5, loss_at=shifted, row_at={run.step + 5: {"eval_loss": 2.0}})  # 2x: the new data's level
    decision = run.decisions[-1]
    assert DATA_SHIFT in kinds(decision) and EVAL_LOSS_RISE not in kinds(decision)
    assert run.guard.best_eval["eval_loss"] == 2.0
    # after the grace window a rise above the new level alerts again
    run.run(5 * math.ceil((run.guard.grace_until - run.step) / 5), loss_at=shifted)
    assert run.step >= run.guard.grace_until
    run.run(5, loss_at=shifted, row_at={run.step + 5: {"eval_loss": 2.0 * RISE * 1.01}})
    assert EVAL_LOSS_RISE in kinds(run.decisions[-1])


def test_a_rollback_forgets_the_bests_of_the_steps_it_undid():
    """Found on SmolLM2 at 7.5x the lr (docs/guard.md): an evaluation's eval_loss fell to a new best while its
    retention_loss rose past the factor; after the rollback that best belonged to undone steps, and the restored
    model's sound eval_loss counted as a rise. The bests go back to those of the restored step."""
    run = Run("rollback", log_every=5)
    run.run(20)
    run.guard.eval_reference({"eval_loss": 3.0, "retention_loss": 0.5})
    assert kinds(evaluate(run, eval_loss=2.0, retention_loss=0.5)) == []  # step 25: the new eval_loss best
    kept = run.step
    decision = evaluate(run, eval_loss=0.8, retention_loss=0.75)  # step 30: eval_loss falls, retention 1.5x
    assert decision.action == "rollback" and kinds(decision) == [RETENTION_LOSS_RISE]
    assert run.guard.best_eval == {"eval_loss": 0.8, "retention_loss": 0.5}
    run.guard.apply_rollback(run.opt, cut_lr=decision.cut_lr, to_step=kept)
    assert run.guard.best_eval == {"eval_loss": 2.0, "retention_loss": 0.5}
    assert EVAL_LOSS_RISE not in kinds(evaluate(run, eval_loss=2.4, retention_loss=0.5))  # 1.2x of 2.0, 3x of 0.8
    # back to before the first step: the reference
    decision = evaluate(run, eval_loss=1.0, retention_loss=1.0)
    run.guard.apply_rollback(run.opt, cut_lr=decision.cut_lr, to_step=0)
    assert run.guard.best_eval == {"eval_loss": 3.0, "retention_loss": 0.5}


def test_the_bests_travel_in_the_guard_state():
    run = Run("rollback", log_every=5)
    run.run(20)
    run.guard.eval_reference({"eval_loss": 2.0, "retention_loss": 0.5})
    evaluate(run, eval_loss=1.5, retention_loss=0.6)
    state = json.loads(json.dumps(run.guard.state_dict()))  # what a checkpoint's trainer_state.json holds
    assert state["best_eval"] == {"eval_loss": 1.5, "retention_loss": 0.5}
    other = Guard(policy="rollback")
    other.load_state_dict(state)
    assert other.best_eval == run.guard.best_eval
    assert (
        other.eval_history
        == run.guard.eval_history
        == [[0, {"eval_loss": 2.0, "retention_loss": 0.5}], [25, state["best_eval"]]]
    )
    # a state written before the evaluations existed loads with no best
    del state["best_eval"]
    older = Guard(policy="rollback")
    older.load_state_dict(state)
    assert older.best_eval == {}


@pytest.mark.parametrize("bad", [0.5, 1.0, math.inf, -1.0])
def test_a_bad_factor_is_refused(bad):
    with pytest.raises(ValueError, match="eval_rise"):
        GuardConfig(eval_rise=bad)


def _shift_at_a_check(grad_scale=None, **evaluation):
    """40 steady steps, a reference evaluation, then the loss jumps to 5x from step 41 on; the check at step 45
    carries `evaluation` (none when empty). Returns the run and its step-45 decision."""
    run = Run("rollback", log_every=5)
    run.run(40)
    run.guard.eval_reference({"eval_loss": 1.0, "retention_loss": 0.5})
    lr_before = [g["lr"] for g in run.opt.param_groups]
    shifted = {s: 10.0 for s in range(41, 300)}
    row = {45: evaluation} if evaluation else {}
    decision = run.run(5, loss_at=shifted, row_at=row, grad_scale=grad_scale) or run.decisions[-1]
    return run, decision, shifted, lr_before


def test_a_loss_rise_whose_evaluation_held_is_a_data_shift_not_a_rollback():
    """Issue 52 item 2: a shift that persists (the loss at a new level, grads finite, the held-out losses where
    they were) is new data, not broken weights: no rollback, no lr cut, the loss statistics and the optimizer's
    grad-norm statistics start over, and the run goes on on the new data without another alert."""
    run, decision, shifted, lr_before = _shift_at_a_check(eval_loss=1.1, retention_loss=0.55)  # 1.1x: held
    assert decision.action == "continue" and kinds(decision).count(DATA_SHIFT) == 1
    assert LOSS_RISE not in kinds(decision)
    assert all(a.action == ACTION_REBASELINE for a in decision.alerts)  # the interval's loss spikes follow it
    shift = next(a for a in decision.alerts if a.kind == DATA_SHIFT)
    assert shift.value > GuardConfig().loss_rise and shift.loss == 10.0 and "the data changed" in shift.describe()
    assert run.guard.rollbacks == 0 and run.guard.lr_scale == 1.0
    assert [g["lr"] for g in run.opt.param_groups] == lr_before
    assert run.guard.best_interval_loss is None and run.guard.loss_stats.count == 0
    assert run.guard.grace_until == 45 + GuardConfig().loss_warmup
    assert run.opt.grad_norm_mean.item() == 0.0  # the optimizer's norm statistics warm up again
    assert run.run(40, loss_at=shifted) is None and run.decisions[-1].alerts == []


@pytest.mark.parametrize(
    "evaluation, why",
    [
        (dict(eval_loss=1.1, retention_loss=0.5 * RISE * 1.01), RETENTION_LOSS_RISE),  # the model forgot
        (dict(eval_loss=1.0 * RISE * 1.01, retention_loss=0.5), EVAL_LOSS_RISE),  # ...or unlearnt its task
        ({}, None),  # no evaluation at this check: nothing says the model held
    ],
)
def test_a_loss_rise_the_evaluation_did_not_clear_rolls_back(evaluation, why):
    run, decision, _, _ = _shift_at_a_check(**evaluation)
    assert decision.action == "rollback" and DATA_SHIFT not in kinds(decision)
    assert LOSS_RISE in kinds(decision) and (why is None or why in kinds(decision))


def test_a_loss_rise_with_non_finite_grads_is_not_a_shift():
    """Grads must be finite for the data to be the cause: a non-finite step in the interval keeps the rise."""
    _, decision, _, _ = _shift_at_a_check(grad_scale={43: math.inf}, eval_loss=1.0)
    assert decision.action == "rollback" and DATA_SHIFT not in kinds(decision)
    assert NONFINITE_GRADS in kinds(decision) and LOSS_RISE in kinds(decision)
