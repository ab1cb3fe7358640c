"""``mm_processor_kwargs``: keyword arguments for the model's image processor, from
``--mm-processor-kwargs`` and from a request (vLLM's names; a request's keys override the
flag's, as vLLM merges them).

The keys a model takes are its image processor's declared options (transformers'
``valid_kwargs``: ``size``, ``image_mean``, ``do_normalize``, ... and per family e.g.
Qwen2-VL's ``min_pixels``/``max_pixels`` or Gemma 3's pan-and-scan options), less those
that only choose the output's container (``return_tensors``, ``data_format``, ``device``).
Any other key is an error naming it. vLLM hands every key to the processor call, where
transformers logs an unknown one and drops it; a misspelt ``max_pixel`` would then change
nothing without a word, so pagedlm refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NOT_SETTABLE = frozenset({"return_tensors", "data_format", "input_data_format", "device"})
"""Declared options that pagedlm sets itself (tensors on the CPU, channels first)."""


def accepted_names(processor: Any) -> frozenset[str]:
    """The keyword arguments ``processor``'s image processor declares (its
    ``valid_kwargs`` TypedDict, inherited keys included)."""
    declared = getattr(getattr(processor, "image_processor", None), "valid_kwargs", None)
    return frozenset(getattr(declared, "__annotations__", {})) - NOT_SETTABLE


def check_names(kwargs: Mapping[str, Any], processor: Any, where: str) -> None:
    """Raise ``ValueError`` naming the first key of ``kwargs`` the processor does not take."""
    names = accepted_names(processor)
    unknown = sorted(set(kwargs) - names)
    if unknown:
        image_processor = type(getattr(processor, "image_processor", processor)).__name__
        raise ValueError(
            f"{where} has {unknown[0]!r}, which the model's image processor "
            f"({image_processor}) does not take; it takes: {', '.join(sorted(names))}."
        )


def as_kwargs(value: Any, where: str) -> dict[str, Any]:
    """A request's ``mm_processor_kwargs`` as a dict (None: empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f'{where} must be an object, e.g. {{"max_pixels": 802816}}.')
    return dict(value)
