"""Launched by test_integ_hf_deepspeed.py under torchrun (2 gloo ranks): the HF Trainer with FusedAdamW through
FusedStableTrainerMixin, with `TrainingArguments(deepspeed=...)` (MODE deepspeed, ZeRO stage STAGE) or without
DeepSpeed (MODE ddp); rank 0 writes what the test compares to OUT (torch.save).

    torchrun --nproc-per-node 2 integ_hf_deepspeed_script.py MODE STAGE OUT
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from fused_stable.integrations.hf import FusedStableTrainerMixin, find_fused_optimizer

STEPS = 4


class FusedTrainer(FusedStableTrainerMixin, Trainer):
    pass


def main(mode: str, stage: int, out: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16), generator=g)]
    ds_config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        # ZeRO-3: partition every parameter (by default those under 1e5 elements, all of these, stay whole)
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
    }
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        max_grad_norm=0.5,  # every step clips (the norms are ~2)
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        deepspeed=ds_config if mode == "deepspeed" else None,
    )
    trainer = FusedTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    fused = find_fused_optimizer(trainer.optimizer)
    result = {
        "log": [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h],
        "applied": int(fused.applied_steps),
        "global_step": trainer.state.global_step,
    }
    if mode == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        engine = trainer.deepspeed
        result.update(
            attached=hasattr(engine, "fused_stable_step"),
            engine_steps=engine.fused_stable_step.engine_steps,
            gradient_clipping=engine.gradient_clipping(),
            stage=engine.zero_optimization_stage(),
            params=[safe_get_full_fp32_param(p).detach().clone() for p in model.parameters()],
        )
    else:
        result["params"] = [p.detach().clone() for p in trainer.model.parameters()]
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
