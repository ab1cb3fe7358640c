"""Chat requests with images, for a vision-language model: OpenAI ``image_url`` parts and
Anthropic ``image`` blocks (base64 or URL sources) to a ``multi_modal_data`` prompt.

A request without images, or any request to a text-only model, takes the text path
(whose 400 for image parts says the model is text-only). Here: the image count is
checked against ``--limit-mm-per-prompt`` before anything is fetched, the images load
concurrently (``multimodal.media``: size cap, timeout, allowed local directory, PIL's
pixel limit), and the conversation, image parts as ``{"type": "image"}``, renders
through the model processor's chat template on a thread. Every failure is a 400 naming
the problem. ``/tokenize`` takes the same path, then the engine's own tokenization of the
prompt (``multimodal_token_ids``), so its ids are the chat request's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedlm.chat_content import ContentPartError, check_continuable
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.protocol_anthropic import system_content
from pagedlm.multimodal.chat import ImagePart, has_images, split_images
from pagedlm.multimodal.media import load_image_url_async


def _inputs(ctx: Any) -> Any | None:
    """The engine's ``MultiModalInputs`` when it serves a vision-language model."""
    processor = getattr(ctx.engine, "input_processor", None)
    inputs = getattr(processor, "multimodal", None)
    return inputs if inputs is not None and inputs.supported else None


def _anthropic_image_url(block: dict[str, Any], where: str) -> str:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if isinstance(media_type, str) and isinstance(data, str):
            return f"data:{media_type};base64,{data}"
    url = source.get("url") if isinstance(source, dict) else None
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(url, str):
        return url
    raise APIError(
        f'{where}: an image block needs "source": {{"type": "base64", "media_type": '
        '"image/png", "data": ...}} or {"type": "url", "url": ...}.',
        param=where,
    )


def anthropic_conversation(request: Any) -> tuple[list[dict[str, Any]], list[str]] | None:
    """An Anthropic request's conversation with image blocks as OpenAI ``image_url``
    parts, and each conversation message's place in the request (``"system"``,
    ``"messages.2"``) for errors (None: no image block: the text path answers)."""
    messages = request.messages
    if not any(
        not isinstance(m.content, str) and any(b.type == "image" for b in m.content)
        for m in messages
    ):
        return None
    conversation: list[dict[str, Any]] = []
    places: list[str] = []
    if request.system:
        conversation.append({"role": "system", "content": system_content(request.system)})
        places.append("system")
    for i, message in enumerate(messages):
        if isinstance(message.content, str) or all(b.type != "image" for b in message.content):
            turn = message.template_messages(f"messages.{i}.content")
            conversation.extend(turn)
            places.extend([f"messages.{i}"] * len(turn))
            continue
        parts = []
        for j, block in enumerate(message.content):
            where = f"messages.{i}.content.{j}"
            if block.type == "image":
                url = _anthropic_image_url(block.model_dump(), where)
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif block.type == "text" and isinstance(block.text, str):
                parts.append({"type": "text", "text": block.text})
            else:
                raise APIError(
                    f"{where}: a turn with images may hold text and image blocks only.",
                    param=where,
                )
        conversation.append({"role": message.role, "content": parts})
        places.append(f"messages.{i}")
    return conversation, places


def openai_conversation(messages: list[Any]) -> list[dict[str, Any]] | None:
    """The chat messages as dicts, content parts kept (None: no image part)."""
    conversation = [m.model_dump(exclude_none=True) for m in messages]
    return conversation if has_images(conversation) else None


async def _load_image(part: ImagePart, config: Any) -> Any:
    """The part's image; a failure is a 400 naming the part (``messages.0.content.1``)."""
    try:
        return await load_image_url_async(part.source, config)
    except ValueError as error:
        raise APIError(f"{part.where}: {error}", param=part.where) from None


async def check_processor_kwargs(ctx: Any, kwargs: dict[str, Any]) -> None:
    """400 for a request's ``mm_processor_kwargs`` that the model's image processor does
    not take, or sent to a text-only model (images in the request or not)."""
    inputs = getattr(getattr(ctx.engine, "input_processor", None), "multimodal", None)
    if inputs is None:
        return
    try:  # the first check may load the processor: off the event loop
        await asyncio.to_thread(inputs.processor_kwargs, kwargs)
    except ValueError as error:
        raise APIError(str(error), param="mm_processor_kwargs") from error


async def multimodal_prompt(
    ctx: Any,
    conversation: list[dict[str, Any]] | None,
    request_template: str | None = None,
    mm_processor_kwargs: dict[str, Any] | None = None,
    places: list[str] | None = None,
    **template_kwargs: Any,
) -> dict[str, Any] | None:
    """``{"prompt": text, "multi_modal_data": {"image": [...]}}`` for a conversation with
    images to a vision-language model; None otherwise (the text path takes it).

    The template is the server's ``--chat-template`` or the processor's; a request's own
    ``chat_template`` is refused here (the text path renders those sandboxed). Content
    parts stay a list whatever ``--chat-template-content-format`` says (the processor's
    template places the images by them); ``--default-chat-template-kwargs`` apply.
    ``mm_processor_kwargs`` (a chat request's, vLLM's) are checked, and go with the prompt.
    ``places``: each message's place in the request, for errors (``"messages.{i}"``)."""
    if mm_processor_kwargs is not None:
        await check_processor_kwargs(ctx, mm_processor_kwargs)
    inputs = _inputs(ctx)
    if conversation is None or inputs is None:
        return None
    if request_template is not None:
        raise APIError(
            "chat_template in a request with images is not supported; drop it (the "
            "model's processor template, or the server's --chat-template, applies).",
            param="chat_template",
        )
    template_kwargs = {**ctx.default_chat_template_kwargs, **template_kwargs}
    template_kwargs["chat_template"] = ctx.chat_template
    try:
        messages, parts = split_images(conversation, places)
        inputs.check_count("image", len(parts))
    except ValueError as error:
        raise APIError(str(error), param=getattr(error, "where", "messages")) from error
    if template_kwargs.get("continue_final_message"):
        _check_continuable(messages, places)
    images = await asyncio.gather(*(_load_image(part, inputs.config) for part in parts))
    try:
        text = await asyncio.to_thread(inputs.processor.render_chat, messages, **template_kwargs)
    except ValueError as error:
        raise APIError(str(error), param="messages") from error
    prompt = {"prompt": text, "multi_modal_data": {"image": list(images)}}
    if mm_processor_kwargs:
        prompt["mm_processor_kwargs"] = mm_processor_kwargs
    return prompt


def _check_continuable(messages: list[dict[str, Any]], places: list[str] | None) -> None:
    """``chat_content.check_continuable`` as a 400: an image after the last message's last
    text part would be lost (the prompt then refused for a placeholder short, naming no
    part), and a last message without text has nothing to continue."""
    try:
        check_continuable(messages, places)
    except ContentPartError as error:
        raise APIError(str(error), param=error.where) from None


async def multimodal_token_ids(ctx: Any, prompt: dict[str, Any]) -> list[int]:
    """The token ids the engine makes of ``multimodal_prompt``'s prompt (the model's
    processor expands each image's placeholder), off the event loop; a 400 for what it
    refuses, as a chat request with the prompt gets."""
    processor = ctx.engine.input_processor
    try:
        _, token_ids = await asyncio.to_thread(processor.tokenize, prompt)
    except ValueError as error:
        raise APIError(str(error), param="messages") from error
    return token_ids
