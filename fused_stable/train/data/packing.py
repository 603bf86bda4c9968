"""Packing (`packing: true`, `neat_packing: true`, LLaMA-Factory's keys): several tokenised examples per row, up to
max_length tokens, instead of one padded example per row.

- `pack_rows` groups the examples into rows greedily (the longest example left first, then the longest that
  still fits, as LLaMA-Factory's `greedy_knapsack`): every example lands in exactly one row, whole, and no row
  passes max_length.
- `collate_packed` lays a batch of rows out: the examples of a row one after another, position ids restarting at
  0 for each example, the first token of each example labelled IGNORE_INDEX (the loss predicts token i+1 from
  token i: no example's first token is predicted from the previous example's last one), rows right-padded to
  the longest row of the batch (padding masked as before).
- Plain packing lets a token attend to the earlier examples of its row (LLaMA-Factory's `packing` without
  `neat_packing`); `neat_packing` confines attention to each example with a 4-D block-diagonal causal mask
  (`model_inputs`), which transformers' eager and sdpa attention take as given. Any other attention
  implementation is refused in one line (`check_attention`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from fused_stable.errors import UserError
from fused_stable.train.data.instructions import IGNORE_INDEX, Batch, TokenizedExample

# the attention implementations whose masks a 4-D tensor replaces as given (transformers' masking_utils returns
# a 4-D attention_mask unchanged): sdpa takes a boolean mask (True: attend), eager an additive float one
CONFINABLE = ("sdpa", "eager")


def packing_on(cfg) -> bool:
    """`neat_packing` implies packing (LLaMA-Factory turns `packing` on for it)."""
    return bool(cfg.packing or cfg.neat_packing)


def pack_rows(items: list[TokenizedExample], max_length: int) -> list[list[TokenizedExample]]:
    """The examples grouped into rows of at most max_length tokens (each example is at most max_length long:
    `tokenize_examples` truncates). Deterministic: ties in length go to the later example first."""
    left = sorted((len(item.input_ids), i) for i, item in enumerate(items))
    rows = []
    while left:
        row, room = [], max_length
        while left:
            pos = bisect.bisect_right(left, (room, len(items))) - 1  # the longest example that still fits
            if pos < 0:
                break
            length, index = left.pop(pos)
            row.append(items[index])
            room -= length
        rows.append(row)
    return rows


@dataclass(frozen=True)
class PackedAttention:
    """How a packed batch reaches the model: `neat` (confined to each example) or not, and the mask format of
    the model's attention implementation (`check_attention`)."""

    neat: bool
    implementation: str = "sdpa"
    dtype: torch.dtype = torch.float32  # eager's additive mask is in the dtype of the model's activations


def check_attention(model, neat: bool) -> PackedAttention:
    """The PackedAttention for this model, or a one-line UserError where neat packing cannot be confined."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if neat and implementation not in CONFINABLE:
        raise UserError(
            f"neat_packing: the model's attention implementation {implementation!r} cannot be confined to each "
            f"example here (a block-diagonal mask needs {' or '.join(CONFINABLE)}): use packing without neat_packing"
        )
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = embeddings.weight.dtype if embeddings is not None else torch.float32
    return PackedAttention(neat, implementation, dtype if dtype.is_floating_point else torch.float32)


def collate_packed(rows: list[list[TokenizedExample]], pad_id: int) -> Batch:
    """Each row's examples end to end, right-padded to the longest row; position ids restart at each example;
    `sequence_ids` numbers the examples of a row from 1 (padding 0) for the neat mask."""
    width = max(sum(len(item.input_ids) for item in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    sequence_ids = torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for number, item in enumerate(row, start=1):
            end = start + len(item.input_ids)
            input_ids[r, start:end] = torch.tensor(item.input_ids)
            labels[r, start:end] = torch.tensor(item.labels)
            labels[r, start] = IGNORE_INDEX  # never predicted from the previous example's last token
            position_ids[r, start:end] = torch.arange(end - start)
            sequence_ids[r, start:end] = number
            start = end
    attention_mask = (sequence_ids > 0).long()
    num_label_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    num_tokens = int(attention_mask.sum())
    return Batch(input_ids, attention_mask, labels, num_tokens, num_label_tokens, position_ids, sequence_ids)


def block_diagonal_mask(sequence_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, L, L) booleans: token q sees token k when k <= q and both are in the same example (the padding
    after the last example is one more block, so no row of the mask is empty)."""
    width = sequence_ids.size(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=sequence_ids.device).tril()
    same = sequence_ids[:, :, None] == sequence_ids[:, None, :]
    return (same & causal)[:, None]


def model_inputs(batch: Batch, device, attention: PackedAttention | None) -> dict:
    """The model's keyword arguments for a batch: input_ids and the 2-D padding mask, plus for a packed batch
    its position ids, and under neat packing the block-diagonal mask in the attention implementation's format."""
    inputs = {
        "input_ids": batch.input_ids.to(device, non_blocking=True),
        "attention_mask": batch.attention_mask.to(device, non_blocking=True),
    }
    if batch.position_ids is None:
        return inputs
    inputs["position_ids"] = batch.position_ids.to(device, non_blocking=True)
    if attention is not None and attention.neat:
        allowed = block_diagonal_mask(batch.sequence_ids.to(device, non_blocking=True))
        if attention.implementation == "eager":  # added to the scores: 0 where allowed, the dtype's minimum elsewhere
            floor = torch.finfo(attention.dtype).min
            allowed = torch.zeros(allowed.shape, dtype=attention.dtype, device=device).masked_fill(~allowed, floor)
        inputs["attention_mask"] = allowed
    return inputs


def padding_share(batch: Batch) -> float:
    """The share of a batch's positions that are padding."""
    return 1.0 - batch.num_tokens / batch.input_ids.numel()
