"""Glue between fused_stable and other training stacks.

- ``fused_stable.integrations.hf``: Hugging Face Trainer / TRL (``FusedStableCallback``,
  ``fused_trainer_optimizers``, ``FusedStableTrainerMixin``) and notes for accelerate.
- ``fused_stable.integrations.lightning``: PyTorch Lightning (``FusedStableCallback``,
  ``fp16_mixed_precision``).
- ``fused_stable.integrations.distributed``: the torchrun helpers the trainer uses (process group, DDP /
  FSDP2 wrapping, data sharding), and ``global_sumsq`` / ``validate_params`` from fused_stable.sharding.
- ``fused_stable.integrations.deepspeed``: DeepSpeed ZeRO 0-3 and ZeRO-Offload (``initialize``, ``attach``,
  ``prepare_config``): one fused step per engine step, from the global norm across ranks and groups.

Submodules are imported on demand so that ``import fused_stable`` never pulls in transformers or lightning.
"""

__all__ = ["deepspeed", "distributed", "hf", "lightning"]
