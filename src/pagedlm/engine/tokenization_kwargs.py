"""vLLM's ``tokenization_kwargs``: how one request's text prompt is tokenized.

The keys are those of a transformers tokenizer's call that matter for one text, and they go
to that call as they are (``tokenizer(text, **kwargs)["input_ids"]``, as in vLLM):

- ``add_special_tokens`` (default True): the tokenizer's BOS (and EOS, where it adds one).
  False for a prompt that already holds them as text, e.g. a rendered chat template.
- ``truncation`` with ``max_length``: at most ``max_length`` tokens, cut on the tokenizer's
  ``truncation_side``, which the engine sets as vLLM does: the left (the prompt's end kept)
  for a generating model, the right for a pooling one; the special tokens stay. Without
  ``max_length`` the tokenizer's ``model_max_length`` bounds it. A generation prompt given
  as token ids or embeddings is cut too (``pretokenized_limit``: ``max_length``, else
  ``max_model_len``), as vLLM's renderer cuts every prompt.

And two of vLLM's renderer keys, which pagedlm applies itself:

- ``truncation_side`` ("left": keep the last tokens, "right": the first; None: as above):
  the side both ``truncation`` and a request's ``truncate_prompt_tokens`` cut. Given, the
  text is tokenized whole and its ids cut on that side (special tokens included), as vLLM
  cuts them.
- ``padding`` ("max_length": a pooling prompt is padded with the tokenizer's pad token to
  the request's ``truncate_prompt_tokens``, else to ``max_model_len``; "do_not_pad" or
  None: not padded). Pooling requests only; a generation request with it is refused.

Anything else is refused (``ValueError`` naming these keys) before the request is queued,
so a typo does not pass unnoticed. Without kwargs a prompt is tokenized as before
(``tokenizer.encode(text)``). ``truncate_prompt_tokens`` (which keeps the *last* tokens
unless ``truncation_side`` says otherwise) applies after this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

TOKENIZER_KEYS = ("add_special_tokens", "truncation", "max_length")
"""The keys that go to the tokenizer's call."""
TOKENIZATION_KEYS = (*TOKENIZER_KEYS, "truncation_side", "padding")
TRUNCATION_VALUES = (True, False, "longest_first", "only_first", "do_not_truncate")
TRUNCATION_SIDES = ("left", "right")
PADDING_VALUES = (False, "do_not_pad", "max_length")
_Rows = TypeVar("_Rows")


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
    side = kwargs.get("truncation_side")
    if side is not None and side not in TRUNCATION_SIDES:
        raise ValueError(
            f"tokenization_kwargs truncation_side must be 'left' (keep the last tokens), "
            f"'right' (keep the first) or None, got {side!r}."
        )
    padding = kwargs.get("padding")
    if padding is not None and not any(padding is v or padding == v for v in PADDING_VALUES):
        raise ValueError(
            f"tokenization_kwargs padding={padding!r} is not supported; use 'max_length', "
            "'do_not_pad' or None."
        )
    max_length = kwargs.get("max_length")
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
    ):
        raise ValueError(
            f"tokenization_kwargs max_length must be a positive integer, got {max_length!r}."
        )
    return dict(kwargs)


def pads(kwargs: Mapping[str, Any] | None) -> bool:
    """``kwargs`` ask for padding."""
    return isinstance(kwargs, Mapping) and kwargs.get("padding") == "max_length"


def tokenizer_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What of checked ``kwargs`` goes to the tokenizer's call: with a ``truncation_side``,
    no truncation (the ids are cut afterwards, ``truncate_ids``)."""
    call = {key: kwargs[key] for key in TOKENIZER_KEYS if key in kwargs}
    if kwargs.get("truncation_side") is not None:
        call.pop("truncation", None)
        call.pop("max_length", None)
    return call


def truncation_limit(tokenizer: Any, kwargs: Mapping[str, Any]) -> int | None:
    """How many tokens checked ``kwargs``' ``truncation`` keeps (None: no truncation)."""
    if kwargs.get("truncation") in (None, False, "do_not_truncate"):
        return None
    return kwargs.get("max_length") or getattr(tokenizer, "model_max_length", None)


def pretokenized_limit(kwargs: Mapping[str, Any] | None, max_model_len: int) -> int | None:
    """How many of a prompt's ids given as such (token ids, embeddings' rows) checked
    ``kwargs``' ``truncation`` keeps: ``max_length``, else ``max_model_len`` (None: no
    truncation). vLLM's renderer turns ``truncation`` into the prompt's
    ``truncate_prompt_tokens``, which cuts every kind of prompt, not only text."""
    if not kwargs or kwargs.get("truncation") in (None, False, "do_not_truncate"):
        return None
    return kwargs.get("max_length") or max_model_len


def tighter(keep: int | None, limit: int | None) -> int | None:
    """The smaller of two bounds on the prompt's ids, either of which may be None (none)."""
    return limit if keep is None else keep if limit is None else min(keep, limit)


def truncate_ids(ids: _Rows, keep: int | None, side: str) -> _Rows:
    """At most ``keep`` of ``ids`` (None: all): the last ones for side "left", the first
    for "right". ``ids`` may be any sequence, e.g. a tensor of prompt embeddings' rows."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[len(ids) - keep :] if side == "left" else ids[:keep]


def encode_text(tokenizer: Any, text: str, kwargs: Mapping[str, Any] | None) -> list[int]:
    """``text``'s token ids under checked ``kwargs`` (``check_tokenization_kwargs``)."""
    if not kwargs:
        return list(tokenizer.encode(text))
    ids = list(tokenizer(text, **tokenizer_kwargs(kwargs))["input_ids"])
    side = kwargs.get("truncation_side")
    return ids if side is None else truncate_ids(ids, truncation_limit(tokenizer, kwargs), side)
