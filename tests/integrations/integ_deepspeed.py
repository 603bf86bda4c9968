"""What the DeepSpeed tests run on each of their 2 gloo ranks (test_integ_deepspeed.py asserts on the results).

Every scenario builds a real DeepSpeed engine (DS_ACCELERATOR=cpu) on the same tiny MLP and data; all of them run
in one spawn, so DeepSpeed is imported, and its communication op JIT-built, once per test run (the build lands in
EXTENSIONS_DIR, kept between runs). Results are plain tensors and numbers, compared in the parent.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from helpers import count_symmetric_products

STEPS = 4
LOCAL_BATCH = 2
WORLD = 2
LR = 1e-2
WEIGHT_DECAY = 0.1
MAX_NORM = 0.05  # every step is clipped (the norms are ~1)
INF_STEP = 2  # the step whose gradient gets an inf on rank 0 in the skip scenarios
# a fixed place, so a second test run reuses the first one's build of DeepSpeed's communication op (~80 s)
EXTENSIONS_DIR = Path(tempfile.gettempdir()) / "fused_stable_deepspeed_extensions"
EXAMPLE_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples").glob("ds_zero*.json"))


def schedule():
    from fused_stable import schedules

    return schedules.warmup_linear(10, 2)  # lr x 0.5, 1.0, 0.875, ...: a count advanced twice shows


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(WORLD * LOCAL_BATCH, 8, generator=g), torch.randn(WORLD * LOCAL_BATCH, 4, generator=g))
        for _ in range(STEPS)
    ]


def make_model(hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


# the low-precision ZeRO-Offload runs: 12,288 weights, so each rank's flat partition of the weight group (6,144
# elements) is over the 4096 below which a tensor keeps fp32 moments, and its state is codes (or bf16)
LOWBIT_HIDDEN = 1024
LOWBIT_RUNS = [("offload-8bit", 2, 2), ("offload-8bit", 3, 2), ("offload-bf16", 2, 2)]


def param_groups(model: torch.nn.Module, groups: int) -> list:
    """One group, or a decay / no-decay split (weights, biases) as the HF Trainer makes."""
    if groups == 1:
        return [{"params": list(model.parameters())}]
    return [
        {"params": [model[0].weight, model[2].weight]},
        {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0},
    ]


def ds_config(stage: int, dtype: str, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": LOCAL_BATCH, "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


# ------------------------------------------------------------------------------------------------------------
# in the ranks


def setup_rank(rank: int) -> None:
    """DeepSpeed's environment, before it is imported (the process group is integ_dist's)."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), TORCH_EXTENSIONS_DIR=str(EXTENSIONS_DIR))
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(WORLD))


def full_fp32_params(engine, model) -> list[torch.Tensor]:
    """Every parameter's fp32 value (the fp32 master under ZeRO), whole on every rank."""
    from deepspeed.utils import safe_get_full_fp32_param

    if engine.zero_optimization_stage() == 0:
        return [p.detach().float().clone() for p in model.parameters()]
    return [safe_get_full_fp32_param(p).detach().clone() for p in model.parameters()]


def train(engine, rank: int, steps: range, inject_inf_at: int | None = None, model=None, same_data=False) -> list:
    """Steps on this rank's rows of the global batches (every row on every rank: `same_data`); returns the
    optimizer's grad_norm after each."""
    fused = getattr(engine.optimizer, "optimizer", engine.optimizer)
    handle = None
    norms = []
    batches = global_batches()
    for step in steps:
        if step == inject_inf_at and rank == 0:
            # one element of the last param's gradient, on rank 0 only: after the reduction it lies in rank 1's
            # partition, so each rank alone would decide differently
            def poison(grad):
                grad = grad.clone()
                grad.view(-1)[-1] = float("inf")
                return grad

            handle = list(model.parameters())[-1].register_hook(poison)
        x, y = batches[step]
        rows = slice(None) if same_data else slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        out = engine(x[rows].to(next(engine.module.parameters()).dtype))
        loss = F.mse_loss(out.float(), y[rows])
        engine.backward(loss)
        engine.step()
        if handle is not None:
            handle.remove()
            handle = None
        if hasattr(fused, "grad_norm"):
            norms.append(float(fused.grad_norm))
        else:
            norms.append(float(engine.get_global_grad_norm()))
    return norms


def counters(engine) -> dict:
    fused = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    return {
        "applied": int(fused.applied_steps),
        "skipped": int(fused.skipped_steps),
        "engine_steps": int(engine.global_steps),
        "last_lr": float(fused.last_lr),
    }


def optimizer_states(engine) -> list[torch.Tensor]:
    """Every state tensor of this rank's optimizer (its partitions), cloned, in a fixed order."""
    fused = engine.optimizer.optimizer
    out = []
    for state in fused.state.values():
        out += [state[k].detach().clone() for k in sorted(state) if torch.is_tensor(state[k])]
    return out


def state_figures(engine) -> dict:
    """What the integration says FusedAdamW's state takes: on this rank (before the first step: planned) and on
    every rank (gathered, a collective), and whether it is offloaded."""
    fused_step = engine.fused_stable_step
    return {
        "planned": fused_step.state_bytes(),
        "per_rank": fused_step.state_bytes_per_rank(),
        "host": fused_step.offload,
    }


def measured_state_bytes(engine) -> int:
    """Bytes of the state tensors this rank's FusedAdamW holds after a step (moments, scales), plus `step`'s 4
    per tensor it steps (what FusedAdamW.state_bytes counts for it)."""
    from fused_stable import state_format

    fused = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    return sum(state_format.moment_bytes(state) + 4 for state in fused.state.values())


def padded_engine(stage):
    """An engine whose param sizes (35, 5, 15, 3: 58 elements) DeepSpeed pads on 2 ranks, differently per stage."""
    from fused_stable import FusedAdamW
    from fused_stable.integrations import deepspeed as fs_deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = FusedAdamW(model.parameters(), lr=LR)
    engine, *_ = fs_deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, "fp32"))
    return engine


SGD_MOMENTUM = 0.9  # FusedSGD's runs (an elementwise rule after AdamW under ZeRO: issue 49 item 4)


def fused_engine(stage, dtype, groups, hidden=16, state_precision="fp32", rule="adamw", **config):
    from fused_stable import FusedAdamW, FusedSGD
    from fused_stable.integrations import deepspeed as fs_deepspeed

    model = make_model(hidden)
    cls, extra = (FusedSGD, {"momentum": SGD_MOMENTUM}) if rule == "sgd" else (FusedAdamW, {})
    opt = cls(
        param_groups(model, groups),
        **extra,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_NORM,
        lr_schedule=schedule(),
        state_precision=state_precision,
    )
    engine, *_ = fs_deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, dtype, **config))
    return engine, model


def torch_engine(stage, dtype, groups, fused: bool):
    """DeepSpeed's own way: torch's AdamW as the client optimizer, DeepSpeed clipping (the bf16 reference)."""
    import deepspeed

    model = make_model()
    opt = torch.optim.AdamW(param_groups(model, groups), lr=LR, weight_decay=WEIGHT_DECAY, fused=fused)
    cfg = ds_config(stage, dtype, gradient_clipping=MAX_NORM, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, model


def train_torch_reference(engine, rank):
    """The bf16 reference, with the fused run's lr schedule applied by hand."""
    sched = schedule()
    fused_ = getattr(engine.optimizer, "optimizer", engine.optimizer)
    norms = []
    for step in range(STEPS):
        for group in fused_.param_groups:
            group["lr"] = LR * sched.factor(step)
        norms += train(engine, rank, range(step, step + 1))
    return norms


# ------------------------------------------------------------------------------------------------------------
# FusedMuon (issue 50 item 2): two Muon groups of different hyper-parameters (two flat groups, their partitions cut
# through matrices) and an AdamW group, on ZeRO 0-2


def make_muon_model(width: int = 16) -> torch.nn.Module:
    """Matrices of 128, 256, 256 and 64 elements (tall, square twice, wide): each Muon group's flat buffer is cut
    through a matrix on 2 ranks, and the square pair shares a Newton-Schulz stack. `width` BLOCKS_WIDTH: the
    square pair's Gram side is two row blocks (their Gram products by blocks where chosen)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, width), torch.nn.Linear(width, width), torch.nn.Linear(width, width)]
    layers.append(torch.nn.Linear(width, 4))
    return torch.nn.Sequential(
        layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2], torch.nn.Tanh(), layers[3]
    )


MUON_MATRICES = 4
BLOCKS_WIDTH = 384  # newton_schulz.gram_blocks: two row blocks


def muon_groups(model: torch.nn.Module) -> list[dict]:
    weights = [m.weight for m in model if isinstance(m, torch.nn.Linear)]
    biases = [m.bias for m in model if isinstance(m, torch.nn.Linear)]
    return [
        {"params": weights[:2], "use_muon": True, "lr": LR},
        {"params": weights[2:], "use_muon": True, "lr": LR, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
        {"params": biases, "use_muon": False, "lr": LR, "weight_decay": 0.0},
    ]


def fused_muon(model: torch.nn.Module, clip: bool):
    from fused_stable import FusedMuon

    return FusedMuon(muon_groups(model), max_grad_norm=MAX_NORM if clip else None, lr_schedule=schedule())


def muon_engine(stage: int, clip: bool, width: int = 16, **config):
    from fused_stable.integrations import deepspeed as fs_deepspeed

    model = make_muon_model(width)
    engine, *_ = fs_deepspeed.initialize(
        model=model, optimizer=fused_muon(model, clip), config=ds_config(stage, "fp32", **config)
    )
    return engine, model


def train_accumulating(engine, steps: range) -> None:
    """Two micro-batches per optimizer step (gradient_accumulation_steps 2), the whole global batch on every rank."""
    batches = global_batches()
    for step in steps:
        x, y = batches[step]
        for half in (slice(0, LOCAL_BATCH), slice(LOCAL_BATCH, None)):
            engine.backward(F.mse_loss(engine(x[half]), y[half]))
            engine.step()


def muon_state_names(engine) -> list[list[str]]:
    """The state keys of each flat partition the optimizer holds (momentum_buffer: Muon; exp_avg...: AdamW)."""
    fused = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    return [sorted(fused.state[p]) for group in fused.param_groups for p in group["params"]]


def muon_runs(rank: int, out_dir: str) -> dict:
    results: dict = {}
    for stage in (0, 1, 2):  # each rank its rows, the global clip and the schedule
        engine, model = muon_engine(stage, clip=True)
        figures = state_figures(engine)
        norms = train(engine, rank, range(STEPS))
        results[("muon", stage, "split")] = {
            "params": full_fp32_params(engine, model),
            "norms": norms,
            **counters(engine),
            "states": muon_state_names(engine),
            "state": {**figures, "measured": measured_state_bytes(engine)},
        }
    for stage in (1, 2):  # the whole batch on every rank: DeepSpeed's averaged grads are one process's
        engine, model = muon_engine(stage, clip=False)
        train(engine, rank, range(STEPS), same_data=True)
        results[("muon", stage, "same")] = {"params": full_fp32_params(engine, model), **counters(engine)}
        engine, model = muon_engine(stage, clip=False, gradient_accumulation_steps=2)
        train_accumulating(engine, range(STEPS))
        results[("muon", stage, "accumulate")] = {
            "params": full_fp32_params(engine, model),
            **counters(engine),
            "orthogonalized": engine.fused_stable_step.orthogonalized_matrices,
        }
        results[("muon-inf", stage)] = muon_skip_run(rank, stage)
    with newton_schulz_in("fp32"):  # a CPU without bf16 products' choice: the partitions travel in fp32
        engine, model = muon_engine(2, clip=False)
        train(engine, rank, range(STEPS), same_data=True)
        results[("muon-fp32", 2)] = {"params": full_fp32_params(engine, model)}
    with gram_blocks_on():  # the Gram products by row blocks (a CPU without AMX's choice), whatever this CPU is
        engine, model = muon_engine(2, clip=False, width=BLOCKS_WIDTH)
        blocked = count_symmetric_products()
        train(engine, rank, range(STEPS), same_data=True)
        results[("muon-blocks", 2)] = {"params": full_fp32_params(engine, model)}
        results["muon-blocks-products"] = len(blocked)
    ckpt = os.path.join(out_dir, "ckpt-muon")  # a DeepSpeed checkpoint of the Muon partitions, resumed at ZeRO-2
    engine, model = muon_engine(2, clip=True)
    train(engine, rank, range(2))
    engine.save_checkpoint(ckpt, tag="half")
    train(engine, rank, range(2, STEPS))
    straight = full_fp32_params(engine, model), counters(engine)
    engine, model = muon_engine(2, clip=True)
    engine.load_checkpoint(ckpt, tag="half")
    train(engine, rank, range(2, STEPS))
    results[("muon-resume", 2)] = {"straight": straight, "resumed": (full_fp32_params(engine, model), counters(engine))}
    from fused_stable.rules.muon import torch as muon_torch

    muon_torch.DECIDE_ON_HOST = False  # the path of every device but the CPU: exchange always, select the old
    try:
        results[("muon-inf", "device")] = muon_skip_run(rank, 2)
    finally:
        muon_torch.DECIDE_ON_HOST = True
    return results


@contextlib.contextmanager
def newton_schulz_in(dtype: str):
    """Newton-Schulz in `dtype` inside (the suite pins torch's bf16, tests/conftest.py)."""
    from fused_stable.rules.muon.newton_schulz import ENV

    os.environ[ENV] = dtype
    try:
        yield
    finally:
        os.environ[ENV] = "bf16"


@contextlib.contextmanager
def gram_blocks_on():
    """Muon's Gram products by row blocks inside, whatever this CPU's choice (rules/muon/newton_schulz.py)."""
    from fused_stable.rules.muon.newton_schulz import BLOCKS_ENV

    os.environ[BLOCKS_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(BLOCKS_ENV)


def muon_skip_run(rank: int, stage: int) -> dict:
    """An inf in rank 0's gradient at INF_STEP: the states and params before and after it, then one more step."""
    engine, model = muon_engine(stage, clip=True)
    train(engine, rank, range(INF_STEP))
    before = optimizer_states(engine), full_fp32_params(engine, model)
    train(engine, rank, range(INF_STEP, INF_STEP + 1), inject_inf_at=INF_STEP, model=model)
    after = optimizer_states(engine), full_fp32_params(engine, model)
    train(engine, rank, range(INF_STEP + 1, STEPS))
    return {"before": before, "after": after, **counters(engine), "end": full_fp32_params(engine, model)}


def rank_worker(rank: int, world_size: int, out_dir: str) -> dict:
    setup_rank(rank)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    results: dict = muon_runs(rank, out_dir)
    # fp32 trajectories (compared with one process of torch AdamW + clip_grad_norm_ in the parent)
    for stage in (1, 2, 3):
        for groups in (1, 2):
            engine, model = fused_engine(stage, "fp32", groups)
            figures = state_figures(engine)
            norms = train(engine, rank, range(STEPS))
            results[("fp32", stage, groups)] = {
                "params": full_fp32_params(engine, model),
                "norms": norms,
                **counters(engine),
                "state": {**figures, "measured": measured_state_bytes(engine)},
            }
    # FusedSGD (momentum) at every stage: another elementwise rule through the same integration
    for stage in (1, 2, 3):
        engine, model = fused_engine(stage, "fp32", 1, rule="sgd")
        norms = train(engine, rank, range(STEPS))
        results[("sgd", stage, 1)] = {"params": full_fp32_params(engine, model), "norms": norms, **counters(engine)}
    # ZeRO-Offload: FusedAdamW is the offloaded CPU optimizer (zero_force_ds_cpu_optimizer: false)
    for stage in (1, 2, 3):
        offload = {"offload_optimizer": {"device": "cpu"}}
        engine, model = fused_engine(stage, "fp32", 2, zero_optimization={"stage": stage, **offload})
        figures = state_figures(engine)
        norms = train(engine, rank, range(STEPS))
        results[("offload", stage, 2)] = {
            "params": full_fp32_params(engine, model),
            "norms": norms,
            **counters(engine),
            "state": {**figures, "measured": measured_state_bytes(engine)},
        }
    # ZeRO-Offload with bf16 / 8-bit state (issue 36 item 3): FusedAdamW's compact state in host memory
    from fused_stable.state_format import moment_bytes

    for kind, stage, groups in LOWBIT_RUNS:
        offload = {"offload_optimizer": {"device": "cpu"}}
        engine, model = fused_engine(
            stage, "fp32", groups, hidden=LOWBIT_HIDDEN, state_precision=kind.split("-")[1],
            zero_optimization={"stage": stage, **offload},
        )  # fmt: skip
        figures = state_figures(engine)
        norms = train(engine, rank, range(STEPS))
        fused = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
        results[(kind, stage, groups)] = {
            "params": full_fp32_params(engine, model),
            "norms": norms,
            **counters(engine),
            "state": {**figures, "measured": measured_state_bytes(engine)},
            # per flat partition: (elements, its moments' bytes, {state name: (dtype, device)})
            "moments": [
                (p.numel(), moment_bytes(state), {k: (v.dtype, str(v.device)) for k, v in state.items()})
                for p, state in fused.state.items()
            ],
        }
    # ZeRO 0: DeepSpeed all-reduces whole grads and steps once
    engine, model = fused_engine(0, "fp32", 2)
    figures = state_figures(engine)
    norms = train(engine, rank, range(STEPS))
    results[("fp32", 0, 2)] = {
        "params": full_fp32_params(engine, model),
        "norms": norms,
        **counters(engine),
        "state": {**figures, "measured": measured_state_bytes(engine)},
    }
    # the state's size where DeepSpeed pads the partitions: planned, then after one step
    for stage in (1, 2, 3):
        engine = padded_engine(stage)
        figures = state_figures(engine)
        engine.backward(engine(torch.randn(LOCAL_BATCH, 7, generator=torch.Generator().manual_seed(rank))).sum())
        engine.step()
        results[("padded", stage)] = {**figures, "measured": measured_state_bytes(engine)}
    # bf16: against DeepSpeed with torch's AdamW (for-loop, and fused for the floor) and DeepSpeed's clip
    for stage in (1, 2, 3):
        engine, model = fused_engine(stage, "bf16", 2)
        norms = train(engine, rank, range(STEPS))
        entry = {"params": full_fp32_params(engine, model), "norms": norms, **counters(engine)}
        for name, fused in (("torch", False), ("torch_fused", True)):
            engine, model = torch_engine(stage, "bf16", 2, fused)
            norms = train_torch_reference(engine, rank)
            entry[name] = {"params": full_fp32_params(engine, model), "norms": norms}
        results[("bf16", stage, 2)] = entry
    # an inf on one rank: every rank skips, states bit-identical
    for stage in (1, 2, 3):
        engine, model = fused_engine(stage, "fp32", 2)
        train(engine, rank, range(INF_STEP))
        before = optimizer_states(engine), full_fp32_params(engine, model)
        train(engine, rank, range(INF_STEP, INF_STEP + 1), inject_inf_at=INF_STEP, model=model)
        after = optimizer_states(engine), full_fp32_params(engine, model)
        results[("inf", stage)] = {"before": before, "after": after, **counters(engine)}
    # resume from a DeepSpeed checkpoint
    for stage in (2, 3):
        ckpt = os.path.join(out_dir, f"ckpt{stage}")
        engine, model = fused_engine(stage, "fp32", 2)
        train(engine, rank, range(2))
        engine.save_checkpoint(ckpt, tag="half")
        train(engine, rank, range(2, STEPS))
        straight = full_fp32_params(engine, model), counters(engine)
        engine, model = fused_engine(stage, "fp32", 2)
        engine.load_checkpoint(ckpt, tag="half")
        train(engine, rank, range(2, STEPS))
        results[("resume", stage)] = {
            "straight": straight,
            "resumed": (full_fp32_params(engine, model), counters(engine)),
        }
    # the example configs train as they are (only the batch size is this test's)
    for path in EXAMPLE_CONFIGS:
        from fused_stable.integrations import deepspeed as fs_deepspeed

        cfg = {**fs_deepspeed.prepare_config(path), "train_micro_batch_size_per_gpu": LOCAL_BATCH}
        zero = cfg["zero_optimization"]
        engine, model = fused_engine(
            zero["stage"],
            "bf16" if cfg.get("bf16", {}).get("enabled") else "fp32",
            2,
            **{k: v for k, v in cfg.items() if k not in ("bf16",)},
        )
        norms = train(engine, rank, range(STEPS))
        results[("example", path.name)] = {
            "norms": norms,
            **counters(engine),
            "params": full_fp32_params(engine, model),
        }
    # the refusal: FusedAdamW with its own clip handed to deepspeed.initialize directly
    for stage in (1, 3):
        from fused_stable import FusedAdamW

        model = make_model()
        opt = FusedAdamW(model.parameters(), lr=LR, max_grad_norm=MAX_NORM)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=opt, config=ds_config(stage, "fp32", zero_allow_untested_optimizer=True)
        )
        try:
            train(engine, rank, range(1))
            results[("refusal", stage)] = None
        except RuntimeError as error:
            results[("refusal", stage)] = str(error)
    return results
