"""Greedy, batched answers of a causal LM to chat prompts, formatted as in training: what the held-out
evaluation scores (`evaluate`), what the retention probe asks the base model before training (its answers as
token ids, `evaluate.retention_items`), and what the identity task's general answers were generated with
(`tasks`)."""

from __future__ import annotations

import contextlib

import torch

from fused_stable.train.data import instructions

EVAL_MAX_NEW_TOKENS = 32  # enough for a name or a short fact: the answers the evaluation scores give them early


def as_messages(prompt) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


@torch.no_grad()
def generate_answer_ids(
    model, tokenizer, prompts, *, max_new_tokens: int = EVAL_MAX_NEW_TOKENS, batch_size: int = 64, autocast=None
) -> list[tuple[list[int], bool]]:
    """Greedy answers to `prompts` (strings, or message lists) as token ids, formatted as in training, batched
    with left padding: (the answer's ids without its end-of-sequence token, whether it ended with one)."""
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    was_training = model.training
    model.eval()
    results = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [instructions.prompt_ids(tokenizer, as_messages(p)) for p in prompts[start : start + batch_size]]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, ids in enumerate(chunk):
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                attention_mask[row, width - len(ids) :] = 1
            with autocast if autocast is not None else contextlib.nullcontext():
                out = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=pad,
                    use_cache=True,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                )
            for row in out[:, width:].tolist():
                finished = eos in row
                results.append((row[: row.index(eos)] if finished else row, finished))
    finally:
        model.train(was_training)
    return results


def generate_answers(
    model,
    tokenizer,
    prompts,
    *,
    max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
    batch_size: int = 64,
    autocast=None,
    return_finished: bool = False,
) -> list:
    """Greedy answers to `prompts` (strings, or message lists), formatted as in training, batched with left
    padding. Returns the answer texts (with `return_finished`, (text, ended with end-of-sequence) pairs)."""
    answers = generate_answer_ids(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, autocast=autocast
    )
    texts = [(tokenizer.decode(ids, skip_special_tokens=True).strip(), finished) for ids, finished in answers]
    return texts if return_finished else [text for text, _ in texts]
