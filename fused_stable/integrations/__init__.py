"""Glue between fused_stable and other training stacks.

- ``fused_stable.integrations.hf``: Hugging Face Trainer / TRL (``FusedStableCallback``,
  ``fused_trainer_optimizers``, ``FusedStableTrainerMixin``) and notes for accelerate.
- ``fused_stable.integrations.lightning``: PyTorch Lightning (``FusedStableCallback``,
  ``fp16_mixed_precision``).
- ``fused_stable.integrations.distributed``: the global gradient norm over DTensor shards (FSDP2, TP)
  that FusedAdamW calls, and the torchrun helpers the trainer uses.

Submodules are imported on demand so that ``import fused_stable`` never pulls in transformers or lightning.
"""

__all__ = ["distributed", "hf", "lightning"]
