"""Instruction data for supervised fine-tuning: local alpaca/sharegpt/messages files, the generated arithmetic task,
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
from fused_stable.train.data.rows import Example, alpaca_example, has_empty_answer, parse_row

IGNORE_INDEX = -100
BUILTIN_DATASETS = ("identity", "arithmetic")  # `--dataset` names that are no file (cli's _task_examples)
# the plain format, for tokenizers without a chat template: role -> text before the content
PLAIN_HEADERS = {"system": "### System:\n", "user": "### Instruction:\n", "assistant": ""}
PLAIN_RESPONSE = "### Response:\n"
# ---------------------------------------------------------------------------------------------- files
_UTF8_BOM = b"\xef\xbb\xbf"


def _not_utf8(path: str, raw: bytes, exc: UnicodeDecodeError, offset: int = 0) -> UserError:
    """`file:line: ...` for invalid UTF-8 at byte exc.start of `raw` (which starts at byte `offset` of the file)."""
    start = offset + exc.start
    line_start = raw.rfind(b"\n", 0, exc.start) + 1
    line = raw.count(b"\n", 0, exc.start) + 1
    return UserError(
        f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start - line_start + 1}, "
        f"byte {start} of the file): save the file as UTF-8"
    )


def _jsonl_rows(path: str, raw: bytes):
    """Yield ("file:line", record) for each non-blank line of a .jsonl file."""
    for number, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(
                f"{path}:{number}: not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1}): "
                "save the file as UTF-8"
            ) from None
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise UserError(f"{path}:{number}: invalid JSON (nested too deeply)") from None
        yield f"{path}:{number}", record


def _json_array_rows(path: str, text: str):
    """Yield ("file:line", record) for each element of a top-level JSON array, so errors can name the line."""
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
        except RecursionError:
            raise UserError(f"{path}:{line}: invalid JSON (nested too deeply)") from None
        yield f"{path}:{line}", record


def _rows(path: str):
    """("file:line", record) for every record of a .jsonl or .json dataset file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise UserError(f"dataset file {path!r} cannot be read ({exc.strerror})") from None
    offset = len(_UTF8_BOM) if raw.startswith(_UTF8_BOM) else 0  # a byte-order mark some editors write
    raw = raw[offset:]
    if not raw.strip():
        raise UserError(f"{path}: the file is empty (no records)")
    if path.endswith(".jsonl"):
        yield from _jsonl_rows(path, raw)
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, raw, exc, offset) from None
    yield from _json_array_rows(path, text)


def load_examples(path: str, log=None) -> list[Example]:
    """Read a local alpaca or sharegpt dataset (.jsonl: one record per line; .json: an array of records).

    A malformed record is one UserError naming the file and line (invalid UTF-8, not JSON, not an object, a
    missing key, a value of the wrong type); blank lines are ignored; a record with an empty answer is skipped
    and counted (one note through `log`); no record left is an error."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith((".json", ".jsonl")))[:5]
        found = f" (it holds {', '.join(files)})" if files else ""
        raise UserError(f"dataset {path!r} is a directory; give one .json/.jsonl file{found}")
    if not os.path.isfile(path):
        raise UserError(
            f"dataset file {path!r} not found: give a local .json/.jsonl file, or a built-in task: "
            f"{' or '.join(repr(name) for name in BUILTIN_DATASETS)}"
        )
    examples: list[Example] = []
    empty: list[str] = []
    for where, record in _rows(path):
        example = parse_row(record, where)
        if has_empty_answer(example):
            empty.append(where)
        else:
            examples.append(example)
    if empty and not examples:
        raise UserError(f"{path}: every record has an empty answer ({_lines(empty)}): nothing to learn from")
    if not examples:
        raise UserError(f"{path}: the dataset has no records")
    if empty and log is not None:
        log(f"note: {path}: skipped {len(empty)} record(s) with an empty answer ({_lines(empty)})")
    return examples


def _lines(sources: list[str], shown: int = 5) -> str:
    """'lines 3, 9 and 12' from 'file:line' sources (a few of them)."""
    numbers = [s.rsplit(":", 1)[-1] for s in sources]
    more = f" and {len(numbers) - shown} more" if len(numbers) > shown else ""
    return ("line " if len(numbers) == 1 else "lines ") + ", ".join(numbers[:shown]) + more


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
        examples.append(alpaca_example(record, ""))
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
    length: int = 0  # tokens before truncation to max_length
    source: str = ""  # the Example's ("file:line")

    def has_answer(self) -> bool:
        """Whether any answer token is left to learn from (the loss predicts token i+1 from token i, so a label
        at position 0 does not count)."""
        return any(label != IGNORE_INDEX for label in self.labels[1:])


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
        out.append(TokenizedExample(ids[:max_length], labels[:max_length], len(ids), example.source))
    return out


def fit_to_length(items: list[TokenizedExample], max_length: int, log=None) -> list[TokenizedExample]:
    """The examples that still have an answer after truncation to max_length (`tokenize_examples` truncates):
    one whose answer max_length cut off entirely is skipped, and a note (through `log`) counts the skipped and
    the truncated ones; none left is a UserError."""
    kept = [item for item in items if item.has_answer()]
    if not kept:
        raise UserError(f"max_length={max_length} cuts off every answer: nothing left to learn from")
    skipped = [item for item in items if not item.has_answer()]
    truncated = [item for item in kept if item.length > max_length]
    if log is not None and skipped:
        log(
            f"note: max_length={max_length} cuts off the whole answer of {len(skipped)} example(s), which are "
            f"skipped{_first(skipped)}"
        )
    if log is not None and truncated:
        log(f"note: {len(truncated)} example(s) longer than max_length={max_length} are truncated{_first(truncated)}")
    return kept


def _first(items: list[TokenizedExample]) -> str:
    return f" (the first: {items[0].source})" if items[0].source else ""


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    num_tokens: int  # non-padding tokens (host int: throughput without a device read)
    num_label_tokens: int  # tokens that count in the loss after the causal shift
    # packed rows only (train/data/packing.py): per-example positions, and each token's example in its row (1, 2,
    # ...; padding 0); None for one example per row
    position_ids: torch.Tensor | None = None
    sequence_ids: torch.Tensor | None = None


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

    def __init__(self, items: list, batch_size: int, seed: int, pad_id: int, collate_rows=collate):
        self.items = items  # TokenizedExamples, or packed rows (lists of them) with packing.collate_packed
        self.collate_rows = collate_rows
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
        return self.collate_rows([self.items[i] for i in idx], self.pad_id)
