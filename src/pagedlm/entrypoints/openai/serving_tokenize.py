"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): a prompt's token ids without
running it, and token ids back to text.

``/tokenize`` with ``messages`` answers the ids ``/v1/chat/completions`` would send for the
same messages and template fields (its ``usage.prompt_tokens`` is their count): a
conversation with image parts on a vision-language model goes through the chat path's
image loading and the model's processor (``chat_images``), each image's placeholder
expanded to the rows it makes; any other through the chat template. Image parts to a
text-only model are the chat path's 400.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedlm.entrypoints.openai.chat_images import (
    multimodal_prompt,
    multimodal_token_ids,
    openai_conversation,
)
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    checked_template_kwargs,
)
from pagedlm.entrypoints.openai.request_body import off_loop_if_large
from pagedlm.entrypoints.openai.serving_engine import ServingContext


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> dict[str, Any]:
    """The answer: ``tokens``, ``count``, ``max_model_len`` (and ``token_strs`` when
    asked); raises ``APIError``."""
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("Send exactly one of prompt or messages.")
    if body.messages is not None:
        tokens = await _chat_tokens(ctx, body)
    else:
        tokenizer = ctx.require_tokenizer()
        add_special_tokens = body.add_special_tokens is not False
        encoded = await asyncio.to_thread(
            tokenizer.encode, body.prompt, add_special_tokens=add_special_tokens
        )
        tokens = list(encoded)
    answer: dict[str, Any] = {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": ctx.max_model_len,
    }
    if body.return_token_strs:
        to_strs = ctx.require_tokenizer().convert_ids_to_tokens
        answer["token_strs"] = await off_loop_if_large(body.body_bytes, to_strs, tokens)
    return answer


async def _chat_tokens(ctx: ServingContext, body: TokenizeRequest) -> list[int]:
    assert body.messages is not None
    kwargs = checked_template_kwargs(
        body.chat_template_kwargs, body.add_generation_prompt, body.continue_final_message
    )
    if body.tools is not None:
        kwargs["tools"] = body.tools
    size = body.body_bytes
    prompt = await multimodal_prompt(
        ctx,
        await off_loop_if_large(size, openai_conversation, body.messages),
        request_template=body.chat_template,
        mm_processor_kwargs=body.mm_processor_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        **kwargs,
    )
    if prompt is not None:
        return await multimodal_token_ids(ctx, prompt)
    conversation = await off_loop_if_large(size, _template_messages, body.messages)
    return await ctx.apply_chat_template(
        conversation,
        body.chat_template,
        body.add_generation_prompt,
        body.continue_final_message,
        kwargs,
        bool(body.add_special_tokens),
    )


def _template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    return [m.template_message(f"messages.{i}") for i, m in enumerate(messages)]


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> dict[str, str]:
    ctx.check_model(body.model)
    tokenizer = ctx.require_tokenizer()
    return await off_loop_if_large(body.body_bytes, _detokenized, tokenizer, body.tokens)


def _detokenized(tokenizer: Any, tokens: list[int]) -> dict[str, str]:
    vocab_size = len(tokenizer)  # a transformers tokenizer counts its vocabulary each time
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        raise APIError(f"tokens must be ids in [0, {vocab_size}).", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}
