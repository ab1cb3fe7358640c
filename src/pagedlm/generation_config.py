"""Requests' default sampling parameters from a model's ``generation_config.json``, as vLLM.

Model creators publish recommended sampling settings in the checkpoint's Hugging Face
generation config (Qwen3: temperature 0.6, top_p 0.95, top_k 20). vLLM applies them by
default (``--generation-config auto``), and so does pagedlm: of its fields
(``GENERATION_FIELDS``), the five sampling ones become the defaults of every request that
does not set them, in ``LLM.generate``/``LLM.chat`` without sampling parameters and over
HTTP, and ``max_new_tokens`` becomes the default ``max_tokens`` (over HTTP, a cap on every
request's). Other fields (``do_sample``, ``eos_token_id``, ...) are not read.

- ``generation_config="auto"``: the model directory's file (a .gguf file has none);
- ``"vllm"``: no file, the engine's own defaults (temperature 1, no top-k/top-p/min-p);
- a directory: its ``generation_config.json`` (which must exist).

``override_generation_config`` (vLLM's JSON, e.g. ``{"temperature": 0.5}``) sets or
replaces those fields on top, and alone with ``"vllm"``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
GENERATION_FIELDS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
"""The generation-config fields that become request defaults (vLLM's set)."""
MODES = ("auto", "vllm")
"""``generation_config`` values other than a directory."""


def sampling_defaults(
    model: str,
    generation_config: str,
    overrides: Mapping[str, Any] | None = None,
    log: bool = True,
) -> dict[str, Any]:
    """``SamplingParams`` field -> default for requests that leave it unset (``max_tokens``
    for the config's ``max_new_tokens``); ``{}`` where nothing applies. Raises
    ``ValueError`` naming the fix for a missing or unreadable file, unknown override keys
    and values ``SamplingParams`` rejects. ``log``: warn which defaults apply (once per
    engine: its core process resolves the same arguments without it)."""
    from pagedlm.sampling_params import SamplingParams

    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(GENERATION_FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config: {unknown} not used; it takes "
            f"{list(GENERATION_FIELDS)} (the generation-config fields requests default to)."
        )
    if generation_config == "vllm":
        config: dict[str, Any] = {}
        source = "override_generation_config"
    elif generation_config == "auto":
        config = _read(model, required=False)
        source = os.path.join(model, FILE_NAME)
    else:
        config = _read(generation_config, required=True)
        source = os.path.join(generation_config, FILE_NAME)
    config.update(overrides)
    defaults = {name: config[name] for name in GENERATION_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"The generation config {source} gives default sampling parameters pagedlm "
            f"rejects ({error}); fix them with override_generation_config, or pass "
            "generation_config='vllm' to ignore the file."
        ) from None
    if defaults and log:
        if overrides and generation_config != "vllm":
            source += " and override_generation_config"
        logger.warning(
            "Default sampling parameters %s come from %s (requests that set them are "
            "unaffected); generation_config='vllm' keeps pagedlm's own.",
            defaults,
            source,
        )
    return defaults


def _read(folder: str, required: bool) -> dict[str, Any]:
    path = os.path.join(folder, FILE_NAME)
    if not os.path.isfile(path):
        if required:
            raise ValueError(
                f"generation_config={folder!r}: there is no {FILE_NAME} there; pass a "
                f"directory that holds one, or one of {list(MODES)} ('auto': the model's "
                "own, 'vllm': none)."
            )
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{path} is not readable JSON ({error}); fix it, or pass "
            "generation_config='vllm' to ignore it."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{path} holds {type(config).__name__}, not a JSON object; fix it, or pass "
            "generation_config='vllm' to ignore it."
        )
    return config


def request_fields(requested: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """An API request's sampling fields as ``SamplingParams`` keywords: each one it left
    None takes the model's default (``defaults``, from ``sampling_defaults``) or, without
    one, is left out (``SamplingParams``' own). ``max_tokens`` is always given (None: up to
    the context), capped by a default one as vLLM caps it: the smaller of the two."""
    fields = {name: value for name, value in requested.items() if value is not None}
    for name, value in defaults.items():
        if name != "max_tokens" and requested.get(name) is None:
            fields[name] = value
    cap, max_tokens = defaults.get("max_tokens"), requested.get("max_tokens")
    fields["max_tokens"] = max_tokens if cap is None else min(max_tokens or cap, cap)
    return fields
