"""The update rules' step against their references, one process, contenders taking turns (issue 35 item 7).

Rows: the `fused-stable bench --plan cpu` dense set (a Llama-style model, hidden 768, 2 layers, vocab 8192) and
LoRA set (448 adapter matrices), or the `gpu` plan's on CUDA, each with:
  - lion: `FusedLion(max_grad_norm=1.0).step()` against `clip_grad_norm_(foreach=True)` + lion-pytorch's `Lion`
    (the reference bitsandbytes tests its Lion against);
  - sgd: `FusedSGD(momentum=0.9, max_grad_norm=1.0).step()` against `clip_grad_norm_(foreach=True)` +
    `torch.optim.SGD(momentum=0.9, foreach=True)`;
  - muon: `FusedMuon(max_grad_norm=1.0).step()` against `clip_grad_norm_(foreach=True)` + `torch.optim.Muon` on
    the Muon params + `torch.optim.AdamW(fused=True)` on the rest. The split is muon_param_groups' rule on the
    bare shapes: 2-D tensors but the embedding and the head to Muon (the LoRA set: every adapter matrix).
Same hyper-parameters on both sides (Lion lr 1e-4, weight decay 0.1; Muon torch's defaults; AdamW lr 1e-3);
grads persistent between steps (norm 5: the clip is active every step). Each row gives both medians and the
fused / reference ratio of the same run.

    python benchmarks/rules_step.py --plan cpu --threads 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from fused_stable import FusedAdafactor, FusedLion, FusedMuon, FusedSGD
from fused_stable.bench import measure
from fused_stable.bench.paramsets import materialize, plan_sets
from fused_stable.bench.report import cpu_name

_CHOICE_ENVIRONMENT = ("ONEDNN_MAX_CPU_ISA", "FUSED_STABLE_NEWTON_SCHULZ", "FUSED_STABLE_NEWTON_SCHULZ_BLOCKS")


def _muon_split(params: list[torch.Tensor], family: str) -> tuple[list, list]:
    """Muon: the 2-D params but the embedding and the head (the dense set's two vocab-sized matrices, its
    largest); the rest AdamW. The LoRA set: every adapter matrix to Muon."""
    two_d = [p for p in params if p.dim() == 2]
    if family == "dense":
        vocab_sized = sorted(two_d, key=lambda p: p.numel())[-2:]
        two_d = [p for p in two_d if all(p is not q for q in vocab_sized)]
    rest = [p for p in params if all(p is not q for q in two_d)]
    return two_d, rest


def _contenders(rule: str, spec, device: torch.device) -> dict | None:
    """name -> step function, each over its own copy of the set (the same seed); None without the reference."""
    try:
        from lion_pytorch import Lion
    except ImportError:  # the GPU image has no lion-pytorch unless its wheel is carried (docs/benchmarks.md)
        if rule == "lion":
            return None

    def fresh():
        return materialize(spec, device)

    if rule == "lion":
        ours, theirs = fresh(), fresh()
        fused = FusedLion(ours, lr=1e-4, weight_decay=0.1, max_grad_norm=1.0)
        reference = Lion(theirs, lr=1e-4, weight_decay=0.1)

        def reference_step():
            torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=True)
            reference.step()

        return {"fused_stable_lion": fused.step, "lion_pytorch_clip": reference_step}
    if rule == "sgd":  # momentum 0.9: one buffer, the row; torch's fastest CPU path for SGD is foreach
        ours, theirs = fresh(), fresh()
        fused = FusedSGD(ours, lr=1e-2, momentum=0.9, max_grad_norm=1.0)
        reference = torch.optim.SGD(theirs, lr=1e-2, momentum=0.9, foreach=True)

        def reference_step():
            torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=True)
            reference.step()

        return {"fused_stable_sgd": fused.step, "torch_sgd_foreach_clip": reference_step}
    if rule == "adafactor":
        ours, theirs = fresh(), fresh()
        fused = FusedAdafactor(ours, max_grad_norm=1.0)
        reference = torch.optim.Adafactor(theirs, foreach=True)

        def reference_step():
            torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=True)
            reference.step()

        return {"fused_stable_adafactor": fused.step, "torch_adafactor_foreach_clip": reference_step}
    ours, theirs = fresh(), fresh()
    muon, rest = _muon_split(ours, spec.family)
    groups = [{"params": muon, "use_muon": True}, {"params": rest, "use_muon": False}]
    fused = FusedMuon([g for g in groups if g["params"]], max_grad_norm=1.0)
    muon_ref, rest_ref = _muon_split(theirs, spec.family)
    torch_muon = torch.optim.Muon(muon_ref)
    torch_adamw = torch.optim.AdamW(rest_ref, fused=True) if rest_ref else None

    def reference_step():
        torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=True)
        torch_muon.step()
        if torch_adamw is not None:
            torch_adamw.step()

    return {"fused_stable_muon": fused.step, "torch_muon_adamw_clip": reference_step}


def run(plan: str, rules: list[str], device: torch.device, budget_s: float) -> list[dict]:
    rows = []
    for spec in plan_sets(plan):
        if spec.name not in ("dense-fp32", "lora-fp32"):
            continue
        for rule in rules:
            contenders = _contenders(rule, spec, device)
            if contenders is None:
                print(json.dumps({"set": spec.name, "rule": rule, "skipped": "lion-pytorch is not installed"}))
                continue
            timings = measure.time_steps(
                [[fn] for fn in contenders.values()],
                device,
                warmup=2,
                min_steps=5,
                min_time=budget_s,
                max_steps=50,
                max_time=4 * budget_s,
            )
            medians = {name: t["median_s"] for name, t in zip(contenders, timings)}
            fused_name, reference_name = list(contenders)
            row = {"set": spec.name, "params": spec.n_params, "tensors": len(spec.shapes), "rule": rule}
            row.update({f"{name}_ms": 1e3 * s for name, s in medians.items()})
            row["ratio"] = medians[fused_name] / medians[reference_name]
            row["steps"] = timings[0]["steps"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del contenders
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="cpu", choices=["cpu", "gpu", "smoke"])
    parser.add_argument("--rules", default="lion,muon")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timed steps per row (at least)")
    parser.add_argument("--out", default=None, help="a folder for rules-step-<time>.json / .md")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.plan == "gpu" else "cpu")
    torch.set_num_threads(args.threads)
    rows = run(args.plan, args.rules.split(","), device, args.budget)
    meta = {
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        # what chose Newton-Schulz's dtype and products: a cap on oneDNN stands in for a CPU without AMX
        "environment": {name: os.environ[name] for name in _CHOICE_ENVIRONMENT if name in os.environ},
    }
    if args.out:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%MZ")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = Path(args.out) / f"rules-step-{stamp}"
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = [f"# Update rules' step, {meta['device']}, {meta['threads']} threads, {meta['when']}", ""]
        lines += [f"Environment: {meta['environment']}", ""] if meta["environment"] else []
        lines += ["| set | rule | fused ms | reference ms | ratio |", "|---|---|---|---|---|"]
        for row in rows:
            fused_ms, reference_ms = [v for k, v in row.items() if k.endswith("_ms")]
            lines.append(
                f"| {row['set']} | {row['rule']} | {fused_ms:.1f} | {reference_ms:.1f} | {row['ratio']:.2f}x |"
            )
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print(f"wrote {out}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
