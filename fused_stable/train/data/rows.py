"""One record of a dataset file as an Example: the row formats (alpaca, ShareGPT, messages) and the one check
every record goes through (`parse_row`), which names the file and line of anything it cannot use. Reading the
files and what is skipped rather than refused is `data`'s job.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from fused_stable.errors import UserError

# ShareGPT speaker names (and the OpenAI-style roles some exports use) -> chat role
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# the `messages` format's roles (ms-swift's standard format, OpenAI's and TRL's conversational datasets)
MESSAGES_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}


@dataclass
class Example:
    messages: list[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]
    source: str = ""  # where it came from, "file:line" (empty for the built-in tasks): what notes name

    @property
    def answers(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "assistant"]


def conversation(question: str, answer: str) -> Example:
    return Example([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    """`messages` with the run's `system` (`--system`) as their first message when they have no system message of
    their own (theirs wins); unchanged when `system` is None."""
    if system is None or has_system(messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def has_system(messages: list[dict]) -> bool:
    return bool(messages) and messages[0]["role"] == "system"


def give_system(examples: list[Example], system: str | None) -> tuple[list[Example], int]:
    """The examples with the run's system message given to each that has none (`with_system`), and how many
    got it."""
    if system is None:
        return examples, 0
    without = sum(not has_system(e.messages) for e in examples)
    return [Example(with_system(e.messages, system), e.source) for e in examples], without


# ---------------------------------------------------------------------------------------------- rows
# Every record of a dataset file goes through `parse_row`, the one place a row is checked: a JSON object in one of
# ROW_FORMATS (the first whose `matches` accepts it parses it), or one line naming the file and line. A new format
# is one more RowFormat. What is skipped rather than refused (counted, one note per file) is in `load_examples`
# (empty answers) and `fit_to_length` (answers cut off by max_length).
@dataclass(frozen=True)
class RowFormat:
    name: str
    matches: Callable[[dict], bool]  # is the record meant to be in this format (its keys)?
    parse: Callable[[dict, str], Example]  # (record, "file:line") -> Example; UserError names "file:line"


def _text(record: dict, key: str, where: str, fmt: str, *, optional: bool = False) -> str:
    value = record.get(key)
    if value is None and optional:
        return ""
    if key not in record:
        raise UserError(f"{where}: {fmt} record has no {key!r} (keys: {', '.join(sorted(record)[:6]) or 'none'})")
    if not isinstance(value, str):
        raise UserError(f"{where}: {fmt} {key!r} must be a string, got {_json_type(value)}")
    return value


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "true/false", type(None): "null"}
    return names.get(type(value), "a number")


# the fields each format reads; any other field of a record is one line naming it (never dropped silently)
ALPACA_FIELDS = ("instruction", "input", "output", "system", "history")
SHAREGPT_FIELDS = ("conversations", "system")
MESSAGES_FIELDS = ("messages",)
TURN_FIELDS = ("from", "value", "role", "content")
# why a field other trainers define is not read here (the rest are just unknown)
UNUSABLE_FIELDS = {
    "tools": "tool calls are not trained here",
    "images": "images are not trained here (text only)",
    "videos": "videos are not trained here (text only)",
    "audios": "audio is not trained here (text only)",
    "chosen": "preference pairs are for DPO, not sft",
    "rejected": "preference pairs are for DPO, not sft",
    "kto_tag": "KTO labels are not trained here",
}


def _no_other_fields(record: dict, where: str, fmt: str, fields: tuple[str, ...]) -> None:
    extra = [key for key in record if key not in fields]
    if extra:
        key = extra[0]
        why = UNUSABLE_FIELDS.get(key, "the trainer does not use it")
        raise UserError(
            f"{where}: {fmt} field {key!r} cannot be used ({why}); {fmt} reads {', '.join(fields)}: remove it"
        )


def _system(record: dict, where: str, fmt: str) -> list[dict]:
    """A top-level `system` (LLaMA-Factory's alpaca and ShareGPT) as the conversation's first message."""
    system = _text(record, "system", where, fmt, optional=True)
    return [{"role": "system", "content": system}] if system.strip() else []


def alpaca_example(record: dict, where: str) -> Example:
    _no_other_fields(record, where, "alpaca", ALPACA_FIELDS)
    instruction = _text(record, "instruction", where, "alpaca")
    answer = _text(record, "output", where, "alpaca")
    extra = _text(record, "input", where, "alpaca", optional=True)
    # the input follows the instruction in the same user turn (LLaMA-Factory joins them with one newline; this
    # trainer has always used a blank line, which the built-in arithmetic task and its chat prompts follow)
    question = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages = _system(record, where, "alpaca") + _history(record.get("history"), where)
    return Example(messages + conversation(question, answer).messages, where)


def _history(history, where: str) -> list[dict]:
    """LLaMA-Factory's alpaca `history`: the earlier turns, [[question, answer], ...], oldest first."""
    if history is None:
        return []
    if not isinstance(history, list):
        raise UserError(
            f"{where}: alpaca 'history' must be an array of [question, answer] pairs, got {_json_type(history)}"
        )
    messages = []
    for number, pair in enumerate(history, start=1):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(text, str) for text in pair)):
            raise UserError(
                f"{where}: alpaca 'history' item {number} must be a [question, answer] pair of strings "
                f"(got {json.dumps(pair, ensure_ascii=False)[:80]})"
            )
        messages += conversation(pair[0], pair[1]).messages
    return messages


def _turns(record: dict, key: str, where: str, fmt: str, roles: dict) -> list[dict]:
    """The turns of a ShareGPT `conversations` or a `messages` list as chat messages: each a known role (a
    system turn only first) with string content, and at least one assistant turn to learn from."""
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: {key!r} must be a non-empty array of turns, got {_json_type(turns)}")
    messages = []
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise UserError(f"{where}: turn {number} of {key!r} must be an object, got {_json_type(turn)}")
        speaker = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if isinstance(speaker, str) and speaker not in roles and speaker in OTHER_ROLES:
            why = OTHER_ROLES[speaker]
            raise UserError(f"{where}: turn {number} of {key!r} is a {speaker!r} turn, which cannot be used ({why})")
        if not isinstance(speaker, str) or speaker not in roles or not isinstance(text, str):
            names = "'from' in" if fmt == "sharegpt" else "'role' in"
            raise UserError(
                f"{where}: turn {number} needs {names} {sorted(roles)} and a string "
                f"'{'value' if fmt == 'sharegpt' else 'content'}' (got {json.dumps(turn, ensure_ascii=False)[:80]})"
            )
        extra = [k for k in turn if k not in TURN_FIELDS]
        if extra:
            raise UserError(
                f"{where}: turn {number} of {key!r} has field {extra[0]!r}, which cannot be used: remove it"
            )
        if roles[speaker] == "system" and number != 1:
            raise UserError(f"{where}: turn {number} of {key!r} is a system turn; a system turn can only come first")
        messages.append({"role": roles[speaker], "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no 'gpt'/'assistant' turn to learn from")
    return messages


# roles other trainers define that a plain conversation cannot hold here
OTHER_ROLES = {
    "observation": "tool results are not trained here",
    "function_call": "tool calls are not trained here",
    "function": "tool calls are not trained here",
    "tool": "tool results are not trained here",
    "tool_call": "tool calls are not trained here",
}


def _sharegpt_example(record: dict, where: str) -> Example:
    _no_other_fields(record, where, "sharegpt", SHAREGPT_FIELDS)
    messages = _turns(record, "conversations", where, "sharegpt", SHAREGPT_ROLES)
    system = _system(record, where, "sharegpt")
    if system and messages[0]["role"] == "system":
        raise UserError(f"{where}: sharegpt 'system' and a first 'system' turn: give the system prompt once")
    return Example(system + messages, where)


def _messages_example(record: dict, where: str) -> Example:
    _no_other_fields(record, where, "messages", MESSAGES_FIELDS)
    return Example(_turns(record, "messages", where, "messages", MESSAGES_ROLES), where)


ROW_FORMATS: list[RowFormat] = [
    RowFormat("sharegpt", lambda record: "conversations" in record, _sharegpt_example),
    RowFormat("messages", lambda record: "messages" in record, _messages_example),
    RowFormat("alpaca", lambda record: "instruction" in record or "output" in record, alpaca_example),
]


def parse_row(record, where: str) -> Example:
    """One record of a dataset file as an Example, or a UserError that starts with `where` ("file:line")."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {_json_type(record)}")
    for fmt in ROW_FORMATS:
        if fmt.matches(record):
            return fmt.parse(record, where)
    expected = " or ".join(fmt.name for fmt in ROW_FORMATS)
    raise UserError(
        f"{where}: unknown record format (keys {sorted(record)[:6]}); expected {expected} "
        "(alpaca: 'instruction'/'input'/'output', sharegpt: 'conversations', messages: 'messages')"
    )


def has_empty_answer(example: Example) -> bool:
    """An assistant turn with nothing in it: there is nothing to learn, and training on it teaches silence."""
    return any(not answer.strip() for answer in example.answers)
