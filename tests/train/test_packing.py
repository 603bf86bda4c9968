"""Packing (`packing`, `neat_packing`, train/data/packing.py): rows of several examples up to max_length, position ids
restarting at each example, no label across an example boundary, and under neat packing each example's logits and
loss as if it ran alone, on the tiny model with transformers' sdpa and eager attention."""

import json

import pytest
import torch
import torch.nn.functional as F
from sft_helpers import TINY, fit, read_metrics, setup_run

from fused_stable.errors import UserError
from fused_stable.train.config.resolve import resolve_config
from fused_stable.train.data import instructions, packing
from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model

IGNORE = instructions.IGNORE_INDEX
MAX_LENGTH = 128


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def items(tok):
    """Built-in examples (their first token, <s>, carries no label) and, between them, fully labelled ones (every
    token a label, as a plain-text example would be): only those show a label that crosses a boundary."""
    built = instructions.tokenize_examples(instructions.builtin_examples(10, seed=3), tok, MAX_LENGTH)
    labelled = [instructions.TokenizedExample(b.input_ids[1:], list(b.input_ids[1:])) for b in built[:4]]
    return [x for pair in zip(built[:4], labelled) for x in pair] + built[4:]


def _model(tok, implementation):
    model = build_tiny_model(tok)
    model.config._attn_implementation = implementation
    return model.eval()


def _logits(model, batch, attention):
    with torch.no_grad():
        return model(**packing.model_inputs(batch, "cpu", attention)).logits.float()


def _segments(rows):
    """(row, start, item) for every example of every packed row."""
    for r, row in enumerate(rows):
        start = 0
        for item in row:
            yield r, start, item
            start += len(item.input_ids)


def _loss_sum(logits, labels):
    """The summed loss of a sequence as the loop computes it: token t predicts label t + 1."""
    return F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="sum")


def _floor(model, items, attention):
    """The unpacked examples against themselves in another layout (a padded batch in reverse order against each
    example alone): the largest logit difference layout alone makes. Measured: 3.7e-6 (sdpa), 0 (eager)."""
    alone = [_logits(model, instructions.collate([item], 0), attention)[0] for item in items]
    batched = _logits(model, instructions.collate(items[::-1], 0), attention)
    floor = max(
        (batched[len(items) - 1 - i, : len(item.input_ids)] - alone[i]).abs().max().item()
        for i, item in enumerate(items)
    )
    return alone, floor


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_neat_packed_batch_gives_each_example_its_unpacked_logits_and_loss(tok, items, implementation):
    model = _model(tok, implementation)
    attention = packing.check_attention(model, neat=True)
    alone, floor = _floor(model, items, attention)
    tolerance = 4 * max(floor, 3.7e-6)  # 4x the largest layout difference measured on either implementation
    rows = packing.pack_rows(items, MAX_LENGTH)
    assert max(len(row) for row in rows) >= 2  # rows really hold several examples
    batch = packing.collate_packed(rows, tok.pad_token_id)
    packed = _logits(model, batch, attention)
    plain = _logits(model, batch, packing.PackedAttention(neat=False))
    crossed = 0.0
    for r, start, item in _segments(rows):
        i, n = next(i for i, x in enumerate(items) if x is item), len(item.input_ids)
        assert (packed[r, start : start + n] - alone[i]).abs().max().item() <= tolerance
        labels = torch.tensor(item.labels)
        want = _loss_sum(alone[i], labels)
        # the example's share of the packed loss: its positions, the packed labels (its first one masked)
        got = _loss_sum(packed[r, start : start + n + 1], batch.labels[r, start : start + n + 1])
        if start + n == batch.labels.size(1):  # the row's last example: nothing after it
            got = _loss_sum(packed[r, start : start + n], batch.labels[r, start : start + n])
        assert got.item() == pytest.approx(want.item(), rel=0, abs=tolerance * max(1, int((labels != IGNORE).sum())))
        if start:
            crossed = max(crossed, (plain[r, start : start + n] - alone[i]).abs().max().item())
    # without neat_packing attention crosses into the row's earlier examples: the mask is what keeps them apart
    assert crossed > 1000 * tolerance


def test_the_neat_mask_equals_transformers_own_packed_sequence_mask(tok, items):
    """transformers 5 builds a block-diagonal mask itself from restarting position ids when attention_mask is
    None and no cache is used (masking_utils.find_packed_sequence_indices): the same logits."""
    model = _model(tok, "sdpa")
    batch = packing.collate_packed(packing.pack_rows(items, MAX_LENGTH), tok.pad_token_id)
    ours = _logits(model, batch, packing.check_attention(model, neat=True))
    with torch.no_grad():
        theirs = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_no_label_crosses_an_example_boundary_and_positions_restart(tok, items):
    rows = packing.pack_rows(items, MAX_LENGTH)
    batch = packing.collate_packed(rows, tok.pad_token_id)
    expected_labels = 0
    for r, start, item in _segments(rows):
        n = len(item.input_ids)
        assert batch.input_ids[r, start : start + n].tolist() == item.input_ids
        assert batch.labels[r, start].item() == IGNORE  # the first token is never predicted from the one before
        assert batch.labels[r, start + 1 : start + n].tolist() == item.labels[1:]
        assert batch.position_ids[r, start : start + n].tolist() == list(range(n))
        expected_labels += sum(label != IGNORE for label in item.labels[1:])
    assert any(item.labels[0] != IGNORE for row in rows for item in row[1:])  # a boundary that had a label
    assert batch.num_label_tokens == expected_labels
    assert batch.num_tokens == sum(len(item.input_ids) for item in items)


def test_plain_packing_rows_fit_max_length_and_lose_no_example(tok):
    examples = instructions.builtin_examples(300, seed=5)
    items = instructions.tokenize_examples(examples, tok, 256)
    rows = packing.pack_rows(items, 256)
    assert all(sum(len(item.input_ids) for item in row) <= 256 for row in rows) and len(rows) < len(items) / 4
    packed = sorted(id(item) for row in rows for item in row)
    assert packed == sorted(id(item) for item in items)  # each example in exactly one row
    assert rows == packing.pack_rows(items, 256)  # deterministic
    # fewer positions than one example per row, padded to the batch's longest
    order = instructions.BatchOrder(rows, 4, 0, tok.pad_token_id, packing.collate_packed)
    unpacked = instructions.BatchOrder(items, 4, 0, tok.pad_token_id)
    share = [packing.padding_share(order.batch(k)) for k in range(order.batches_per_epoch)]
    plain = [packing.padding_share(unpacked.batch(k)) for k in range(unpacked.batches_per_epoch)]
    assert sum(share) / len(share) < sum(plain) / len(plain)


def test_neat_packing_is_refused_in_one_line_where_attention_cannot_be_confined(tok):
    model = _model(tok, "flash_attention_2")
    with pytest.raises(UserError, match="neat_packing: the model's attention implementation") as info:
        packing.check_attention(model, neat=True)
    assert "\n" not in str(info.value)
    assert not packing.check_attention(model, neat=False).neat  # plain packing needs no mask


def test_llamafactory_packing_keys_are_read(tmp_path):
    config = tmp_path / "lf.yaml"
    config.write_text(json.dumps({"stage": "sft", "neat_packing": True, "dataset": "arithmetic"}))
    cfg, _ = resolve_config(["--config", str(config)])
    assert cfg.neat_packing and packing.packing_on(cfg)  # neat_packing implies packing, as in LLaMA-Factory
    cfg, _ = resolve_config(["--packing"])
    assert cfg.packing and not cfg.neat_packing


@pytest.mark.parametrize("flag", ["--packing", "--neat_packing"])
def test_sft_trains_with_packing_on_the_tiny_model(sft, tmp_path, flag):
    out = tmp_path / "run"
    # rows of up to 256 tokens hold ~5 examples: 12 steps of 2 x 4 rows see the 400 examples about once
    tiny = TINY + ["--arithmetic_examples", "400", "--max_length", "256", "--target_modules", "all-linear"]
    code, stdout, _ = sft(*tiny, "--output_dir", out, "--lr", "3e-3", "--max_steps", "12", "--save_steps", "0", flag)
    assert code == 0, stdout
    assert "packing: 400 examples in " in stdout
    losses = [row["loss"] for row in read_metrics(out)]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert len(losses) == 12 and last < first - 0.5, (first, last)


def test_the_loop_feeds_the_model_the_rows_positions_and_neat_mask(tmp_path):
    run = setup_run(
        *TINY, "--output_dir", tmp_path / "run", "--max_steps", "1", "--max_length", "256", "--neat_packing"
    )
    assert run.trainer.attention == packing.PackedAttention(neat=True, implementation="sdpa")
    seen = []
    hook = run.trainer.model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs), with_kwargs=True)
    try:
        fit(run)
    finally:
        hook.remove()
    batches = [run.trainer.batches.batch(k) for k in range(2)]  # the step's window (grad_accum 2)
    assert len(seen) == 2
    for kwargs, batch in zip(seen, batches):
        assert torch.equal(kwargs["position_ids"], batch.position_ids)
        assert torch.equal(kwargs["attention_mask"], packing.block_diagonal_mask(batch.sequence_ids))
