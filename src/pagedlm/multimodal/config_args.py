"""The multimodal engine arguments, checked once at the edge into a ``MultiModalConfig``."""

from __future__ import annotations

import json
import os
from typing import Any

from pagedlm.config import MultiModalConfig, validate_positive

MODALITIES = ("image",)


def _json_object(name: str, value: dict[str, Any] | str, example: str) -> dict[str, Any]:
    """``value``, or the JSON object it spells; ValueError naming ``name`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not JSON ({exc}); pass e.g. '{example}'.") from None
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{name} must be a JSON object, e.g. '{example}'.")
    return dict(value)


def parse_limit_mm_per_prompt(value: dict[str, int] | str | None) -> dict[str, int]:
    """vLLM's ``limit_mm_per_prompt``: a dict or its JSON, e.g. '{"image": 2}'."""
    limits = dict(MultiModalConfig().limit_per_prompt)
    if value is None:
        return limits
    value = _json_object("limit_mm_per_prompt", value, '{"image": 2}')
    for modality, limit in value.items():
        if modality not in MODALITIES:
            raise ValueError(
                f"limit_mm_per_prompt names modality {modality!r}; supported: "
                f"{', '.join(MODALITIES)}."
            )
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(
                f"limit_mm_per_prompt[{modality!r}] must be a non-negative integer, got {limit!r}."
            )
        limits[modality] = limit
    return limits


def parse_allowed_media_domains(
    value: list[str] | tuple[str, ...] | None,
) -> tuple[str, ...] | None:
    """vLLM's ``allowed_media_domains``: exact host names (compared case-insensitively)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    hosts = []
    for host in value:
        if not isinstance(host, str) or not host.strip() or "/" in host or "@" in host:
            raise ValueError(
                f"allowed_media_domains has {host!r}, which is not a host name; give bare "
                "hosts, e.g. --allowed-media-domains upload.wikimedia.org example.com."
            )
        hosts.append(host.strip().lower())
    if not hosts:
        # vLLM reads an empty list as "any host"; an allow-list that allows everything
        # is too easy to get by accident, so pagedlm asks for None instead.
        raise ValueError(
            "allowed_media_domains is empty; name at least one host, or leave it unset "
            "(None) to allow images from any host."
        )
    return tuple(hosts)


def parse_mm_processor_kwargs(value: dict[str, Any] | str | None) -> dict[str, Any]:
    """A JSON object (or dict) of processor keyword arguments; which keys the model's
    processor takes is checked where the processor is (``MultiModalProcessor``)."""
    if value is None:
        return {}
    return _json_object("mm_processor_kwargs", value, '{"max_pixels": 802816}')


def multimodal_config(args: Any) -> MultiModalConfig:
    """From ``EngineArgs``' multimodal fields."""
    path = args.allowed_local_media_path
    if path:
        if not os.path.isdir(path):
            raise ValueError(
                f"allowed_local_media_path={path!r} is not a directory; pass an existing "
                "directory (or leave it unset to refuse file:// image URLs)."
            )
        path = os.path.realpath(path)
    if not args.media_fetch_timeout_s > 0:
        raise ValueError(
            f"media_fetch_timeout_s must be positive, got {args.media_fetch_timeout_s!r}."
        )
    validate_positive("media_max_bytes", args.media_max_bytes, allow_none=False)
    for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
        validate_positive(name, getattr(args, name))
    return MultiModalConfig(
        limit_per_prompt=parse_limit_mm_per_prompt(args.limit_mm_per_prompt),
        allowed_local_media_path=path or None,
        media_fetch_timeout_s=float(args.media_fetch_timeout_s),
        media_max_bytes=int(args.media_max_bytes),
        allowed_media_domains=parse_allowed_media_domains(args.allowed_media_domains),
        mm_processor_kwargs=parse_mm_processor_kwargs(args.mm_processor_kwargs),
    )
