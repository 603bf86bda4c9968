"""Instruction data for supervised fine-tuning: local alpaca/sharegpt files, the generated arithmetic task,
rendering with the model's own chat template, tokenisation with the prompt masked out of the loss, and a
deterministic, resumable batch order.

Every example is a conversation (`messages`, as `tokenizer.apply_chat_template` takes them); the assistant
turns are what the model learns. A tokenizer with a chat template (SmolLM2's ChatML, Llama's, ...) formats
training, evaluation and chat the same way, as LLaMA-Factory's `template` and ms-swift's `template_type` do;
a tokenizer without one (the tiny model's byte tokenizer) gets a plain `### Instruction:` / `### Response:`
format. Only assistant text carries labels; everything else (prompt, padding) is -100, which the loss ignores.
"""

from __future__ import annotations

import json
import math
import os
import random
import string
from dataclasses import dataclass

import torch

from fused_stable.errors import UserError

IGNORE_INDEX = -100
# the plain format, for tokenizers without a chat template: role -> text before the content
PLAIN_HEADERS = {"system": "### System:\n", "user": "### Instruction:\n", "assistant": ""}
PLAIN_RESPONSE = "### Response:\n"
# ShareGPT speaker names (and the OpenAI-style roles some exports use) -> chat role
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass
class Example:
    messages: list[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]

    @property
    def answers(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "assistant"]


def conversation(question: str, answer: str) -> Example:
    return Example([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])


# ---------------------------------------------------------------------------------------------- file formats
def _alpaca_example(record: dict, where: str) -> Example:
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            raise UserError(f"{where}: alpaca record needs a string {key!r}")
    extra = record.get("input", "")
    if not isinstance(extra, str):
        raise UserError(f"{where}: alpaca 'input' must be a string")
    # LLaMA-Factory's alpaca converter: the input follows the instruction in the same user turn
    question = f"{record['instruction']}\n\n{extra}" if extra.strip() else record["instruction"]
    return conversation(question, record["output"])


def _sharegpt_example(record: dict, where: str) -> Example:
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: 'conversations' must be a non-empty list of turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise UserError(f"{where}: each turn in 'conversations' must be an object")
        speaker = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if speaker not in SHAREGPT_ROLES or not isinstance(text, str):
            raise UserError(
                f"{where}: each turn needs 'from' in {sorted(SHAREGPT_ROLES)} and a string 'value' (got {turn!r:.80})"
            )
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no 'gpt'/'assistant' turn to learn from")
    return Example(messages)


def _record_to_example(record, where: str) -> Example:
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        return _sharegpt_example(record, where)
    if "instruction" in record or "output" in record:
        return _alpaca_example(record, where)
    raise UserError(
        f"{where}: unknown record format (keys {sorted(record)[:6]}); expected alpaca "
        "'instruction'/'input'/'output' or sharegpt 'conversations'"
    )


def _json_array_records(path: str, text: str):
    """Yield (line, record) for each element of a top-level JSON array, so errors can name the line."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text[pos : pos + 1] == "[":
        raise UserError(f"{path}:1: a .json dataset must be a JSON array of records (use .jsonl for one per line)")
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            raise UserError(f"{path}:{text.count(chr(10)) + 1}: unterminated JSON array")
        if text[pos] == "]":
            return
        line = text.count("\n", 0, pos) + 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
        yield line, record


def load_examples(path: str) -> list[Example]:
    """Read a local alpaca or sharegpt dataset (.jsonl: one record per line; .json: an array of records)."""
    if not os.path.isfile(path):
        raise UserError(f"dataset file {path!r} not found (give a local .json/.jsonl file or 'builtin')")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    examples: list[Example] = []
    if path.endswith(".jsonl"):
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{line_no}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            examples.append(_record_to_example(record, f"{path}:{line_no}"))
    else:
        for line_no, record in _json_array_records(path, text):
            examples.append(_record_to_example(record, f"{path}:{line_no}"))
    if not examples:
        raise UserError(f"{path}: the dataset has no records")
    return examples


# ---------------------------------------------------------------------------------------------- built-in task
def _random_word(rng: random.Random, lo: int = 3, hi: int = 7) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def builtin_examples(n: int, seed: int) -> list[Example]:
    """The `arithmetic` task: generated instructions a tiny model can visibly learn (arithmetic and string
    manipulation).

    The answers are short and follow from the input, so the loss first falls as the model learns the
    answer format and alphabet, then keeps falling as it learns to copy, reverse and add.
    """
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        kind = rng.randrange(5)
        if kind == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            record = {"instruction": "Add.", "input": f"{a} + {b}", "output": str(a + b)}
        elif kind == 1:
            word = _random_word(rng)
            record = {"instruction": "Reverse.", "input": word, "output": word[::-1]}
        elif kind == 2:
            word = _random_word(rng)
            record = {"instruction": "Uppercase.", "input": word, "output": word.upper()}
        elif kind == 3:
            word = _random_word(rng)
            record = {"instruction": "Repeat twice.", "input": word, "output": f"{word} {word}"}
        else:
            word = _random_word(rng)
            record = {"instruction": "Sort the letters.", "input": word, "output": "".join(sorted(word))}
        examples.append(_alpaca_example(record, "builtin"))
    return examples


# ---------------------------------------------------------------------------------------------- rendering
def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _chat_text(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _plain_text(messages: list[dict], generation_prompt: bool) -> str:
    parts = []
    for m in messages:
        if m["role"] == "assistant":
            # a past answer under its header, as it was trained; its end-of-sequence id goes in as an id, see render
            parts.append(PLAIN_RESPONSE + m["content"] + "\n\n")
        else:
            parts.append(PLAIN_HEADERS[m["role"]] + m["content"] + "\n\n")
    if generation_prompt:
        parts.append(PLAIN_RESPONSE)
    return "".join(parts)


def render(example: Example, tokenizer) -> list[tuple[str, bool]]:
    """The conversation as (text, trained) segments, formatted as the model will see it at chat time.

    With a chat template, each assistant turn is the text the template adds after the generation prompt
    (for ChatML: `content<|im_end|>\n`), so the model also learns to end its turn. Plain format: a trained
    segment is the bare content; `tokenize_examples` appends the end-of-sequence id after it.
    """
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(example.messages):
        if message["role"] != "assistant":
            continue
        if has_chat_template(tokenizer):
            prompt = _chat_text(tokenizer, example.messages[:i], generation_prompt=True)
            full = _chat_text(tokenizer, example.messages[: i + 1], generation_prompt=False)
        else:
            prompt = _plain_text(example.messages[:i], generation_prompt=True)
            full = prompt + message["content"]
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise UserError(
                "the tokenizer's chat template does not render a conversation turn by turn, so answers "
                "cannot be separated from prompts; give a tokenizer with an incremental template"
            )
        segments += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full if has_chat_template(tokenizer) else full + "\n\n"
    return segments


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids that ask the model for the next assistant turn: what evaluation and chat feed `generate`,
    formatted exactly as in training."""
    if has_chat_template(tokenizer):
        text = _chat_text(tokenizer, messages, generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.bos_token_id] + tokenizer(_plain_text(messages, True), add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------- tokenisation
@dataclass
class TokenizedExample:
    input_ids: list[int]
    labels: list[int]


def tokenize_examples(examples: list[Example], tokenizer, max_length: int) -> list[TokenizedExample]:
    """Rendered segments to ids; untrained text gets IGNORE_INDEX labels. The plain format starts with <s>
    and ends each answer with </s>; a chat template writes its own special tokens."""
    templated = has_chat_template(tokenizer)
    out = []
    for example in examples:
        ids = [] if templated else [tokenizer.bos_token_id]
        labels = [IGNORE_INDEX] * len(ids)
        for text, trained in render(example, tokenizer):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            if trained and not templated:
                piece = piece + [tokenizer.eos_token_id]  # learn to stop after each answer
            ids += piece
            labels += piece if trained else [IGNORE_INDEX] * len(piece)
        out.append(TokenizedExample(ids[:max_length], labels[:max_length]))
    return out


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    num_tokens: int  # non-padding tokens (host int: throughput without a device read)
    num_label_tokens: int  # tokens that count in the loss after the causal shift


def collate(items: list[TokenizedExample], pad_id: int) -> Batch:
    """Right-pad to the longest item; padding is masked out of attention and loss."""
    width = max(len(item.input_ids) for item in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item.input_ids)
        input_ids[row, :n] = torch.tensor(item.input_ids)
        labels[row, :n] = torch.tensor(item.labels)
        attention_mask[row, :n] = 1
    num_label_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return Batch(input_ids, attention_mask, labels, int(attention_mask.sum()), num_label_tokens)


class BatchOrder:
    """Micro-batch k of the whole run is a pure function of (seed, k): epoch k // per_epoch is a fresh
    permutation seeded by (seed, epoch). The data position in a checkpoint is just k, so resume is exact."""

    def __init__(self, items: list[TokenizedExample], batch_size: int, seed: int, pad_id: int):
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.batches_per_epoch = math.ceil(len(items) / batch_size)
        self._epoch = -1
        self._perm: list[int] = []

    def batch(self, k: int) -> Batch:
        epoch, pos = divmod(k, self.batches_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(len(self.items), generator=generator).tolist()
            self._epoch = epoch
        idx = self._perm[pos * self.batch_size : (pos + 1) * self.batch_size]
        return collate([self.items[i] for i in idx], self.pad_id)
