"""Neat packing (`--neat_packing`) under the engines `fused-stable sft` runs on: torchrun DDP (LoRA), torchrun FSDP2
(full fine-tuning) and DeepSpeed ZeRO-2, each on 2 gloo ranks. Each rank trains on its own shard of the packed
rows, and the step-1 loss and grad norm are those of the same rows computed in one process (each rank's packed
window, with its positions and block-diagonal mask, and the rank-averaged gradient): the packed inputs reach the
model through DDP's, FSDP2's and DeepSpeed's wrappers unchanged."""

import pytest
import torch
import torch.nn.functional as F
from sft_helpers import read_metrics, setup_run
from test_deepspeed_sft import launch
from test_torchrun import RUN

from fused_stable.integrations.distributed import shard_data
from fused_stable.train.data import packing
from fused_stable.train.data.instructions import IGNORE_INDEX, BatchOrder

# no LoRA dropout: the one-process reference runs in eval mode, and dropout moves the B grads of step 1
PACKED = [*RUN, "--neat_packing", "--max_length", "256", "--lora_dropout", "0"]


def packed_first_step(tmp_path, *argv):
    """Step 1 of a 2-rank packed run in this process: each rank's loss on its shard of the packed rows, and the
    norm of the rank-averaged gradient (what DDP, FSDP2 and ZeRO give the optimizer); eval mode as in
    test_torchrun.first_step_reference (no dropout in the tiny Llama; LoRA's B starts at zero)."""
    setup = setup_run(*argv, "--output_dir", tmp_path / "reference")
    model, cfg, batches, attention = setup.model, setup.cfg, setup.trainer.batches, setup.trainer.attention
    assert attention is not None and attention.neat
    model.eval()
    losses, grads = [], []
    params = [p for p in model.parameters() if p.requires_grad]
    for rank in range(2):
        rows = shard_data(batches.items, rank, 2)
        order = BatchOrder(rows, cfg.batch_size, cfg.seed, batches.pad_id, batches.collate_rows)
        window = [order.batch(i) for i in range(cfg.grad_accum)]
        total = 0.0
        for batch in window:
            logits = model(**packing.model_inputs(batch, torch.device("cpu"), attention)).logits
            total = total + F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.size(-1)),
                batch.labels[:, 1:].reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        loss = total / sum(b.num_label_tokens for b in window)
        grads.append(torch.autograd.grad(loss, params))
        losses.append(float(loss.detach()))
    mean = [(a + b) / 2 for a, b in zip(*grads)]
    return losses, float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in mean])))


@pytest.mark.slow  # three 2-rank launches, ~1-2 min on 2 cores
@pytest.mark.parametrize(
    "engine, extra",
    [("ddp", []), ("fsdp2", ["--tuner", "full", "--lr", "1e-3"]), ("zero2", ["--zero_stage", "2"])],
)
def test_neat_packing_under_each_engine_on_two_ranks(tmp_path, engine, extra):
    out = tmp_path / "run"
    proc = launch("torchrun", *PACKED, *extra, "--output_dir", out)
    assert proc.stdout.count("packing: ") == 1 and "(attention confined to each example)" in proc.stdout
    assert proc.stdout.count("done: steps 0->4") == 1
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer
    per_rank, grad_norm = packed_first_step(tmp_path, *PACKED, *extra)
    assert rows[0]["loss"] == pytest.approx(sum(per_rank) / 2, rel=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert rows[-1]["loss"] < rows[0]["loss"] and not any(r["skipped"] for r in rows)
