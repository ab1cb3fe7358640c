"""A real byte-level BPE tokenizer, trained in milliseconds on a small multilingual corpus."""

from __future__ import annotations

import pytest

CORPUS = [
    "Hello world, this is a test of streaming text. The quick brown fox jumps over the dog.",
    "Café, résumé, naïve, déjà vu: é è à ç ü ö.",
    "日本語のテキスト。日本、東京、大阪。こんにちは世界。",
    "Emoji: 😀 🎉 👍 🚀 — done! Stop here. STOP. The end.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_token_ids(tokenizer, text: str) -> list[int]:
    # GPT-2's byte -> printable character table, which the ByteLevel alphabet uses.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    vocab = tokenizer.get_vocab()
    return [vocab[table[byte]] for byte in text.encode("utf-8")]


@pytest.fixture(scope="session")
def bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=520,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="session")
def byte_token_ids(bpe_tokenizer):
    """``byte_token_ids(text)``: one token per UTF-8 byte, so multi-byte characters span
    several tokens."""
    return lambda text: _byte_token_ids(bpe_tokenizer, text)
