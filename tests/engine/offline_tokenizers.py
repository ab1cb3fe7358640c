"""Real tokenizers built offline in milliseconds, for detokenization tests.

Each has added special tokens and added non-special tokens, as chat models do:

- ``byte_level_bpe``: GPT-2 style. Trained small, so many tokens end one CJK character and
  begin the next ("こ" plus the first byte of "ん").
- ``byte_fallback_bpe``: Llama-2 style: "▁" for spaces, ``<0x..>`` byte tokens in the
  model's vocabulary for what it cannot spell, a decoder that strips the first space.
- ``metaspace_bpe``: SentencePiece's Metaspace decoder on its own.
"""

from __future__ import annotations

import json
from functools import cache

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "Hello world, this is a test of streaming text. The quick brown fox jumps over the dog.",
    "Café, résumé, naïve, déjà vu: é è à ç ü ö.",
    "日本語のテキスト。日本、東京、大阪。こんにちは世界。",
    "Emoji: 😀 🎉 👍 🚀 — done! Stop here. STOP. The end.",
]
ADDED_TOKENS = ["<tool>", " Stop", "日x"]
"""Non-special added tokens: markup, one with a leading space, one with a CJK character."""
SPECIAL_TOKENS = ["<|sp|>"]


def _with_added_tokens(backend: Tokenizer) -> Tokenizer:
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return backend


@cache
def byte_level_bpe() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=_with_added_tokens(backend),
        eos_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


@cache
def byte_fallback_bpe() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    # Without "日" in the corpus, "日" is spelled with byte tokens.
    backend.train_from_iterator([text.replace("日", "") for text in CORPUS] * 20, trainer)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=_with_added_tokens(backend),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@cache
def metaspace_bpe() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    backend.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=_with_added_tokens(backend),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


BUILDERS = {
    "byte_level_bpe": byte_level_bpe,
    "byte_fallback_bpe": byte_fallback_bpe,
    "metaspace_bpe": metaspace_bpe,
}
