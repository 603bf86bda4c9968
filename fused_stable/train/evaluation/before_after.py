"""The before / after evaluation (eval.json): greedy answers to held-out prompts, each judged by a rule a user can read:
  `identity` (correct if the answer names the new identity), `general` (correct if it still contains the known
  short answer), `leak` (prompts whose right answer is not the identity, look-alikes and follow-ups: correct
  if the answer names neither the identity nor its author). `evaluate(model, tokenizer, name=...)` works on any
  causal LM with a tokenizer (a peft model, a merged export, the base model), so other code (the stress suite
  on the real model) can judge a model the same way; `eval_report` puts two evaluations side by side as
  eval.json with every answer and its judgement, `format_table` prints them. The losses measured during
  training are `held_out`'s.

The answers come from `generate` (also used to write the task's own general answers, `tasks`).
"""

from __future__ import annotations

import os
import re

from fused_stable import strict_json
from fused_stable.train.data import tasks
from fused_stable.train.data.rows import with_system
from fused_stable.train.evaluation.generate import EVAL_MAX_NEW_TOKENS, as_messages, generate_answers

EVAL_FILE = "eval.json"
SETS = ("identity", "general", "leak")


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
    system: str | None = None,
) -> dict:
    """The held-out evaluation: {set: {"accuracy", "n"} for identity, general and leak (which also has
    "leak_rate", the share of its answers that named the identity), "answers": [{"set", "prompt", "answer",
    "correct"}, ...]}. `name` / `author`: the identity the model should give (the task's defaults if None);
    `system`: the run's system message (`--system`), asked with every prompt as chat asks with it."""
    default_name, default_author = tasks.default_identity()
    sets = tasks.eval_sets(name or default_name, author or default_author)
    items = [(set_name, item) for set_name in SETS for item in sets[set_name]]
    prompts = [with_system(as_messages(item["prompt"]), system) for _, item in items]
    texts = generate_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, autocast=autocast)
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
