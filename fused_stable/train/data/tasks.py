"""The default task, `identity`: self-cognition fine-tuning (LLaMA-Factory's `identity` data set, ms-swift's
`self-cognition`) mixed with general instructions answered by the base model itself, and its held-out
evaluation sets.

- identity: questions about who the assistant is, answered with a configurable name and author (templates
  with `{name}` / `{author}`, as LLaMA-Factory's identity.json and ms-swift's --model_name / --model_author).
  The evaluation asks paraphrases that are not in the training set.
- general: a few hundred varied instructions whose answers are smollm2-135m's own greedy answers, generated
  once (`python -m fused_stable.train.data.tasks`) and shipped in `assets/`. Training on what the model already
  says anchors it: these examples cost almost no loss at the start and pull back any drift the identity
  part causes elsewhere (self-distillation against forgetting). The evaluation asks other questions with a
  known short answer (capitals, arithmetic, common facts).
- leak: prompts whose right answer is not the identity (look-alikes such as "Who made the iPhone?", a
  follow-up such as "And what about Germany?" after a capital question): an answer that names the identity
  leaked it.
- the task's held-out set for `eval_loss` (`identity_heldout`): the identity evaluation paraphrases with an
  answer template each, so the loss is measured on questions the model was not trained on.
- the retention probe's prompts (`retention_prompts`): general questions, in none of the sets above, that the
  base model answers before training (`fused_stable.train.evaluation.held_out.retention_items`).

Everything lives in `fused_stable/train/data/assets/` (package data): `identity_task.json` and
`retention_prompts.json` are hand-written, `general_answers.json` is generated.
"""

from __future__ import annotations

import json
import os
import random
from functools import cache

from fused_stable.train.data.rows import Example, conversation

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
TASK_FILE = os.path.join(ASSETS, "identity_task.json")
GENERAL_ANSWERS_FILE = os.path.join(ASSETS, "general_answers.json")
RETENTION_FILE = os.path.join(ASSETS, "retention_prompts.json")
ANSWER_MODEL = "smollm2-135m"  # the model whose answers general_answers.json holds
ANSWER_MAX_NEW_TOKENS = 96  # generation budget of those answers


@cache
def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def task_spec() -> dict:
    return _load(TASK_FILE)


def default_identity() -> tuple[str, str]:
    spec = task_spec()["identity"]
    return spec["name"], spec["author"]


def general_answers() -> list[dict]:
    """[{"question", "answer"}]: the base model's own greedy answers to the general training questions."""
    return _load(GENERAL_ANSWERS_FILE)["examples"]


def identity_examples(name: str, author: str, seed: int, general: int | None = None) -> list[Example]:
    """The training mix: every identity training question once, with an answer template drawn per question,
    plus `general` of the general questions (all if None; a seeded choice otherwise) with the base model's
    answers; shuffled by the batch order later."""
    spec = task_spec()["identity"]
    rng = random.Random(seed)
    examples = [
        conversation(q, rng.choice(spec["answers"]).format(name=name, author=author)) for q in spec["train_questions"]
    ]
    rows = general_answers()
    if general is not None and general < len(rows):
        rows = rng.sample(rows, general)
    examples += [conversation(row["question"], row["answer"]) for row in rows]
    return examples


def identity_heldout(name: str, author: str, seed: int) -> list[Example]:
    """The identity task's own held-out set (what `eval_loss` measures on it): every evaluation paraphrase,
    none of them trained on, answered with an answer template drawn per question (seeded)."""
    spec = task_spec()["identity"]
    rng = random.Random(seed)
    return [
        conversation(q, rng.choice(spec["answers"]).format(name=name, author=author)) for q in spec["eval_questions"]
    ]


def retention_prompts() -> list[str]:
    """The retention probe's general prompts (assets/retention_prompts.json)."""
    return list(_load(RETENTION_FILE)["prompts"])


def eval_sets(name: str, author: str | None = None) -> dict[str, list[dict]]:
    """Held-out prompts by set: {"identity": [{"prompt", "expected": [name]}], "general": [{"prompt",
    "expected": [accepted answers]}], "leak": [{"prompt", "forbidden": [name, author]}]}. A prompt is a
    string (one user turn) or a list of messages (a follow-up question); none of them is in the training mix.
    `author`: the identity's author (the task's default if None), which a leaking answer may name instead."""
    spec = task_spec()
    forbidden = [name, author or default_identity()[1]]
    return {
        "identity": [{"prompt": q, "expected": [name]} for q in spec["identity"]["eval_questions"]],
        "general": [{"prompt": row["question"], "expected": row["answers"]} for row in spec["general"]["eval"]],
        "leak": [{"prompt": p, "forbidden": forbidden} for p in spec["leak"]["prompts"]],
    }


# ---------------------------------------------------------------------------------------------- regeneration
def regenerate_general_answers(model="smollm2-135m", output=GENERAL_ANSWERS_FILE, batch_size: int = 16) -> None:
    """Write general_answers.json: the base model's greedy answer (chat template, no system prompt beyond the
    template's default) to each general training question. An answer still going after
    ANSWER_MAX_NEW_TOKENS is cut after its last full sentence, so every trained answer ends cleanly."""
    import torch

    from fused_stable.train.evaluation.generate import generate_answers
    from fused_stable.train.model.load import load_pretrained
    from fused_stable.train.model.sources import resolve_model

    source = resolve_model(model)
    net, tokenizer = load_pretrained(source, dtype=torch.float32)
    questions = task_spec()["general"]["train_questions"]
    answers = generate_answers(
        net, tokenizer, questions, max_new_tokens=ANSWER_MAX_NEW_TOKENS, batch_size=batch_size, return_finished=True
    )
    rows = []
    for question, (answer, finished) in zip(questions, answers):
        if not finished:
            cut = max(answer.rfind(". "), answer.rfind(".\n"))
            answer = answer[: cut + 1] if cut > 0 else answer
        rows.append({"question": question, "answer": answer.strip()})
    with open(output, "w", encoding="utf-8") as f:
        json.dump(
            {
                "model": source.reference,
                "max_new_tokens": ANSWER_MAX_NEW_TOKENS,
                "decoding": "greedy",
                "examples": rows,
            },
            f,
            indent=1,
            ensure_ascii=False,
        )
        f.write("\n")


if __name__ == "__main__":
    regenerate_general_answers()
