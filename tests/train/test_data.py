"""Data loading, tokenisation and label masking, config parsing."""

import json

import pytest
import torch

from fused_stable.errors import UserError
from fused_stable.train.config.resolve import resolve_config
from fused_stable.train.data import instructions, rows
from fused_stable.train.model.tiny import build_byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def test_byte_tokenizer_round_trips_and_saves(tok, tmp_path):
    from transformers import AutoTokenizer

    text = "Héllo wörld 12 + 30 = 42\n\tend"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again(text, add_special_tokens=False)["input_ids"] == ids and len(again) == 259


def test_alpaca_and_sharegpt_files(tmp_path, tok):
    alpaca = tmp_path / "a.json"
    alpaca.write_text(
        json.dumps(
            [{"instruction": "Add.", "input": "1 + 2", "output": "3"}, {"instruction": "Say hi.", "output": "hi"}],
            indent=1,
        )
    )
    share = tmp_path / "s.jsonl"
    share.write_text(
        json.dumps(
            {
                "conversations": [
                    {"from": "system", "value": "be brief"},
                    {"from": "human", "value": "2+2?"},
                    {"from": "gpt", "value": "4"},
                ]
            }
        )
        + "\n\n"
    )
    a, s = instructions.load_examples(str(alpaca)), instructions.load_examples(str(share))
    assert len(a) == 2 and len(s) == 1
    assert a[0].messages == [{"role": "user", "content": "Add.\n\n1 + 2"}, {"role": "assistant", "content": "3"}]
    assert a[1].messages[0]["content"] == "Say hi."
    assert [m["role"] for m in s[0].messages] == ["system", "user", "assistant"] and s[0].answers == ["4"]
    items = instructions.tokenize_examples(a + s, tok, 512)
    for item, answer in zip(items, ["3", "hi", "4"]):
        trained = [i for i, label in zip(item.input_ids, item.labels) if label != instructions.IGNORE_INDEX]
        assert tok.decode(trained[:-1]) == answer and trained[-1] == tok.eos_token_id  # answer + </s> only
    # the plain format (the byte tokenizer has no chat template): prompt ids are what generation gets
    assert tok.decode(items[2].input_ids[1:]).startswith(
        "### System:\nbe brief\n\n### Instruction:\n2+2?\n\n### Response:\n4"
    )
    prompt = instructions.prompt_ids(tok, s[0].messages[:2])
    assert items[2].input_ids[: len(prompt)] == prompt and items[2].labels[len(prompt)] != instructions.IGNORE_INDEX


CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chatml_tok():
    """A byte tokenizer with ChatML special tokens and SmolLM2's style of template (default system prompt)."""
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.eos_token = "<|im_end|>"
    return tok


def test_chat_template_multi_turn_trains_only_assistant_turns(chatml_tok):
    tok = chatml_tok
    example = rows.Example(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    )
    segments = instructions.render(example, tok)
    assert "".join(text for text, _ in segments) == tok.apply_chat_template(example.messages, tokenize=False)
    assert [text for text, trained in segments if trained] == ["hello<|im_end|>\n", "4<|im_end|>\n"]
    (item,) = instructions.tokenize_examples([example], tok, 512)
    assert item.input_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # the template's own tokens, no extra <s>
    trained = [i for i, label in zip(item.input_ids, item.labels) if label != instructions.IGNORE_INDEX]
    assert tok.decode(trained) == "hello<|im_end|>\n4<|im_end|>\n"
    assert trained.count(tok.eos_token_id) == 2  # learns to end each turn
    # generation asks exactly where training put the answer
    prompt = instructions.prompt_ids(tok, example.messages[:3])
    assert item.input_ids[: len(prompt)] == prompt and item.labels[len(prompt)] != instructions.IGNORE_INDEX
    assert item.labels[len(prompt) - 1] == instructions.IGNORE_INDEX


def test_non_incremental_chat_template_is_refused(chatml_tok):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=chatml_tok.backend_tokenizer, eos_token="</s>")
    # a template that writes only the last user turn: earlier turns vanish, so prompts cannot be separated
    tok.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>>{% endif %}"
    example = rows.Example(
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
    )
    with pytest.raises(UserError, match="turn by turn"):
        instructions.render(example, tok)


def test_collate_masks_padding(tok):
    items = instructions.tokenize_examples(instructions.builtin_examples(3, seed=0), tok, 512)
    batch = instructions.collate(items, tok.pad_token_id)
    pad = batch.attention_mask == 0
    assert pad.any()
    assert (batch.labels[pad] == instructions.IGNORE_INDEX).all() and (batch.input_ids[pad] == tok.pad_token_id).all()
    assert batch.num_tokens == sum(len(i.input_ids) for i in items)
    assert batch.num_label_tokens == int((batch.labels[:, 1:] != instructions.IGNORE_INDEX).sum()) > 0


def test_batch_order_is_a_function_of_position(tok):
    items = instructions.tokenize_examples(instructions.builtin_examples(10, seed=1), tok, 512)
    a, b = instructions.BatchOrder(items, 3, seed=5, pad_id=0), instructions.BatchOrder(items, 3, seed=5, pad_id=0)
    assert a.batches_per_epoch == 4
    seq = [a.batch(k).input_ids for k in range(9)]
    assert torch.equal(b.batch(7).input_ids, seq[7])  # random access: what resume relies on
    assert not torch.equal(seq[0], seq[4]) or not torch.equal(seq[1], seq[5])  # a new order each epoch


def test_arithmetic_answers_are_correct():
    for example in instructions.builtin_examples(50, seed=3):
        ((question, answer),) = [(example.messages[0]["content"], example.answers[0])]
        instruction, given = question.split("\n\n")
        if instruction == "Add.":
            x, y = given.split(" + ")
            assert answer == str(int(x) + int(y))
        elif instruction == "Reverse.":
            assert answer == given[::-1]


def test_config_precedence_and_types(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("lr: 1.0e-3\nlora_r: 4\nquant_bits: 4\ntarget_modules: all-linear\n")
    cfg, explicit = resolve_config(["--config", str(config), "--lora_r", "16", "--max-grad-norm=none"])
    assert cfg.lr == 1e-3 and cfg.lora_r == 16 and cfg.quant_bits == 4 and cfg.max_grad_norm is None
    assert cfg.target_modules == "all-linear" and cfg.grad_accum == 1 and cfg.warmup_ratio == 0.1
    assert explicit == {"lr", "lora_r", "quant_bits", "target_modules", "max_grad_norm"}
    with pytest.raises(UserError, match="lora_r in --lora_r must be int"):
        resolve_config(["--lora_r", "2.5"])
