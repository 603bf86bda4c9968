"""The stability guard on a real FusedAdamW with synthetic gradients and losses: loss z-score math against plain
Python, every policy acting where it must, no false alarms on a steady 200-step run, state round trips."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from helpers import BACKEND_PARAMS, CountDeviceOps, no_host_reads

from fused_stable import FusedAdamW, schedules
from fused_stable.guard import (
    ACTION_GIVE_UP,
    ACTION_REBASELINE,
    ACTION_ROLLBACK,
    ACTION_SKIPPED,
    ACTION_STOP,
    ACTION_WARN,
    DATA_SHIFT,
    GRAD_SPIKE,
    LOSS_RISE,
    LOSS_SPIKE,
    NONFINITE_GRADS,
    NONFINITE_LOSS,
    Alert,
    Guard,
    GuardConfig,
    LossStats,
)
from fused_stable.train.run.report import AlertLog, read_alerts

NAMES = ["layers.0.weight", "layers.0.bias", "layers.1.weight", "head.weight", "norm.weight", "embed.weight"]
SHAPES = [(8, 8), (8,), (8, 8), (4, 8), (8,), (16, 8)]


class PlainLossStats:
    """The documented loss statistics, written as plainly as possible (lists, no incremental sums)."""

    def __init__(self, alpha, threshold, warmup, rel_floor):
        self.alpha, self.threshold, self.warmup, self.rel_floor = alpha, threshold, warmup, rel_floor
        self.warm_values = []
        self.mean = self.var = 0.0

    def scale(self):
        return max(math.sqrt(self.var), self.rel_floor * abs(self.mean), 1e-8)

    def update(self, x):
        if not math.isfinite(x):
            return math.inf
        ready = len(self.warm_values) >= self.warmup
        z = (x - self.mean) / self.scale() if ready else 0.0
        folded = self.mean + self.threshold * self.scale() if z > self.threshold else x
        if not ready:
            self.warm_values.append(folded)
            n = len(self.warm_values)
            self.mean = sum(self.warm_values) / n
            self.var = sum((v - self.mean) ** 2 for v in self.warm_values) / n
        else:
            self.mean = self.alpha * self.mean + (1 - self.alpha) * folded
            self.var = self.alpha * self.var + (1 - self.alpha) * (folded - self.mean) ** 2
        return z


def loss_sequence():
    rng = random.Random(3)
    values = [3.0 * math.exp(-i / 60) + 0.5 + 0.05 * rng.gauss(0, 1) for i in range(120)]
    values[30], values[50], values[51], values[90] = 9.0, float("nan"), 4.0, float("inf")
    return values


@pytest.mark.parametrize("alpha, warmup, rel_floor", [(0.97, 20, 0.01), (0.9, 5, 0.0)], ids=["defaults", "fast"])
def test_loss_zscore_matches_plain_python(alpha, warmup, rel_floor):
    ours, ref = LossStats(alpha, 6.0, warmup, rel_floor), PlainLossStats(alpha, 6.0, warmup, rel_floor)
    spikes = 0
    for x in loss_sequence():
        z_ours, z_ref = ours.update(x), ref.update(x)
        if math.isinf(z_ref):
            assert math.isinf(z_ours)
        else:
            assert z_ours == pytest.approx(z_ref, rel=1e-9, abs=1e-9)
        spikes += math.isfinite(z_ref) and z_ref > 6.0
    assert ours.mean == pytest.approx(ref.mean, rel=1e-12)
    assert ours.var == pytest.approx(ref.var, rel=1e-9)
    assert spikes >= 1  # the sequence exercises the folding of a spike
    assert ours.count == sum(math.isfinite(x) for x in loss_sequence())


def make_model(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]


def make_opt(params, guard: Guard, **kwargs):
    opt = FusedAdamW(
        params, lr=1e-3, max_grad_norm=1.0, clip="zscore", backend="torch", **guard.config.optimizer_kwargs(), **kwargs
    )
    opt.param_names = list(NAMES)
    guard.bind(opt)
    return opt


class Run:
    """Synthetic training: grads ~ N(0, 1) per element (a steady norm), a slowly falling noisy loss, and
    hooks to poison a step's gradient or loss. Checks every `log_every` steps like the trainer."""

    def __init__(self, policy="warn", log_every=5, seed=0, **guard_kwargs):
        self.guard = Guard(policy=policy, **guard_kwargs)
        self.params = make_model(seed)
        self.opt = make_opt(self.params, self.guard)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.rng = random.Random(seed)
        self.log_every = log_every
        self.step = 0
        self.rows = []
        self.decisions = []

    def run(self, steps, grad_scale=None, loss_at=None, only=None, row_at=None):
        """grad_scale: {step: factor} for every grad (or only for the tensor named `only`); row_at: {step:
        fields} added to that step's metrics row (an evaluation's values)."""
        grad_scale, loss_at, row_at = grad_scale or {}, loss_at or {}, row_at or {}
        for _ in range(steps):
            self.step += 1
            for name, p in zip(NAMES, self.params):
                factor = grad_scale.get(self.step, 1.0) if only in (None, name) else 1.0
                p.grad = torch.randn(p.shape, generator=self.gen) * factor
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            loss = loss_at.get(self.step, 2.0 * math.exp(-self.step / 300) + 0.05 * self.rng.gauss(0, 1))
            self.rows.append({"step": self.step, "loss": loss, "skipped": bool(self.opt.last_step_skipped.item())})
            self.rows[-1].update(row_at.get(self.step, {}))
            if self.step % self.log_every == 0:
                decision = self.guard.check(self.step, self.opt, self.rows)
                self.rows = []
                self.decisions.append(decision)
                if decision.action != "continue":
                    return decision
        return None

    @property
    def alerts(self):
        return [a for d in self.decisions for a in d.alerts]


@pytest.mark.parametrize("policy", ["warn", "rollback"])  # rollback: every check on, spike skipping on
def test_no_false_alarms_over_a_steady_200_step_run(policy):
    run = Run(policy, log_every=10)
    assert run.run(200) is None
    assert run.alerts == []
    assert run.opt.spike_skips.item() == 0 and run.opt.skipped_steps.item() == 0
    # the optimizer's own (gentle) ZClip threshold is crossed now and then: far from the guard's alert level
    assert run.guard.loss_stats.count == 200


def test_warn_records_a_spike_between_logs_with_its_step_and_tensors():
    run = Run("warn", log_every=10)
    for _ in range(4):
        run.run(10)
    scale = {run.step + 3: 1000.0}  # the 3rd step of the next interval: not a logging step
    run.run(10, grad_scale=scale, only="head.weight")
    alerts = run.alerts
    assert [a.kind for a in alerts] == [GRAD_SPIKE]
    alert = alerts[0]
    assert alert.step == 43 and alert.detected_at == 50 and alert.action == ACTION_WARN
    assert alert.value > 100 and alert.threshold == 6.0
    assert alert.grad_norm == pytest.approx(1000.0 * math.sqrt(32), rel=0.3)  # head.weight is 4 x 8
    top = alert.top_tensors
    assert len(top) == 5 and top[0]["name"] == "head.weight" and top[0]["grad_norm"] > 1000
    assert [t["grad_norm"] for t in top] == sorted((t["grad_norm"] for t in top), reverse=True)
    assert run.decisions[-1].action == "continue"


def test_skip_policy_makes_the_optimizer_skip_the_spike():
    run = Run("skip", log_every=5)
    run.run(40)
    before = [p.detach().clone() for p in run.params]
    run.run(5, grad_scale={43: 1e4})
    assert run.opt.spike_skips.item() == 1
    alert = next(a for a in run.alerts if a.kind == GRAD_SPIKE)
    assert alert.action == ACTION_SKIPPED and alert.step == 43
    assert run.decisions[-1].action == "continue"
    assert any(not torch.equal(b, p) for b, p in zip(before, run.params))  # the other steps were applied


def test_stop_policy_stops_with_a_resume_hint():
    run = Run("stop", log_every=5)
    run.run(40)
    decision = run.run(10, grad_scale={47: 1e3})
    assert decision is not None and decision.action == "stop"
    assert decision.alerts[0].action == ACTION_STOP and decision.alerts[0].kind == GRAD_SPIKE
    assert "--resume latest" in decision.message and run.step == 50


def test_rollback_policy_cuts_the_lr_and_gives_up_after_k():
    run = Run("rollback", log_every=5, max_rollbacks=2, skip_z=1e9)  # no device skip: the spikes get through
    run.run(40)
    base = [g["lr"] for g in run.opt.param_groups]
    for k in range(2):
        decision = run.run(10, grad_scale={run.step + 2: 100.0})
        assert decision.action == "rollback" and decision.cut_lr
        assert decision.alerts[0].action == ACTION_ROLLBACK
        run.guard.apply_rollback(run.opt, cut_lr=decision.cut_lr)
        assert [g["lr"] for g in run.opt.param_groups] == pytest.approx([b * 0.5 ** (k + 1) for b in base])
        run.run(10)  # a clean interval after the rollback: nothing new
    decision = run.run(10, grad_scale={run.step + 2: 100.0})
    assert decision.action == "stop" and decision.alerts[0].action == ACTION_GIVE_UP
    assert "gave up" in decision.message and "max_rollbacks=2" in decision.message
    assert run.guard.rollbacks == 2


def test_a_rollback_under_an_lr_schedule_cuts_the_base_lr_not_the_scheduled_one():
    """Mid warm-up the shown lr is a fraction of the configured one: the rollback halves the configured base lr
    (FusedAdamW.base_lrs / set_base_lrs), and the shown lr follows it at once."""
    schedule = schedules.warmup_cosine(400, 100)
    run = Run("rollback", log_every=5, skip_z=1e9)
    run.opt = make_opt(run.params, run.guard, lr_schedule=schedule)
    run.run(10)
    assert float(run.opt.param_groups[0]["lr"]) < 2e-4  # warming up towards 1e-3
    run.guard.apply_rollback(run.opt, cut_lr=True)
    assert run.opt.base_lrs() == [pytest.approx(5e-4)]
    factor = schedule.factor(int(run.opt.applied_steps))
    assert float(run.opt.param_groups[0]["lr"]) == pytest.approx(5e-4 * factor, rel=1e-6)


def test_rollback_policy_lets_the_optimizer_skip_huge_spikes():
    run = Run("rollback", log_every=5)
    run.run(40)
    assert run.run(10, grad_scale={43: 1e5}) is None  # z far above skip_z: skipped on the device, no rollback
    assert run.opt.spike_skips.item() == 1
    assert [a.action for a in run.alerts] == [ACTION_SKIPPED]


def test_isolated_nonfinite_steps_are_skipped_a_storm_escalates_without_an_lr_cut():
    run = Run("rollback", log_every=5)
    run.run(40)
    assert run.run(5, grad_scale={42: math.nan}, loss_at={42: math.nan}) is None
    assert sorted(a.kind for a in run.alerts) == [NONFINITE_GRADS, NONFINITE_LOSS]
    assert {a.action for a in run.alerts} == {ACTION_SKIPPED}
    assert run.alerts[0].top_tensors and all(math.isnan(t["grad_norm"]) for t in run.alerts[0].top_tensors)
    storm = {s: math.inf for s in range(46, 50)}
    decision = run.run(5, grad_scale=storm)
    assert decision.action == "rollback" and not decision.cut_lr
    assert decision.alerts[0].kind == NONFINITE_GRADS and decision.alerts[0].value == 4
    assert run.opt.skipped_steps.item() == 5


def test_loss_spike_and_loss_rise():
    run = Run("warn", log_every=5)
    run.run(40)
    run.run(5, loss_at={43: 20.0})
    spike = [a for a in run.alerts if a.kind == LOSS_SPIKE]
    assert len(spike) == 1 and spike[0].step == 43 and spike[0].value > 6 and spike[0].action == ACTION_WARN
    assert not [a for a in run.alerts if a.kind == LOSS_RISE]  # one spike does not move the interval's median
    run.run(5, loss_at={s: 4.0 for s in range(46, 51)})  # every step of an interval ~2x: a rise
    rise = [a for a in run.alerts if a.kind == LOSS_RISE]
    assert len(rise) == 1 and rise[0].value > 1.5 and rise[0].step == 50


@pytest.mark.parametrize("late_steps, rises", [(1, False), (2, True)])
def test_a_rise_late_in_an_interval_is_caught_at_its_check(late_steps, rises):
    """A divergence that starts in the last steps of an interval: the interval's median passes it, the median of
    its last 3 losses does not (the weights saved at that check are the diverging ones). One bad step alone,
    a spike, is not a rise."""
    run = Run("warn", log_every=5)
    run.run(40)
    run.run(5, loss_at={s: 8.0 for s in range(46 - late_steps, 46)})
    rise = [a for a in run.alerts if a.kind == LOSS_RISE]
    if rises:
        assert len(rise) == 1 and rise[0].step == 45 and rise[0].loss == 8.0 and rise[0].value > 3
    else:
        assert not rise


def test_data_shift_after_a_rollback_rebaselines_instead_of_rolling_back_again():
    run = Run("rollback", log_every=5)
    run.run(40)
    shifted = {s: 5.0 for s in range(41, 200)}
    decision = run.run(5, loss_at=shifted)
    assert decision.action == "rollback"
    run.guard.apply_rollback(run.opt, cut_lr=decision.cut_lr)
    # the restored model sees the new data: its first loss is already high
    assert run.run(40, loss_at=shifted) is None
    kinds = [a.kind for a in run.alerts]
    assert DATA_SHIFT in kinds and run.guard.rollbacks == 1
    assert next(a for a in run.alerts if a.kind == DATA_SHIFT).action == ACTION_REBASELINE


def test_guard_state_round_trips_through_json():
    run = Run("rollback", log_every=5, skip_z=1e9)
    run.run(40)
    decision = run.run(10, grad_scale={42: 100.0})
    run.guard.apply_rollback(run.opt, cut_lr=decision.cut_lr)
    state = json.loads(json.dumps(run.guard.state_dict()))  # what a checkpoint's trainer_state.json holds
    other = Guard(policy="rollback")
    other.load_state_dict(state)
    assert other.state_dict() == run.guard.state_dict()
    assert other.rollbacks == 1 and other.lr_scale == 0.5 and other.loss_stats.count == 45
    # the restored guard judges the next value exactly as the original does
    assert other.loss_stats.zscore(3.0) == run.guard.loss_stats.zscore(3.0)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_guarded_training_step_issues_the_same_device_ops_as_an_unguarded_one(backend):
    """The guard adds no device op per step (the decision kernel keeps the interval's worst step) and reads
    nothing between checks: a training step with a spike in it, guarded or not, dispatches the same ops."""
    seen = {}
    for guarded in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        guard = Guard(policy="rollback")
        opt = FusedAdamW(
            model.parameters(),
            lr=1e-3,
            max_grad_norm=1.0,
            clip="zscore",
            zscore_warmup=3,
            backend=backend,
            **guard.config.optimizer_kwargs(),
        )
        if guarded:
            guard.bind(opt)
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))

        def train_step(step, scale=1.0):
            (model(x).pow(2).mean() * scale).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for step in range(1, 6):  # the plan and the norm statistics
            train_step(step)
        with CountDeviceOps() as counter, no_host_reads():
            for step in range(6, 11):
                train_step(step, scale=1e3 if step == 8 else 1.0)  # a spike: the window's new worst step
        seen[guarded] = counter.ops
        if guarded:  # and the guard still names that step and its tensors at the check
            decision = guard.check(10, opt, [{"step": s, "loss": 1.0} for s in range(6, 11)])
            (alert,) = [a for a in decision.alerts if a.kind == GRAD_SPIKE]
            assert alert.step == 8 and alert.action == ACTION_SKIPPED and len(alert.top_tensors) == 4
    assert seen[True] == seen[False] and len(seen[False]) > 10


def test_skip_takes_moderate_spikes_and_leaves_heavy_tailed_normal_steps():
    """guard=skip at z > 6: the norm ratio (>= 5x the running mean) is what tells a real spike from the heavy
    tail of small-batch steps (z ~ 10+ at 2.5x the mean): with the z-score alone those would be skipped too."""
    tail = {31: 2.5, 38: 2.5, 45: 2.5}
    spike = {52: 8.0}
    run = Run("skip", log_every=5)
    assert run.guard.config.skip_z == 6.0 and run.guard.config.skip_ratio == 5.0
    run.run(60, grad_scale={**tail, **spike})
    assert run.opt.spike_skips.item() == 1
    assert [(a.kind, a.step, a.action) for a in run.alerts] == [(GRAD_SPIKE, 52, ACTION_SKIPPED)]
    z_alone = Run("skip", log_every=5, skip_ratio=0.0)
    z_alone.run(60, grad_scale={**tail, **spike})
    assert z_alone.opt.spike_skips.item() == 4  # the three normal heavy-tail steps as well


def refuse_constant(constant):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_alert_log_writes_jsonl_and_trims_on_resume(tmp_path):
    run = Run("warn", log_every=5)
    run.run(40)
    run.run(5, grad_scale={43: 1e3}, loss_at={44: math.nan})
    log = AlertLog(str(tmp_path))
    log.write(run.alerts)
    rows = read_alerts(str(tmp_path))
    assert {r["kind"] for r in rows} >= {GRAD_SPIKE, NONFINITE_LOSS}
    for r in rows:
        assert {"step", "kind", "value", "threshold", "action", "top_tensors"} <= r.keys()
        assert len(r["top_tensors"]) == 5 and all(t["name"] in NAMES for t in r["top_tensors"])
    assert math.isnan(next(r for r in rows if r["kind"] == NONFINITE_LOSS)["value"])  # read back as a float
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    raw = [json.loads(line, parse_constant=refuse_constant) for line in lines]  # strict JSON: no bare NaN
    assert {r["value"] for r in raw if r["kind"] == NONFINITE_LOSS} == {"NaN"}
    assert raw[0]["top_tensors"][0]["grad_norm"] == rows[0]["top_tensors"][0]["grad_norm"]
    AlertLog(str(tmp_path), start_step=40)  # a resume from step 40 drops what was detected after it
    assert read_alerts(str(tmp_path)) == []


def test_alerts_hold_nonfinite_numbers_as_strict_json_and_read_them_back(tmp_path):
    """An overflowed step: an inf grad norm (its tensors' too) and a NaN loss. alerts.jsonl parses with a strict
    parser, with "Infinity" / "NaN" in their places (docs/trainer.md), and `read_alerts` gives the floats back;
    a file written by an earlier version ("inf" / "nan") is read, and kept across a resume, the same way."""
    top = [{"name": "head.weight", "grad_norm": math.inf}, {"name": "embed.weight", "grad_norm": 2.5}]
    alerts = [
        Alert(
            step=7,
            kind=NONFINITE_GRADS,
            value=1.0,
            threshold=3.0,
            action=ACTION_SKIPPED,
            detected_at=10,
            grad_norm=math.inf,
            top_tensors=top,
        ),
        Alert(
            step=8,
            kind=NONFINITE_LOSS,
            value=math.nan,
            threshold=math.inf,
            action=ACTION_SKIPPED,
            detected_at=10,
            loss=-math.inf,
            top_tensors=top,
        ),
    ]
    AlertLog(str(tmp_path)).write(alerts)
    path = tmp_path / "alerts.jsonl"
    raw = [json.loads(line, parse_constant=refuse_constant) for line in path.read_text().splitlines()]
    assert raw[0]["grad_norm"] == "Infinity" and raw[0]["top_tensors"][0]["grad_norm"] == "Infinity"
    assert raw[1]["value"] == "NaN" and raw[1]["threshold"] == "Infinity" and raw[1]["loss"] == "-Infinity"
    back = read_alerts(str(tmp_path))
    assert back[0]["grad_norm"] == math.inf and back[0]["top_tensors"] == top and back[0]["loss"] is None
    assert math.isnan(back[1]["value"]) and back[1]["threshold"] == math.inf and back[1]["loss"] == -math.inf
    # an earlier version's file: str(float) spellings
    old = raw[0] | {"grad_norm": "inf", "top_tensors": [{"name": "head.weight", "grad_norm": "inf"}]}
    path.write_text(json.dumps(old) + "\n")
    AlertLog(str(tmp_path), start_step=10)  # a resume keeps what was detected up to its checkpoint
    (kept,) = [json.loads(line, parse_constant=refuse_constant) for line in path.read_text().splitlines()]
    assert kept["grad_norm"] == "Infinity" and kept["top_tensors"][0]["grad_norm"] == "Infinity"
    assert read_alerts(str(path))[0]["grad_norm"] == math.inf


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"policy": "panic"}, "policy must be one of"),
        ({"grad_z": 0}, "grad_z"),
        ({"lr_factor": 1.5}, "lr_factor"),
        ({"max_rollbacks": -1}, "max_rollbacks"),
        ({"loss_rise": 0.9}, "loss_rise"),
        ({"skip_ratio": -1}, "skip_ratio"),
        ({"skip_ratio": math.inf}, "skip_ratio"),
    ],
)
def test_bad_config_is_refused_in_one_line(bad, message):
    with pytest.raises(ValueError, match=message):
        GuardConfig(**bad)
