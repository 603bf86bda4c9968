"""Tiny real models and data for the integration tests (built from configs: no model hub)."""

from __future__ import annotations

import torch


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences; labels are the inputs (causal LM)."""

    def __init__(self, n: int = 64, seq: int = 12, vocab: int = 64, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama(seed: int = 0, **config):
    """A 2-layer Llama with hidden size 32; ``config`` overrides LlamaConfig fields (vocab_size, token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    fields.update(config)
    return LlamaForCausalLM(LlamaConfig(**fields))
