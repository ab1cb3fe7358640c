"""The bytes each token stands for, for backends that match text byte by byte (outlines).

Byte-level BPE vocabularies (GPT-2 style: "Ġ" for a space) map every byte to a printable
character; SentencePiece vocabularies use "▁" for a space and "<0x0A>" for raw bytes.
"""

from __future__ import annotations

from typing import Any


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _sentencepiece_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("▁", " ").encode("utf-8")


def token_bytes(tokenizer: Any, vocab_size: int) -> dict[int, bytes]:
    """``token id -> bytes`` for every ordinary token below ``vocab_size``.

    Special tokens (EOS, chat markers) are left out: grammars never produce them as text.
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab: dict[str, int] = tokenizer.get_vocab()
    decoder = _byte_level_decoder()
    byte_level = all(ch in decoder for tok in vocab for ch in tok if tok.startswith("Ġ"))
    byte_level = byte_level and any(tok.startswith("Ġ") for tok in vocab)
    result: dict[int, bytes] = {}
    for token, token_id in vocab.items():
        if token_id in special or not 0 <= token_id < vocab_size:
            continue
        if byte_level:
            if any(ch not in decoder for ch in token):
                continue  # an added non-special token outside the byte alphabet
            result[token_id] = bytes(decoder[ch] for ch in token)
        else:
            result[token_id] = _sentencepiece_bytes(token)
    return result
