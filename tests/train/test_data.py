"""Data loading, tokenisation and label masking, config parsing."""
import json

import pytest
import torch

from fused_stable.train import data
from fused_stable.train.config import resolve_config
from fused_stable.train.errors import UserError
from fused_stable.train.tokenizer import build_byte_tokenizer


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
    alpaca.write_text(json.dumps([{"instruction": "Add.", "input": "1 + 2", "output": "3"},
                                  {"instruction": "Say hi.", "output": "hi"}], indent=1))
    share = tmp_path / "s.jsonl"
    share.write_text(json.dumps({"conversations": [{"from": "system", "value": "be brief"},
                                                   {"from": "human", "value": "2+2?"},
                                                   {"from": "gpt", "value": "4"}]}) + "\n\n")
    a, s = data.load_examples(str(alpaca)), data.load_examples(str(share))
    assert len(a) == 2 and len(s) == 1
    assert "### Input:\n1 + 2" in a[0].segments[0][0] and "### Input" not in a[1].segments[0][0]
    assert [t for t, trained in s[0].segments if trained] == ["4"]
    items = data.tokenize_examples(a + s, tok, 512)
    for item, answer in zip(items, ["3", "hi", "4"]):
        trained = [i for i, label in zip(item.input_ids, item.labels) if label != data.IGNORE_INDEX]
        assert tok.decode(trained[:-1]) == answer and trained[-1] == tok.eos_token_id  # answer + </s> only


def test_collate_masks_padding(tok):
    items = data.tokenize_examples(data.builtin_examples(3, seed=0), tok, 512)
    batch = data.collate(items, tok.pad_token_id)
    pad = batch.attention_mask == 0
    assert pad.any()
    assert (batch.labels[pad] == data.IGNORE_INDEX).all() and (batch.input_ids[pad] == tok.pad_token_id).all()
    assert batch.num_tokens == sum(len(i.input_ids) for i in items)
    assert batch.num_label_tokens == int((batch.labels[:, 1:] != data.IGNORE_INDEX).sum()) > 0


def test_batch_order_is_a_function_of_position(tok):
    items = data.tokenize_examples(data.builtin_examples(10, seed=1), tok, 512)
    a, b = data.BatchOrder(items, 3, seed=5, pad_id=0), data.BatchOrder(items, 3, seed=5, pad_id=0)
    assert a.batches_per_epoch == 4
    seq = [a.batch(k).input_ids for k in range(9)]
    assert torch.equal(b.batch(7).input_ids, seq[7])  # random access: what resume relies on
    assert not torch.equal(seq[0], seq[4]) or not torch.equal(seq[1], seq[5])  # a new order each epoch


def test_builtin_answers_are_correct():
    for example in data.builtin_examples(50, seed=3):
        prompt, answer = example.segments[0][0], example.segments[1][0]
        given = prompt.split("### Input:\n")[1].split("\n")[0]
        if "Add" in prompt:
            x, y = given.split(" + ")
            assert answer == str(int(x) + int(y))
        elif "Reverse" in prompt:
            assert answer == given[::-1]


def test_config_precedence_and_types(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("lr: 1.0e-3\nlora_r: 4\nquant_bits: 4\ntarget_modules: all-linear\n")
    cfg, explicit = resolve_config(["--config", str(config), "--lora_r", "16", "--max-grad-norm=none"])
    assert cfg.lr == 1e-3 and cfg.lora_r == 16 and cfg.quant_bits == 4 and cfg.max_grad_norm is None
    assert cfg.target_modules == "all-linear" and cfg.grad_accum == 8 and cfg.warmup_ratio == 0.1
    assert explicit == {"lr", "lora_r", "quant_bits", "target_modules", "max_grad_norm"}
    with pytest.raises(UserError, match="lora_r in --lora_r must be int"):
        resolve_config(["--lora_r", "2.5"])
