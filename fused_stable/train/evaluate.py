"""Before/after evaluation of the identity task: greedy answers to held-out prompts, scored by whether they
contain an expected string (the new name for `identity`; the known short answer for `general`).

`evaluate(model, tokenizer, name=...)` works on any causal LM with a tokenizer (a peft model, a merged export,
the base model), so other code (the stress suite on the real model) can judge a model the same way;
`eval_report` puts two evaluations side by side as eval.json, `format_table` prints them. The answers come
from `fused_stable.train.generate` (also used to write the task's own general answers, `tasks`).
"""

from __future__ import annotations

import os
import re

from fused_stable import strict_json
from fused_stable.train import tasks
from fused_stable.train.generate import EVAL_MAX_NEW_TOKENS, generate_answers

EVAL_FILE = "eval.json"
SETS = ("identity", "general")


def contains_answer(answer: str, expected: list[str]) -> bool:
    """Any accepted string, case-insensitive, as a whole word or number ("4" is not found in "14")."""
    return any(re.search(rf"(?<!\w){re.escape(e)}(?!\w)", answer, flags=re.IGNORECASE) for e in expected)


def evaluate(
    model, tokenizer, *, name: str | None = None, max_new_tokens: int = EVAL_MAX_NEW_TOKENS, autocast=None
) -> dict:
    """The held-out evaluation: {"identity": {"accuracy", "n"}, "general": {"accuracy", "n"}, "answers":
    [{"set", "prompt", "answer", "correct"}, ...]}. `name`: the identity the model should give (the task's
    default name if None)."""
    name = name or tasks.default_identity()[0]
    sets = tasks.eval_sets(name)
    items = [(set_name, item) for set_name in SETS for item in sets[set_name]]
    texts = generate_answers(
        model, tokenizer, [item["prompt"] for _, item in items], max_new_tokens=max_new_tokens, autocast=autocast
    )
    answers = [
        {"set": set_name, "prompt": item["prompt"], "answer": text, "correct": contains_answer(text, item["expected"])}
        for (set_name, item), text in zip(items, texts)
    ]
    result = {}
    for set_name in SETS:
        marks = [a["correct"] for a in answers if a["set"] == set_name]
        result[set_name] = {"accuracy": sum(marks) / len(marks), "n": len(marks)}
    result["answers"] = answers
    return result


def eval_report(model_reference: str, before: dict, after: dict) -> dict:
    """eval.json: scores before and after, and every prompt with both answers."""
    return {
        "model": model_reference,
        "before": {s: before[s] for s in SETS},
        "after": {s: after[s] for s in SETS},
        "examples": [
            {"set": b["set"], "prompt": b["prompt"], "before": b["answer"], "after": a["answer"]}
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


def _score(entry: dict) -> str:
    return f"{entry['accuracy']:.2f} ({round(entry['accuracy'] * entry['n'])}/{entry['n']})"


def format_table(report: dict, name: str | None = None) -> str:
    """A small before/after table for the console (and curves.png)."""
    labels = {
        "identity": f"identity (answers '{name}')" if name else "identity",
        "general": "general (known short answers)",
    }
    width = max(len(v) for v in labels.values())
    lines = [f"{'held-out evaluation, greedy':<{width}}  {'before':<12}  after"]
    for s in SETS:
        lines.append(f"{labels[s]:<{width}}  {_score(report['before'][s]):<12}  {_score(report['after'][s])}")
    return "\n".join(lines)
