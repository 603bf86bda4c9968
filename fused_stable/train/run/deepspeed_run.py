"""The trainer on DeepSpeed: `--deepspeed ds.json`, or `--zero_stage 0|1|2|3 [--offload_optimizer cpu]`, launched
with `torchrun --nproc_per_node N` or the `deepspeed` launcher (one process too).

- The config (`check_keys` before the model loads, `engine_config` after): the JSON file, or one built from the
  keys, with the trainer's batch keys filled where the file says "auto" or nothing (a different value is refused),
  bf16 from `precision`, ZeRO's "auto" bucket sizes from the model's hidden size (as the HF Trainer fills them),
  then `fused_stable.integrations.deepspeed.prepare_config` (no `optimizer` section, `gradient_clipping` 0, no fp16).
- The engine (`start`): `fs_deepspeed.initialize` with the trainer's FusedAdamW, so the clip, the skip, the z-score
  rules and the lr schedule are decided once per engine step from the global norm across ranks. `optim muon`
  (FusedMuon) at ZeRO 0-2 without offload: its matrices are rebuilt whole for Newton-Schulz on an owner rank
  (integrations/deepspeed_muon.py); ZeRO-3 and offload are refused before the model loads. The loop calls
  `backward` and `step` on every micro-batch; DeepSpeed steps the optimizer at its accumulation boundary, which
  `check_step` holds to the window's last micro-batch.
- Checkpoints: written and read with every other kind of run's, in `checkpoint_contents` (every rank's
  partitions through `engine.save_checkpoint` into `step-N/deepspeed/`, committed by rank 0 with the trainer's
  files; `engine.load_checkpoint` restores it on resume and on the guard's rollback).
- The adapter / model for `export` and `chat` (`save_final`): at ZeRO-3 gathered from the partitions on rank 0
  (`_zero3_consolidated_16bit_state_dict`), which writes it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import warnings

import torch
import torch.distributed as dist

from fused_stable.errors import UserError
from fused_stable.train.run import checkpoint, parallel

# ZeRO's bucket sizes the HF Trainer fills from the hidden size when a config says "auto" (transformers'
# HfTrainerDeepSpeedConfig.trainer_config_finalize, the oracle of tests/train/test_deepspeed_oracle.py): the
# reduce bucket at every stage, the two stage3_* keys only at ZeRO-3 (below it they stay "auto", which DeepSpeed
# reads as its default and which no stage below 3 uses)
_AUTO_SIZES = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
_ZERO3_ONLY = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
_QUIET = 2**31 - 1  # DeepSpeed's steps_per_print unless the file sets it: the trainer prints its own progress


def wanted(cfg) -> bool:
    """Whether the run trains through a DeepSpeed engine."""
    return cfg.deepspeed is not None or cfg.zero_stage is not None


def check_keys(cfg) -> None:
    """The DeepSpeed keys and file, checked before anything loads (UserError, one line)."""
    if cfg.deepspeed is not None and cfg.zero_stage is not None:
        raise UserError(
            "deepspeed and zero_stage exclude each other: --deepspeed takes a whole DeepSpeed config (its "
            "zero_optimization.stage), --zero_stage builds one from the trainer's keys"
        )
    if cfg.offload_optimizer != "none" and not cfg.zero_stage:
        raise UserError(
            f"offload_optimizer={cfg.offload_optimizer} needs zero_stage 1, 2 or 3 (with --deepspeed, offload in the "
            "file: zero_optimization.offload_optimizer.device)"
        )
    if not wanted(cfg):
        return
    if importlib.util.find_spec("deepspeed") is None:
        raise UserError("--deepspeed / --zero_stage need DeepSpeed: pip install deepspeed")
    raw = _base_config(cfg)
    if cfg.precision == "fp16":
        raise UserError(
            "precision=fp16 under DeepSpeed: its loss scaler is not taken over by fused_stable's integration; "
            "use precision bf16 or fp32"
        )
    if cfg.quant_bits is not None and stage_of(raw, cfg) == 3:
        raise UserError(
            f"quant_bits={cfg.quant_bits} (QLoRA) under ZeRO-3 is not supported: ZeRO-3 partitions the quantised "
            "base weights, which bitsandbytes' layers cannot gather; use ZeRO 0-2 (the adapters are what trains)"
        )
    if cfg.optim == "muon" and (stage_of(raw, cfg) == 3 or _offloads(raw)):
        raise UserError(
            f"optim muon under {_where(cfg)}: FusedMuon's Muon matrices run at ZeRO 0-2 without offload_optimizer "
            "(ZeRO-3's per-param partitions and the offloaded step are not built for Muon yet); use zero_stage 1 "
            "or 2, or optim adamw"
        )
    muon_matrices = cfg.optim == "muon" and (cfg.tuner == "full" or cfg.muon_lora)  # else all on AdamW
    if muon_matrices and cfg.state_precision == "8bit" and stage_of(raw, cfg) > 0:
        raise UserError(
            f"optim muon with state_precision 8bit under {_where(cfg)}: 8-bit Muon momentum is coded in blocks over "
            "whole matrices, and ZeRO 1-2 steps flat partitions of them; use state_precision bf16 (or zero_stage 0)"
        )
    # every refusal that does not need the model or the process count: the file's own mistakes, named
    _prepare(_fill(raw, cfg, world_size=None, precision=None, hidden=None), cfg)


def _offloads(raw: dict) -> bool:
    section = raw.get("zero_optimization", {}).get("offload_optimizer")
    return isinstance(section, dict) and str(section.get("device", "none")).lower() != "none"


def _where(cfg) -> str:
    return cfg.deepspeed if cfg.deepspeed is not None else f"--zero_stage {cfg.zero_stage}"


def _base_config(cfg) -> dict:
    """The file's config (or the one --zero_stage makes), not yet filled."""
    if cfg.deepspeed is None:
        zero: dict = {"stage": cfg.zero_stage}
        if cfg.offload_optimizer != "none":
            zero["offload_optimizer"] = {"device": cfg.offload_optimizer}
        return {"zero_optimization": zero}
    path = cfg.deepspeed
    if not os.path.isfile(path):
        raise UserError(f"deepspeed: config file {path!r} not found")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"deepspeed: {path} cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"deepspeed: {path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise UserError(f"deepspeed: {path} must hold a JSON object (DeepSpeed's config)")
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(f"deepspeed: {path}: zero_optimization must be an object")
    return raw


def stage_of(raw: dict, cfg) -> int:
    stage = raw.get("zero_optimization", {}).get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise UserError(f"deepspeed: {_where(cfg)}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return int(stage)


def _fill(raw: dict, cfg, *, world_size: int | None, precision: str | None, hidden: int | None) -> dict:
    """A copy of the config with the trainer's values where it says "auto" or nothing; a value that differs from
    the trainer's is refused (two sources for one number). `world_size` / `precision` / `hidden` None: not known
    yet (the checks before the process group, the device and the model), so what depends on them is not checked
    (and the hidden-size keys stay "auto")."""
    out = copy.deepcopy(raw)
    where = _where(cfg)
    batch = {
        "train_micro_batch_size_per_gpu": (cfg.batch_size, "batch_size"),
        "gradient_accumulation_steps": (cfg.grad_accum, "grad_accum"),
        "train_batch_size": (cfg.batch_size * cfg.grad_accum * (world_size or 1), "batch_size x grad_accum x ranks"),
    }
    for key, (value, ours) in batch.items():
        given = out.get(key, "auto")
        unknown = world_size is None and key == "train_batch_size"  # checked once the process count is known
        if given != "auto" and given != value and not unknown:
            raise UserError(
                f"deepspeed: {where} has {key}={given!r}, the trainer's keys make it {value} ({ours}): set it to "
                '"auto" (or leave it out) and give --batch_size / --grad_accum'
            )
        out[key] = given if unknown and given != "auto" else value
    if "scheduler" in out:
        raise UserError(
            f"deepspeed: {where} has a `scheduler` section: the lr schedule is the trainer's (--scheduler, "
            "--warmup_ratio, decided inside FusedAdamW's step): remove the section"
        )
    bf16 = out.get("bf16", {})
    if isinstance(bf16, dict):
        enabled = bf16.get("enabled", "auto")
        if enabled not in ("auto", False) and precision not in ("bf16", None):
            raise UserError(
                f"deepspeed: {where} enables bf16 but this run's precision is {precision}: give --precision bf16 "
                'or set bf16.enabled to "auto"'
            )
        if precision == "bf16" or "bf16" in out:
            out["bf16"] = {**bf16, "enabled": precision == "bf16"}
    fp16 = out.get("fp16")
    if isinstance(fp16, dict) and fp16.get("enabled") == "auto":
        out["fp16"] = {**fp16, "enabled": False}  # the trainer's fp16 is refused under DeepSpeed (check_keys)
    if out.get("gradient_clipping") == "auto":
        out["gradient_clipping"] = 0.0  # the clip is FusedAdamW's max_grad_norm
    zero = out.setdefault("zero_optimization", {})
    sized = {k for k in _AUTO_SIZES if k not in _ZERO3_ONLY or stage_of(out, cfg) == 3}
    if hidden is not None:
        for key in sized:
            if zero.get(key) == "auto":
                zero[key] = _AUTO_SIZES[key](hidden)
    # the hidden-size keys left "auto" on purpose: a stage below 3's stage3_* keys, any of them before the model
    waiting = {f"zero_optimization.{k}" for k in _AUTO_SIZES if hidden is None or k not in sized}
    left = [key for key in _auto_keys(out) if key not in waiting]
    if left:
        raise UserError(
            f'deepspeed: {where}: {left[0]} is "auto", which only the HF Trainer fills; the trainer fills the batch '
            f"keys, bf16, fp16, gradient_clipping and {', '.join(_AUTO_SIZES)}: give a value"
        )
    out.setdefault("steps_per_print", _QUIET)
    return out


def _auto_keys(section: dict, prefix: str = "") -> list[str]:
    found = []
    for key, value in section.items():
        if isinstance(value, dict):
            found += _auto_keys(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(f"{prefix}{key}")
    return found


def _prepare(filled: dict, cfg) -> dict:
    from fused_stable.integrations import deepspeed as fs_deepspeed

    try:
        return fs_deepspeed.prepare_config(filled)
    except ValueError as exc:
        raise UserError(f"deepspeed: {_where(cfg)}: {exc}") from None


def engine_config(cfg, model, precision: str) -> dict:
    """The config the engine is built with: filled for this model (None: before it loads, the hidden-size keys
    not yet), process count and precision, then prepared."""
    raw = _base_config(cfg)
    hidden = _hidden_size(raw, model, cfg) if model is not None else None
    filled = _fill(raw, cfg, world_size=parallel.world_size(), precision=precision, hidden=hidden)
    return _prepare(filled, cfg)


def _hidden_size(raw: dict, model, cfg) -> int | None:
    """The hidden size ZeRO's "auto" bucket sizes are made from, found as transformers finds it: the model
    config's `hidden_size`, else the largest of its `hidden_sizes`, else the same in its `text_config`. None when
    no such key says "auto"; a clear error when one does and the model has no hidden size."""
    zero = raw.get("zero_optimization", {})
    wanted_keys = [
        k for k in _AUTO_SIZES if zero.get(k) == "auto" and (k not in _ZERO3_ONLY or stage_of(raw, cfg) == 3)
    ]
    if not wanted_keys:
        return None
    config = getattr(model, "config", None)
    for where in (config, getattr(config, "text_config", None)):
        if where is None:
            continue
        if getattr(where, "hidden_size", None) is not None:
            return int(where.hidden_size)
        if getattr(where, "hidden_sizes", None):
            return int(max(where.hidden_sizes))
    raise UserError(
        f"deepspeed: {_where(cfg)}: the model's config has neither hidden_size nor hidden_sizes, so these "
        f'"auto" entries cannot be filled: {", ".join("zero_optimization." + k for k in wanted_keys)}; give '
        "them integer values"
    )


def check_run(cfg, resume_path: str | None, precision: str) -> None:
    """Before the model loads, once the process count and the precision are known: the config's values that depend
    on them, and the checkpoint to resume."""
    if wanted(cfg):
        engine_config(cfg, None, precision)
    check_resume(resume_path, cfg)


def check_resume(path: str | None, cfg) -> None:
    """A checkpoint resumes only through the kind of engine that wrote it (none, or DeepSpeed at the same stage)."""
    if path is None:
        return
    saved = checkpoint.read_trainer_state(path).get("zero_stage")
    now = stage_of(_base_config(cfg), cfg) if wanted(cfg) else None
    if saved != now:
        how = lambda stage: "without DeepSpeed" if stage is None else f"under DeepSpeed ZeRO-{stage}"  # noqa: E731
        raise UserError(
            f"{path!r} was written {how(saved)}, this run trains {how(now)}: resume it with the run's own "
            "deepspeed / zero_stage keys (leave them out to take the checkpoint's)"
        )


# ------------------------------------------------------------------------------------------ the engine
def _single_process_environment(device: torch.device) -> None:
    """What DeepSpeed needs to start without a launcher (one process), and its CPU accelerator on a CPU run."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" in os.environ or (dist.is_available() and dist.is_initialized()):
        return
    with socket.socket() as s:  # a free port for the process group of one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def start(model, optimizer, cfg, runtime) -> Engine:
    """`deepspeed.initialize` of the model with the trainer's FusedAdamW, attached to the engine
    (fused_stable.integrations.deepspeed)."""
    ds_config = engine_config(cfg, model, runtime.precision)
    _single_process_environment(runtime.device)
    import logging

    from deepspeed.utils import logger as ds_logger

    from fused_stable.integrations import deepspeed as fs_deepspeed

    ds_logger.setLevel(logging.WARNING)  # its per-step INFO lines would bury the trainer's own
    # DeepSpeed's ZeRO calls a collective torch deprecates, once per step and rank: nothing the user can act on
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    engine, *_ = fs_deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    out = Engine(engine, stage=int(ds_config["zero_optimization"].get("stage", 0)), adapter=cfg.tuner != "full")
    fused_step = engine.fused_stable_step
    # the header's and run_manifest.json's optimizer-state figure: every rank's partitions, gathered once here
    # (every rank builds the engine; only rank 0 prints and writes)
    out.state_per_rank, out.offload = fused_step.state_bytes_per_rank(), fused_step.offload
    return out


class Engine:
    """The DeepSpeed engine as the trainer drives it: backward and step per micro-batch, checkpoints, the final save."""

    def __init__(self, ds_engine, stage: int, adapter: bool):
        self.ds, self.stage, self.adapter = ds_engine, stage, adapter
        self.state_per_rank: list[int] = []  # bytes of FusedAdamW's state on each rank (set by `start`)
        self.offload = False  # ZeRO-Offload: that state lies in host memory

    def optimizer_state(self) -> dict:
        """The optimizer state's size from every rank's partitions (run_manifest.json's `optimizer_state` and the
        header): `mib` is this rank's share, as without DeepSpeed; `bytes_per_rank` (rank order), `mib_total`
        (their sum: under ZeRO-0 each rank holds a whole copy), `zero_stage`, `memory` ("host" under
        ZeRO-Offload, else "device")."""
        mine = self.state_per_rank[parallel.rank()]
        return {
            "mib": round(mine / 2**20, 3),
            "mib_total": round(sum(self.state_per_rank) / 2**20, 3),
            "bytes_per_rank": list(self.state_per_rank),
            "zero_stage": self.stage,
            "memory": "host" if self.offload else "device",
        }

    def backward(self, loss: torch.Tensor) -> None:
        # the loop's loss is already divided by the window's label tokens: DeepSpeed must not divide it again
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self) -> None:
        """Every micro-batch: DeepSpeed counts them and steps the optimizer (and zeroes the grads) at the boundary."""
        self.ds.step()

    def check_step(self, step: int) -> None:
        """After the window: DeepSpeed's optimizer steps must be the trainer's (its boundary is the window's end)."""
        if self.ds.global_steps != step:
            raise RuntimeError(
                f"DeepSpeed's engine has taken {self.ds.global_steps} optimizer steps, the trainer {step}: its "
                f"gradient_accumulation_steps ({self.ds.gradient_accumulation_steps()}) is not the window"
            )

    def numel(self, param: torch.Tensor) -> int:
        return int(getattr(param, "ds_numel", param.numel()))  # ZeRO-3 keeps an empty tensor on the module

    def save_final(self, model, tokenizer, cfg, output_dir: str) -> str:
        """The adapter (or model): at ZeRO-3 gathered from every rank's partitions (a collective); rank 0 writes."""
        from fused_stable.train.saved.final_model import save_final as save_one

        state = None
        if self.stage == 3:  # the module holds empty partitions: gather the full tensors on rank 0
            state = self.ds._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=self.adapter)
        target = os.path.join(output_dir, "model" if cfg.tuner == "full" else "adapter")
        if parallel.rank() == 0:
            target = save_one(model, tokenizer, cfg, output_dir, state_dict=state)
        parallel.barrier()
        return target
