"""vLLM's ``tokenization_kwargs``: how one request's text prompt is tokenized.

The keys are those of a transformers tokenizer's call that matter for one text, and they go
to that call as they are (``tokenizer(text, **kwargs)["input_ids"]``, as in vLLM):

- ``add_special_tokens`` (default True): the tokenizer's BOS (and EOS, where it adds one).
  False for a prompt that already holds them as text, e.g. a rendered chat template.
- ``truncation`` with ``max_length``: at most ``max_length`` tokens, cut on the tokenizer's
  ``truncation_side``, which the engine sets as vLLM does: the left (the prompt's end kept)
  for a generating model, the right for a pooling one; the special tokens stay. Without
  ``max_length`` the tokenizer's ``model_max_length`` bounds it.

Anything else is refused (``ValueError`` naming these keys) before the request is queued,
so a typo does not pass unnoticed. Without kwargs a prompt is tokenized as before
(``tokenizer.encode(text)``). ``truncate_prompt_tokens`` (which keeps the *last* tokens)
applies after this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TOKENIZATION_KEYS = ("add_special_tokens", "truncation", "max_length")
TRUNCATION_VALUES = (True, False, "longest_first", "only_first", "do_not_truncate")


def check_tokenization_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``kwargs`` as a dict once its keys and values are checked; None for none."""
    if not kwargs:
        return None
    if not isinstance(kwargs, Mapping):
        raise ValueError(
            f"tokenization_kwargs must be a dict, got {type(kwargs).__name__}; e.g. "
            "{'add_special_tokens': False}."
        )
    unknown = sorted(set(kwargs) - set(TOKENIZATION_KEYS))
    if unknown:
        raise ValueError(
            f"tokenization_kwargs {unknown} are not supported; use {list(TOKENIZATION_KEYS)}."
        )
    special = kwargs.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise ValueError(f"tokenization_kwargs add_special_tokens must be a bool, got {special!r}.")
    truncation = kwargs.get("truncation", False)
    if not any(truncation is value or truncation == value for value in TRUNCATION_VALUES):
        raise ValueError(
            f"tokenization_kwargs truncation must be one of {list(TRUNCATION_VALUES)}, got "
            f"{truncation!r}."
        )
    max_length = kwargs.get("max_length")
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
    ):
        raise ValueError(
            f"tokenization_kwargs max_length must be a positive integer, got {max_length!r}."
        )
    return dict(kwargs)


def encode_text(tokenizer: Any, text: str, kwargs: Mapping[str, Any] | None) -> list[int]:
    """``text``'s token ids under checked ``kwargs`` (``check_tokenization_kwargs``)."""
    if not kwargs:
        return list(tokenizer.encode(text))
    return list(tokenizer(text, **kwargs)["input_ids"])
