"""The data formats as LLaMA-Factory and ms-swift users write them, no field lost: alpaca with `system` and
`history`, ShareGPT with a top-level `system`, and `messages` (ms-swift's, OpenAI's and TRL's), each rendered
with the model's own chat template; a field or role the trainer cannot use is one line naming the file, the
line and the field. On the tiny model's byte tokenizer (the plain format) and on SmolLM2's own tokenizer (its
ChatML template's exact tokens; loaded once for the module from the converted GGUF)."""

import json

import pytest

from fused_stable.errors import UserError
from fused_stable.train.data import instructions
from fused_stable.train.model.tiny import build_byte_tokenizer

ALPACA = {
    "system": "Answer in one word.",
    "history": [["Capital of France?", "Paris"], ["And of Italy?", "Rome"]],
    "instruction": "And of Spain?",
    "input": "",
    "output": "Madrid",
}
SHAREGPT = {
    "system": "Answer in one word.",
    "conversations": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris"}],
}
MESSAGES = {
    "messages": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Spain?"},
        {"role": "assistant", "content": "Madrid"},
    ]
}
SYSTEM = {"role": "system", "content": "Answer in one word."}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def load(tmp_path, *records, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return instructions.load_examples(str(path))


def test_every_field_becomes_part_of_the_conversation(tmp_path):
    alpaca, sharegpt, messages = load(tmp_path, ALPACA, SHAREGPT, MESSAGES)
    # alpaca: system first, then the history's turns oldest first, then this one (LLaMA-Factory's meaning)
    assert alpaca.messages == [
        SYSTEM,
        user("Capital of France?"),
        assistant("Paris"),
        user("And of Italy?"),
        assistant("Rome"),
        user("And of Spain?"),
        assistant("Madrid"),
    ]
    assert sharegpt.messages == [SYSTEM, user("Capital of France?"), assistant("Paris")]
    assert messages.messages == MESSAGES["messages"]
    assert [e.source for e in (alpaca, sharegpt, messages)] == [f"{tmp_path / 'd.jsonl'}:{n}" for n in (1, 2, 3)]


def test_plain_format_on_the_tiny_model_trains_every_answer(tmp_path):
    tok = build_byte_tokenizer()
    (alpaca,) = load(tmp_path, ALPACA)
    segments = instructions.render(alpaca, tok)
    text = "".join(t for t, _ in segments)
    assert text.startswith(
        "### System:\nAnswer in one word.\n\n### Instruction:\nCapital of France?\n\n### Response:\n"
    )
    assert [t for t, trained in segments if trained] == ["Paris", "Rome", "Madrid"]
    (item,) = instructions.tokenize_examples([alpaca], tok, 512)
    trained = [i for i, label in zip(item.input_ids, item.labels) if label != instructions.IGNORE_INDEX]
    assert tok.decode(trained) == "Paris</s>Rome</s>Madrid</s>"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from fused_stable.train.model.load import load_tokenizer
    from fused_stable.train.model.sources import resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


def test_smollm2_chat_template_exact_tokens(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    alpaca, sharegpt, messages = load(tmp_path, ALPACA, SHAREGPT, MESSAGES)
    system = "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
    turn = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n"
    for example, turns in (
        (alpaca, [("Capital of France?", "Paris"), ("And of Italy?", "Rome"), ("And of Spain?", "Madrid")]),
        (sharegpt, [("Capital of France?", "Paris")]),
        (messages, [("Capital of France?", "Paris"), ("And of Spain?", "Madrid")]),
    ):
        segments = instructions.render(example, tok)
        assert "".join(t for t, _ in segments) == system + "".join(turn.format(q, a) for q, a in turns)
        assert [t for t, trained in segments if trained] == [f"{a}<|im_end|>\n" for _, a in turns]
        (item,) = instructions.tokenize_examples([example], tok, 512)
        trained = [i for i, label in zip(item.input_ids, item.labels) if label != instructions.IGNORE_INDEX]
        assert tok.decode(trained) == "".join(f"{a}<|im_end|>\n" for _, a in turns)
        # the template's own special tokens, one id each, and the same ids as the whole conversation tokenised
        whole = tok(system + "".join(turn.format(q, a) for q, a in turns), add_special_tokens=False)["input_ids"]
        assert item.input_ids == whole and item.input_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
        assert trained.count(tok.convert_tokens_to_ids("<|im_end|>")) == len(turns)
    # no system field: SmolLM2's template writes its own default system prompt, as at chat time
    (plain,) = load(tmp_path, {"instruction": "Hi", "output": "Hello"}, name="p.jsonl")
    assert "".join(t for t, _ in instructions.render(plain, tok)).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({**ALPACA, "category": "geo"}, "alpaca field 'category' cannot be used (the trainer does not use it)"),
        ({**ALPACA, "images": ["a.png"]}, "alpaca field 'images' cannot be used (images are not trained here"),
        ({**SHAREGPT, "tools": "[]"}, "sharegpt field 'tools' cannot be used (tool calls are not trained here)"),
        ({**MESSAGES, "tools": []}, "messages field 'tools' cannot be used"),
        ({**ALPACA, "history": [["only a question"]]}, "alpaca 'history' item 1 must be a [question, answer] pair"),
        ({**ALPACA, "history": "earlier"}, "alpaca 'history' must be an array of [question, answer] pairs"),
        ({**ALPACA, "system": ["a"]}, "alpaca 'system' must be a string, got an array"),
        (
            {"messages": [user("q"), {"role": "tool", "content": "42"}, assistant("a")]},
            "turn 2 of 'messages' is a 'tool' turn, which cannot be used (tool results are not trained here)",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f()"}]},
            "turn 2 of 'conversations' is a 'function_call' turn",
        ),
        ({"messages": [user("q"), SYSTEM, assistant("a")]}, "turn 2 of 'messages' is a system turn"),
        ({"messages": [{"role": "human", "content": "q"}, assistant("a")]}, "turn 1 needs 'role' in"),
        ({"messages": [user("q"), {**assistant("a"), "loss": True}]}, "turn 2 of 'messages' has field 'loss'"),
        (
            {"system": "s", "conversations": [{"from": "system", "value": "t"}, {"from": "gpt", "value": "a"}]},
            "sharegpt 'system' and a first 'system' turn",
        ),
        ({"messages": [user("q")]}, "no 'gpt'/'assistant' turn to learn from"),
    ],
)
def test_a_field_or_role_that_cannot_be_used_is_one_line(tmp_path, record, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"instruction": "ok", "output": "ok"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError) as info:
        instructions.load_examples(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:2: ") and "\n" not in message
    assert problem in message


def test_a_missing_dataset_names_the_valid_ones_and_a_directory_is_said_so(tmp_path):
    with pytest.raises(UserError) as info:
        instructions.load_examples(str(tmp_path / "nope.jsonl"))
    assert "not found: give a local .json/.jsonl file, or a built-in task: 'identity' or 'arithmetic'" in str(
        info.value
    )
    assert "builtin" not in str(info.value)
    (tmp_path / "train.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    with pytest.raises(UserError, match=r"is a directory; give one .json/.jsonl file \(it holds train.jsonl\)"):
        instructions.load_examples(str(tmp_path))
