"""The stress suite behind `fused-stable stress`: reproducible failure scenarios (clean, lr_too_high,
poisoned_batch, fp16_overflow_storm, nan_injection, distribution_shift), each trained with the usual recipe
(torch AdamW + clip_grad_norm_) and the guarded one (FusedAdamW + the stability guard's rollback policy), each
built with the rule `--optim` names (adamw, lion, muon: `runs.RULES`), on the
embedded tiny Llama (the fast default) or on a pretrained model with LoRA (any `--model` that `sft` takes).

A run "diverged" when its final loss (mean of the last 10 steps) is not finite or is above twice the clean
run's of the same recipe; a run the guard stopped is "stopped". On a pretrained model every run is also judged
by what the model still knows: the trainer's held-out evaluation (`train.evaluation.before_after`) after the run
(`general_after`, `task_after`) against the base model's. Outputs: a table on stdout, stress.json and
stress.png in --output-dir. docs/guard.md says exactly what each scenario does and what the suite measured.

Modules: `scenarios` (the settings and each scenario's fault), `runs` (the workload, one scenario with one
recipe), `report` (verdict, table, stress.json, stress.png), `cli` (the command; `python -m
fused_stable.stress` too). The names below are re-exported for scripts and tests; `fused_stable.stress.scenarios`
is the function that lists the scenarios (the module of that name is imported by its full path).
"""

from fused_stable.stress.cli import build_parser, config_from_args, main, run_suite
from fused_stable.stress.report import format_table, judge, plot, write_json
from fused_stable.stress.runs import (
    FINAL_WINDOW,
    RECIPES,
    RunResult,
    Workload,
    build_real_workload,
    build_tiny_workload,
    build_workload,
    fp16_grad_hooks,
    run_one,
)
from fused_stable.stress.scenarios import (
    REAL_MODEL_DEFAULTS,
    TINY_MIN_LENGTH,
    Scenario,
    StressConfig,
    is_real,
    scenarios,
)

__all__ = [
    "FINAL_WINDOW",
    "REAL_MODEL_DEFAULTS",
    "RECIPES",
    "TINY_MIN_LENGTH",
    "RunResult",
    "Scenario",
    "StressConfig",
    "Workload",
    "build_parser",
    "build_real_workload",
    "build_tiny_workload",
    "build_workload",
    "config_from_args",
    "format_table",
    "fp16_grad_hooks",
    "is_real",
    "judge",
    "main",
    "plot",
    "run_one",
    "run_suite",
    "scenarios",
    "write_json",
]
