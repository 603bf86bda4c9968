"""Byte-level tokenizer built locally (no hub): every UTF-8 byte is one token, plus <pad>, <s> and </s>.

It is a real `transformers` fast tokenizer (a `tokenizers` ByteLevel BPE with no merges), so it saves with
`save_pretrained` next to the adapter and loads back with `AutoTokenizer.from_pretrained` like any other.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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
