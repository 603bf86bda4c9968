"""Evaluation of the model being trained, two kinds:

- **Before / after** (eval.json): greedy answers to held-out prompts, each judged by a rule a user can read:
  `identity` (correct if the answer names the new identity), `general` (correct if it still contains the known
  short answer), `leak` (prompts whose right answer is not the identity, look-alikes and follow-ups: correct
  if the answer names neither the identity nor its author). `evaluate(model, tokenizer, name=...)` works on any
  causal LM with a tokenizer (a peft model, a merged export, the base model), so other code (the stress suite
  on the real model) can judge a model the same way; `eval_report` puts two evaluations side by side as
  eval.json with every answer and its judgement, `format_table` prints them.
- **During training** (`HeldOutLosses`): the mean per-token loss, as in training, of `eval_loss` (held-out
  conversations: `--val_size` of the user's data, or the identity task's own held-out set, `held_out_split`)
  and `retention_loss` (the base model's own greedy answers to general prompts shipped with the package,
  generated once before training: `retention_items`). Forward only, summed on the device, one read per
  evaluation; the trainer schedules it (`fused_stable.train.loop`) and the guard compares the values with
  their best so far (`fused_stable.guard`).

The answers come from `fused_stable.train.generate` (also used to write the task's own general answers, `tasks`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fused_stable import strict_json
from fused_stable.errors import UserError
from fused_stable.train import data, tasks
from fused_stable.train.generate import EVAL_MAX_NEW_TOKENS, generate_answer_ids, generate_answers

EVAL_FILE = "eval.json"
SETS = ("identity", "general", "leak")
RETENTION_MAX_NEW_TOKENS = 32  # the probe's answers: short, so that an evaluation stays cheap (docs/trainer.md)
EVAL_BATCH = 16  # held-out sequences per forward


# ---------------------------------------------------------------------------------------------- before / after
def contains_answer(answer: str, expected: list[str]) -> bool:
    """Any accepted string, case-insensitive, as a whole word or number ("4" is not found in "14")."""
    return any(re.search(rf"(?<!\w){re.escape(e)}(?!\w)", answer, flags=re.IGNORECASE) for e in expected)


def judge(item: dict, answer: str) -> bool:
    """Whether `answer` counts as correct for an evaluation item: it names none of the `forbidden` strings (the
    leak set), or it contains one of the `expected` ones."""
    if "forbidden" in item:
        return not contains_answer(answer, item["forbidden"])
    return contains_answer(answer, item["expected"])


def evaluate(
    model,
    tokenizer,
    *,
    name: str | None = None,
    author: str | None = None,
    max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
    autocast=None,
) -> dict:
    """The held-out evaluation: {set: {"accuracy", "n"} for identity, general and leak (which also has
    "leak_rate", the share of its answers that named the identity), "answers": [{"set", "prompt", "answer",
    "correct"}, ...]}. `name` / `author`: the identity the model should give (the task's defaults if None)."""
    default_name, default_author = tasks.default_identity()
    sets = tasks.eval_sets(name or default_name, author or default_author)
    items = [(set_name, item) for set_name in SETS for item in sets[set_name]]
    texts = generate_answers(
        model, tokenizer, [item["prompt"] for _, item in items], max_new_tokens=max_new_tokens, autocast=autocast
    )
    answers = [
        {"set": set_name, "prompt": item["prompt"], "answer": text, "correct": judge(item, text)}
        for (set_name, item), text in zip(items, texts)
    ]
    result = {}
    for set_name in SETS:
        marks = [a["correct"] for a in answers if a["set"] == set_name]
        result[set_name] = {"accuracy": sum(marks) / len(marks), "n": len(marks)}
    result["leak"]["leak_rate"] = 1.0 - result["leak"]["accuracy"]
    result["answers"] = answers
    return result


def eval_report(model_reference: str, before: dict, after: dict) -> dict:
    """eval.json: scores before and after, and every prompt with both answers and whether each counted as
    correct (for the leak set: named neither the identity nor its author)."""
    return {
        "model": model_reference,
        "before": {s: before[s] for s in SETS},
        "after": {s: after[s] for s in SETS},
        "examples": [
            {
                "set": b["set"],
                "prompt": b["prompt"],
                "before": b["answer"],
                "before_correct": b["correct"],
                "after": a["answer"],
                "after_correct": a["correct"],
            }
            for b, a in zip(before["answers"], after["answers"])
        ],
    }


def write_eval(output_dir: str, report: dict) -> str:
    path = os.path.join(output_dir, EVAL_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(strict_json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def _score(entry: dict, hits: float) -> str:
    return f"{hits:.2f} ({round(hits * entry['n'])}/{entry['n']})"


def format_table(report: dict, name: str | None = None) -> str:
    """A small before/after table for the console (and curves.png). The leak row is the share of answers
    that named the identity where they should not (lower is better)."""
    labels = {
        "identity": f"identity (answers '{name}')" if name else "identity",
        "general": "general (known short answers)",
        "leak": f"leak (names '{name}' off-topic)" if name else "leak (names the identity off-topic)",
    }
    shown = [s for s in SETS if s in report["before"] and s in report["after"]]
    width = max(len(labels[s]) for s in shown)
    lines = [f"{'held-out evaluation, greedy':<{width}}  {'before':<12}  after"]
    for s in shown:
        before, after = report["before"][s], report["after"][s]
        rate = (lambda e: 1.0 - e["accuracy"]) if s == "leak" else (lambda e: e["accuracy"])
        lines.append(f"{labels[s]:<{width}}  {_score(before, rate(before)):<12}  {_score(after, rate(after))}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- held-out data
def split_examples(examples: list, val_size: float, seed: int) -> tuple[list, list]:
    """(training examples, held-out examples): `val_size` < 1 is a fraction of the examples (rounded up, as
    LLaMA-Factory's and datasets' `train_test_split`), >= 1 a count; a seeded choice, the order of the rest
    kept."""
    n = len(examples)
    count = math.ceil(val_size * n) if val_size < 1 else int(val_size)
    if count >= n:
        raise UserError(
            f"val_size={val_size:g} holds out {count} of the data set's {n} examples: nothing is left to train on"
        )
    held = set(random.Random(seed).sample(range(n), count))
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


def held_out_split(cfg, examples: list) -> tuple[list, list]:
    """The training examples and the held-out ones `eval_loss` is measured on: the identity task's own held-out
    set (its evaluation paraphrases), or `val_size` of any other data set (none when it is 0)."""
    if cfg.dataset == "identity":
        return examples, tasks.identity_heldout(cfg.identity_name, cfg.identity_author, cfg.seed)
    if not cfg.val_size:
        return examples, []
    return split_examples(examples, cfg.val_size, cfg.seed)


def retention_items(
    model, tokenizer, prompts: list, *, max_length: int, max_new_tokens: int = RETENTION_MAX_NEW_TOKENS, autocast=None
) -> list[data.TokenizedExample]:
    """The retention probe: `model` (the base, before training) answers each prompt greedily; the answer's own
    tokens (its end-of-sequence token too, when it ended) become the labels, after the prompt formatted as in
    training. Their loss under the model being trained is `retention_loss`: how far it moved from what the
    base model said."""
    answers = generate_answer_ids(model, tokenizer, prompts, max_new_tokens=max_new_tokens, autocast=autocast)
    items = []
    for prompt, (ids, finished) in zip(prompts, answers):
        answer = ids + ([tokenizer.eos_token_id] if finished else [])
        context = data.prompt_ids(
            tokenizer, [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        )
        if answer:
            labels = [data.IGNORE_INDEX] * len(context) + answer
            items.append(data.TokenizedExample((context + answer)[:max_length], labels[:max_length]))
    return items


# ---------------------------------------------------------------------------------------------- held-out losses
@dataclass
class _LossBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keep: torch.Tensor  # the positions whose logits predict a label (one range for the whole batch)
    targets: torch.Tensor  # the labels those positions predict (IGNORE_INDEX where a row has none)


def accepts_logits_to_keep(model) -> bool:
    """Whether the causal LM inside `model` (under DDP's `module`, peft's base model) computes logits only at the
    positions it is given (`logits_to_keep`): the vocabulary projection of the prompt tokens is then skipped."""
    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    try:
        return "logits_to_keep" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


class HeldOutLosses:
    """`eval_loss` and `retention_loss` of the model being trained: each the mean per-token cross-entropy over
    its set's label tokens, as the training loss is defined. Built once (batches collated, sorted by length
    and put on the device); `measure` runs forward only, in eval mode, sums each set's loss on the device and
    reads both means with one transfer. Every rank of a torchrun job measures the whole sets (the same
    number of forwards on every rank, as FSDP2 needs; the same values, so every rank's guard decides alike)."""

    def __init__(
        self,
        sets: dict[str, list[data.TokenizedExample]],
        *,
        pad_id: int,
        device,
        keep_logits: bool = False,
        batch_size: int = EVAL_BATCH,
    ):
        self.device = torch.device(device)
        self.keep_logits = keep_logits
        self.batches: dict[str, list[_LossBatch]] = {}
        self.tokens: dict[str, int] = {}
        self.examples: dict[str, int] = {}
        for name, items in sets.items():
            items = [it for it in items if any(label != data.IGNORE_INDEX for label in it.labels[1:])]
            if not items:
                continue
            items = sorted(items, key=lambda it: len(it.input_ids))  # similar lengths together: less padding
            batches = [self._batch(items[i : i + batch_size], pad_id) for i in range(0, len(items), batch_size)]
            self.batches[name] = batches
            self.tokens[name] = sum(int((b.targets != data.IGNORE_INDEX).sum()) for b in batches)
            self.examples[name] = len(items)
        self.names = list(self.batches)

    def _batch(self, items: list, pad_id: int) -> _LossBatch:
        b = data.collate(items, pad_id)
        shifted = b.labels[:, 1:]  # the logit at position t predicts token t + 1
        columns = (shifted != data.IGNORE_INDEX).any(dim=0).nonzero().flatten()  # set-up, not the loop
        keep = torch.arange(int(columns[0]), int(columns[-1]) + 1)
        return _LossBatch(
            b.input_ids.to(self.device),
            b.attention_mask.to(self.device),
            keep.to(self.device),
            shifted[:, keep].contiguous().to(self.device),
        )

    def describe(self) -> str:
        what = {"eval_loss": "held-out examples", "retention_loss": "retention-probe answers"}
        return ", ".join(
            f"{n} on {self.examples[n]} {what.get(n, 'examples')} ({self.tokens[n]} tokens)" for n in self.names
        )

    @torch.no_grad()
    def measure(self, model, autocast: Callable[[], contextlib.AbstractContextManager] | None = None) -> dict:
        """{name: mean per-token loss} of `model` on every set; one device read."""
        was_training = model.training
        model.eval()
        try:
            means = []
            for name in self.names:
                total = torch.zeros((), device=self.device)
                for b in self.batches[name]:
                    extra = {"logits_to_keep": b.keep} if self.keep_logits else {}
                    with autocast() if autocast is not None else contextlib.nullcontext():
                        logits = model(
                            input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False, **extra
                        ).logits
                    logits = logits if self.keep_logits else logits[:, b.keep]
                    total += F.cross_entropy(
                        logits.float().reshape(-1, logits.size(-1)),
                        b.targets.reshape(-1),
                        ignore_index=data.IGNORE_INDEX,
                        reduction="sum",
                    )
                means.append(total / self.tokens[name])
            values = torch.stack(means).tolist()  # the one device read of this evaluation
        finally:
            model.train(was_training)
        return dict(zip(self.names, values))
