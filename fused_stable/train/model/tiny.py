"""The tiny scratch model (`--model tiny`): a 0.82M-parameter Llama built from a LlamaConfig with always the same
weights, and its byte-level tokenizer built locally (no hub): every UTF-8 byte is one token, plus <pad>, <s> and
</s>. The tokenizer is a real `transformers` fast tokenizer (a `tokenizers` ByteLevel BPE with no merges), so it
saves with `save_pretrained` next to the adapter and loads back with `AutoTokenizer.from_pretrained` like any other.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer: ids 0-2 are <pad>, <s>, </s>; ids 3-258 are the 256 bytes."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    # ByteLevel maps each byte to a printable unicode character; sorting fixes the id of every byte.
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, so the text round-trips byte for byte (spaces included).
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=4096
    )


TINY_INIT_SEED = 0  # the tiny base is the same for every run, so an adapter trained on it stays usable


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    """A 0.82M-parameter Llama: small enough to train in minutes on 2 CPU cores.

    Every linear layer's sizes are multiples of 64 (hidden 128, intermediate 320), so bitsandbytes' CPU 4-bit
    inference path takes all of them (see `PACKED_CPU_PATH`); the lm_head (259 outputs) is never quantised.
    initializer_range 0.1 (not the usual 0.02): with a random, frozen lm_head of std 0.02 and hidden size
    128 the largest logit an adapter could reach is about 2.6 nats, so LoRA could barely lower the loss.
    """
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def build_tiny_model(tokenizer=None) -> LlamaForCausalLM:
    """The embedded base model: always the same weights (seeded independently of the run's seed)."""
    tokenizer = tokenizer or build_byte_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_INIT_SEED)
        return LlamaForCausalLM(tiny_llama_config(len(tokenizer)))
