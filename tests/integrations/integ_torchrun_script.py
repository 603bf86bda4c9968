"""Launched by test_integ_torchrun.py as `torchrun --standalone --nproc-per-node 2 THIS OUT_DIR TUNER`:
the sequence the trainer follows under torchrun, with the helpers of fused_stable.integrations.distributed."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from integ_models import tiny_llama  # noqa: E402

from fused_stable import FusedAdamW  # noqa: E402
from fused_stable.integrations import distributed as fsd  # noqa: E402


def main(out_dir: str, tuner: str) -> None:
    info = fsd.init_distributed_from_env()
    try:
        torch.manual_seed(0)
        model = tiny_llama()
        if tuner != "full":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        model = fsd.wrap_model(model, tuner)
        opt = FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, max_grad_norm=1.0)
        g = torch.Generator().manual_seed(1)
        rows = fsd.shard_data(torch.randint(0, 64, (16, 8), generator=g))
        losses = []
        for step in range(2):
            batch = torch.stack(rows[step * 2 : step * 2 + 2])
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(fsd.reduce_mean(loss.detach()).item())
        state = fsd.full_model_state_dict(model)  # collective: every rank calls it
        with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
            json.dump(
                {
                    "rank": info.rank,
                    "world_size": info.world_size,
                    "main": fsd.is_main_process(),
                    "wrapped": type(model).__name__,
                    "rows": len(rows),
                },
                f,
            )
        if fsd.is_main_process():
            torch.save(state, os.path.join(out_dir, "model.pt"))
            with open(os.path.join(out_dir, "metrics.json"), "w") as f:
                json.dump({"losses": losses, "grad_norm": opt.grad_norm.item()}, f)
    finally:
        fsd.destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
