"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: the Anthropic Messages API.

A stream is the event sequence message_start, content_block_start, content_block_delta*,
content_block_stop, message_delta (stop reason, output tokens), message_stop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from pagedlm.entrypoints.openai.serving_engine import (
    ServingContext,
    merge_streams,
    stream_or_collect,
)
from pagedlm.sampling_params import RequestOutputKind, SamplingParams


def _stop_reason(
    finish_reason: str | None, stop_reason: int | str | None
) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) for an engine finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


class MessagesServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _prompt(self, request: CountTokensRequest) -> list[int]:
        continues = request.continues_assistant
        return self.ctx.apply_chat_template(
            request.conversation(),
            None,
            add_generation_prompt=not continues,
            continue_final_message=continues,
            template_kwargs={},
        )

    async def count_tokens(self, request: CountTokensRequest) -> dict:
        self.ctx.check_model(request.model)
        return {"input_tokens": len(self._prompt(request))}

    async def create(
        self, request: MessagesRequest
    ) -> tuple[dict | None, AsyncIterator[str] | None]:
        self.ctx.check_model(request.model)
        prompt_token_ids = self._prompt(request)
        try:
            params = SamplingParams(
                temperature=request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=-1 if request.top_k is None else request.top_k,
                stop=request.stop_sequences,
                max_tokens=request.max_tokens,
                output_kind=RequestOutputKind.DELTA,
            )
        except ValueError as error:
            raise APIError(str(error)) from error
        message_id = self.ctx.request_id("msg")
        started = await self.ctx.start([{"prompt_token_ids": prompt_token_ids}], params, message_id)
        events = self._events(request, message_id, started, len(prompt_token_ids))
        return await stream_or_collect(events, request.stream)

    async def _events(
        self, request: MessagesRequest, message_id: str, started, input_tokens: int
    ) -> AsyncIterator:
        message = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        if request.stream:
            yield _event("message_start", {"type": "message_start", "message": message})
            yield _event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
        texts: list[str] = []
        output_tokens = 0
        finish: tuple[str, str | None] = ("end_turn", None)
        async for _, output in merge_streams(started):
            sample = output.outputs[0] if output.outputs else None
            if sample is None:
                continue
            output_tokens += len(sample.token_ids)
            texts.append(sample.text)
            if sample.finish_reason is not None:
                finish = _stop_reason(sample.finish_reason, sample.stop_reason)
            if request.stream and sample.text:
                delta = {"type": "text_delta", "text": sample.text}
                yield _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                )
        stop_reason, stop_sequence = finish
        if request.stream:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": output_tokens},
                },
            )
            yield _event("message_stop", {"type": "message_stop"})
            return
        yield {
            **message,
            "content": [{"type": "text", "text": "".join(texts)}],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        }
