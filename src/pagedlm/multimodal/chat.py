"""Image parts of chat messages, as ``LLM.chat`` and the servers receive them.

The accepted parts (vLLM's): ``{"type": "image_url", "image_url": {"url": ...}}`` (or the
URL as a plain string), the Responses API's ``{"type": "input_image", "image_url": ...}``,
``{"type": "image_pil", "image_pil": PIL.Image}`` and ``{"type": "image", "image":
PIL.Image}`` (offline only). ``split_images`` replaces each with ``{"type": "image"}``,
what processors' chat templates render as the placeholder, and returns the images in
order: PIL images as they are, URLs to load, each with its place in the conversation.

Every other part of a conversation with images must be text (a text part of
``chat_content.TEXT_PART_FIELDS``, rebuilt as ``{"type": "text", "text": str}``, or a plain
string) or a tool reference (handed on, as vLLM does); a null ``"text"``/``"refusal"``
part is skipped, as vLLM skips it; anything else is a ``ValueError`` naming the part,
since a processor's chat template would drop it without a word. A part without ``"type"`` is read as vLLM reads it
(``chat_content.part_type``: ``{"image_url": ...}`` is an image part).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from pagedlm.chat_content import (
    TEXT_PART_FIELDS,
    TOOL_REFERENCE,
    ContentPartError,
    implied_type,
    part_text,
    part_type,
    skipped_part,
    tool_reference,
)

__all__ = ["ContentPartError", "ImagePart", "has_images", "load_chat_image", "split_images"]

ImageSource = Any
"""A PIL image, or a URL string (data:, http(s)://, file://)."""

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image_pil", "image"})
REFUSED_PART_TYPES = frozenset(
    {
        "image_embeds",
        "input_audio",
        "audio_url",
        "audio_embeds",
        "video_url",
        "file",
        "prompt_embeds",
    }
)
"""Media parts vLLM may take that pagedlm does not (refused with a message, not dropped)."""
_IMAGE_URL_FIX = (
    'send the image as {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}'
)


class ImagePart(NamedTuple):
    source: ImageSource
    where: str
    """The part's place, ``"messages.0.content.1"``, for errors about the image."""


def _image_source(part: dict[str, Any], kind: str, where: str) -> ImageSource:
    if kind in ("image_url", "input_image"):
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ContentPartError(
                where,
                f'an "{kind}" part needs "image_url": {{"url": str}} or the URL as a '
                f"string; {_IMAGE_URL_FIX}.",
            )
        return url
    from PIL import Image

    image = part.get(kind)
    if not isinstance(image, Image.Image):
        raise ContentPartError(
            where,
            f'an "{kind}" part needs a PIL.Image.Image in "{kind}" (LLM.chat only), got '
            f"{type(image).__name__}; over HTTP, or for an encoded image, {_IMAGE_URL_FIX}.",
        )
    return image


def _text_part(part: Any, kind: str | None, where: str) -> dict[str, str]:
    """The text part as ``{"type": "text", "text": ...}`` (processors' templates read
    ``part["type"]``); ``ContentPartError`` for any other part."""
    text = part_text(part)
    if text is not None:
        return {"type": "text", "text": text}
    if kind in TEXT_PART_FIELDS:
        field = TEXT_PART_FIELDS[kind]
        got = type(part.get(field)).__name__
        raise ContentPartError(where, f'a "{kind}" part needs "{field}" to be a string, got {got}.')
    if kind in REFUSED_PART_TYPES:
        raise ContentPartError(
            where,
            f"content parts of type {kind!r} are not supported (pagedlm takes images and "
            f"text); {_IMAGE_URL_FIX}, or drop the part.",
        )
    got = f"type {kind!r:.80}" if isinstance(kind, str) else f"(a {type(part).__name__})"
    raise ContentPartError(
        where,
        f"unknown content part {got}; a message with images holds "
        '{"type": "text", "text": ...} and {"type": "image_url", ...} parts.',
    )


def has_images(conversation: Sequence[dict[str, Any]]) -> bool:
    """Whether any message has an image part, or a media part pagedlm refuses (so that
    ``split_images`` names it instead of a text path dropping it)."""
    media = IMAGE_PART_TYPES | REFUSED_PART_TYPES
    return any(
        isinstance(message, dict)
        and isinstance(message.get("content"), list)
        and any(
            isinstance(part, dict) and implied_type(part) in media for part in message["content"]
        )
        for message in conversation
    )


def split_images(
    conversation: Sequence[dict[str, Any]], places: Sequence[str] | None = None
) -> tuple[list[dict[str, Any]], list[ImagePart]]:
    """(the conversation with image parts as ``{"type": "image"}``, the images in order).

    ``places``: each message's place in the request (default ``"messages.{i}"``), for
    errors. ``ContentPartError`` for a malformed image part or a part that is neither text
    nor image."""
    messages: list[dict[str, Any]] = []
    images: list[ImagePart] = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(dict(message))
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"{places[i] if places else f'messages.{i}'}.content.{j}"
            if skipped_part(part, where):
                continue
            kind = part_type(part, where) if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES:
                images.append(ImagePart(_image_source(part, kind, where), where))
                parts.append({"type": "image"})
            elif kind == TOOL_REFERENCE:
                parts.append(tool_reference(part, where))
            else:
                parts.append(_text_part(part, kind, where))
        messages.append({**message, "content": parts})
    return messages, images


def load_chat_image(part: ImagePart, config: Any) -> Any:
    """The part's image for an offline caller (a URL loaded, a PIL image as it is); a
    ``MediaError`` names the part (``config``: the engine's ``MultiModalConfig``)."""
    if not isinstance(part.source, str):
        return part.source
    from pagedlm.multimodal.media import MediaError, load_image_url

    try:
        return load_image_url(part.source, config)
    except MediaError as error:
        raise MediaError(f"{part.where}: {error}") from None
