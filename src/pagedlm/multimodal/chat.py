"""Image parts of chat messages, as ``LLM.chat`` and the servers receive them.

The accepted parts (vLLM's): ``{"type": "image_url", "image_url": {"url": ...}}`` (or the
URL as a plain string), ``{"type": "image_pil", "image_pil": PIL.Image}`` and ``{"type":
"image", "image": PIL.Image}`` (offline only). ``split_images`` replaces each with
``{"type": "image"}``, what processors' chat templates render as the placeholder, and
returns the images in order: PIL images as they are, URLs to load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ImageSource = Any
"""A PIL image, or a URL string (data:, http(s)://, file://)."""


def _image_source(part: dict[str, Any], where: str) -> ImageSource | None:
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ValueError(f'{where}: an "image_url" part needs "image_url": {{"url": str}}.')
        return url
    if kind in ("image_pil", "image"):
        from PIL import Image

        image = part.get(kind)
        if not isinstance(image, Image.Image):
            raise ValueError(f'{where}: an "{kind}" part needs a PIL image in "{kind}".')
        return image
    return None


def has_images(conversation: Sequence[dict[str, Any]]) -> bool:
    return any(
        isinstance(message.get("content"), list)
        and any(
            isinstance(part, dict) and part.get("type") in ("image_url", "image_pil", "image")
            for part in message["content"]
        )
        for message in conversation
    )


def split_images(
    conversation: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """(the conversation with image parts as ``{"type": "image"}``, the images in order)."""
    messages: list[dict[str, Any]] = []
    images: list[ImageSource] = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(dict(message))
            continue
        parts = []
        for j, part in enumerate(content):
            source = (
                _image_source(part, f"messages.{i}.content.{j}") if isinstance(part, dict) else None
            )
            if source is None:
                parts.append(part)
            else:
                images.append(source)
                parts.append({"type": "image"})
        messages.append({**message, "content": parts})
    return messages, images
