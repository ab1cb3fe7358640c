"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``: OpenAI's Responses
API.

There is one generation path: the request becomes a streaming chat request
(``protocol_responses``), ``ChatServer`` serves it (chat template, tool plan and parsers,
structured outputs, reasoning parser, metrics), and its chunks become output items
(``responses_output``). A stream sends ``response.created``, ``response.in_progress``, the
items' events, then ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it), each with a ``sequence_number`` counting from 0. A request
the engine aborted (``pause_generation``) has status "cancelled", as in vLLM. A stream
whose generation fails once it started (the HTTP status is sent) ends with
``response.failed``: status "failed" and ``error`` {code, message}, as OpenAI's.

``store`` (default true, as OpenAI's) keeps the finished response, its conversation and
its input items for ``previous_response_id``, GET/DELETE and input_items, per API key
(``responses_store``); as OpenAI's, a response's input items are everything its model
read: after ``previous_response_id`` the earlier responses' input and output items come
before the request's own. ``usage`` has OpenAI's fields (``cache_write_tokens`` 0: the
prefix cache is automatic, and OpenAI bills no cache write for automatic caching). There is
no background mode, so a stored response has finished and cancel refuses it, as vLLM
refuses a response that is not a background one.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedlm.engine.exceptions import EngineDeadError, RequestFailedError
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.protocol_responses import (
    INCLUDABLE,
    ResponsesRequest,
    responses_error,
)
from pagedlm.entrypoints.openai.request_body import off_loop_if_large
from pagedlm.entrypoints.openai.responses_input import input_items
from pagedlm.entrypoints.openai.responses_output import OutputBuilder, new_item_id
from pagedlm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagedlm.entrypoints.openai.serving_chat import ChatServer
from pagedlm.entrypoints.openai.serving_engine import ServingContext, stream_or_collect

logger = logging.getLogger("pagedlm.server")


async def _chat_chunks(events: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's chunks as dicts (its SSE lines are ``data: {json}``)."""
    async for event in events:
        payload = event.removeprefix("data: ").strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = chat_usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    # the prefix cache's share, which vLLM's responses report with or without
    # --enable-prompt-tokens-details (ChatServer's report_cached_tokens)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    # and the reasoning's tokens with a --reasoning-parser
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage["total_tokens"],
    }


def _failure(error: Exception) -> dict[str, str]:
    """A failed response's ``error`` for what ended its generation."""
    if isinstance(error, APIError):
        message = error.message
    elif isinstance(error, EngineDeadError):
        message = f"The engine core is not running ({error}); restart the server."
    elif isinstance(error, RequestFailedError):
        message = str(error)
    else:
        logger.exception("Unhandled error while streaming a response")
        message = "Internal server error; see the server log."
    return {"code": "server_error", "message": message}


class ResponsesServer:
    def __init__(self, ctx: ServingContext, store: ResponseStore | None = None) -> None:
        self.ctx = ctx
        self.chat = ChatServer(ctx, report_cached_tokens=True)
        self.store = store if store is not None else ResponseStore()

    def _stored(self, owner: str, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self.store.get(owner, response_id)
        if entry is None:
            raise APIError(
                f"No stored response {response_id!r} for this API key (never stored with "
                "store=true, deleted, or evicted from the server's bounded store).",
                status=404,
                param=param,
            )
        return entry

    def retrieve(self, owner: str, response_id: str) -> dict[str, Any]:
        return self._stored(owner, response_id).response

    def delete(self, owner: str, response_id: str) -> dict[str, Any]:
        self._stored(owner, response_id)
        self.store.delete(owner, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(
        self,
        owner: str,
        response_id: str,
        limit: int = 20,
        order: str = "desc",
        after: str | None = None,
        include: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """A page of the response's input items: OpenAI's list object, newest first
        unless ``order`` is "asc", starting after the item ``after``."""
        entry = self._stored(owner, response_id)
        if not 1 <= limit <= 100:
            raise APIError(f"limit must be between 1 and 100, got {limit}.", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(f"order must be 'asc' or 'desc', got {order!r}.", param="order")
        for value in include:
            if value not in INCLUDABLE:
                raise APIError(
                    f"include: {value!r} is not served; include may name {sorted(INCLUDABLE)}.",
                    param="include",
                )
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        start = 0
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(
                    f"after: {response_id!r} has no input item {after!r}; pass the id of an "
                    "item a previous page listed (its last_id).",
                    param="after",
                )
            start = ids.index(after) + 1
        page = items[start : start + limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + limit < len(items),
        }

    def cancel(self, owner: str, response_id: str) -> dict[str, Any]:
        self._stored(owner, response_id)
        raise APIError(
            "Cannot cancel a synchronous response: only a background response can be "
            "cancelled, and this server runs none (background=true is not served); "
            f"{response_id!r} has already finished.",
            param="response_id",
        )

    async def create(
        self, request: ResponsesRequest, owner: str
    ) -> tuple[dict | None, AsyncIterator[str] | None]:
        """(response body, None) or (None, SSE event stream); raises ``APIError``."""
        self.ctx.check_model(request.model)
        request.check_served()
        conversation, earlier_items = [], []
        if request.previous_response_id is not None:
            previous = self._stored(owner, request.previous_response_id, "previous_response_id")
            conversation = list(previous.conversation)
            earlier_items = previous.items_read()
        size = request.body_bytes
        layout = await off_loop_if_large(size, request.chat_layout, len(conversation))
        conversation += await off_loop_if_large(size, request.input_messages)
        try:
            chat = await off_loop_if_large(size, request.chat_request, conversation)
            _, chunks = await self.chat.create(chat)
        except APIError as error:
            raise responses_error(error, layout) from error
        assert chunks is not None  # the chat request streams
        items = [*earlier_items, *await off_loop_if_large(size, input_items, request.input)]
        events = self._events(request, owner, conversation, items, _chat_chunks(chunks))
        return await stream_or_collect(events, request.stream)

    def _body(
        self,
        request: ResponsesRequest,
        response_id: str,
        created_at: int,
        builder: OutputBuilder | None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The response object; ``builder`` None: one that has just started; ``error``:
        one whose generation failed."""
        status, incomplete = "in_progress", None
        if error is not None:
            status = "failed"
        elif builder is not None:
            status = "completed"
            if builder.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            elif builder.finish_reason == "abort":  # pause_generation: vLLM's "cancelled"
                status = "cancelled"
        text_format = request.text.format if request.text and request.text.format else None
        return {
            "id": response_id,
            "object": "response",
            "created_at": created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "model": self.ctx.response_model(request.model),
            "output": builder.items if builder is not None else [],
            "usage": _usage(builder.usage) if builder is not None and not error else None,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": (
                request.reasoning.echoed()
                if request.reasoning is not None
                else {"effort": None, "summary": None}
            ),
            "temperature": self._effective(request.temperature, "temperature"),
            "top_p": self._effective(request.top_p, "top_p"),
            "top_logprobs": request.top_logprobs,
            "tool_choice": request.tool_choice or self._default_tool_choice(request),
            "tools": request.tools or [],
            "text": {"format": text_format or {"type": "text"}},
            "store": request.store,
            "truncation": "disabled",
            "background": False,
            "user": request.user,
        }

    def _effective(self, value: float | None, name: str) -> float:
        """A sampling field as the request runs it: its own, else the model's default."""
        return value if value is not None else self.ctx.sampling_defaults.get(name, 1.0)

    def _default_tool_choice(self, request: ResponsesRequest) -> str:
        # as chat's: "auto" only where the server parses calls from free text
        return "auto" if request.tools and self.ctx.enable_auto_tool_choice else "none"

    async def _events(
        self,
        request: ResponsesRequest,
        owner: str,
        conversation: list[dict[str, Any]],
        items: list[dict[str, Any]],
        chunks: AsyncIterator[dict[str, Any]],
    ) -> AsyncIterator:
        """The response's events (its body when not streaming); stored with
        ``conversation`` (chat messages) and ``items`` (input items) before the last."""
        response_id, created_at = new_item_id("resp"), int(time.time())
        numbers = itertools.count()

        def sse(event: dict[str, Any]) -> str:
            event["sequence_number"] = next(numbers)
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        if request.stream:
            started = self._body(request, response_id, created_at, None)
            yield sse({"type": "response.created", "response": started})
            yield sse({"type": "response.in_progress", "response": started})
        builder, error = OutputBuilder(), None
        try:
            async for chunk in chunks:
                for event in builder.feed(chunk):
                    if request.stream:
                        yield sse(event)
        except Exception as failure:
            if not request.stream:
                raise  # answered as an error: nothing was sent yet
            error = _failure(failure)
        for event in builder.fail() if error else builder.finish():
            if request.stream:
                yield sse(event)
        response = self._body(request, response_id, created_at, builder, error)
        if request.store:  # before the last event: a client may GET it right after
            history = [*conversation, builder.assistant_message()]
            entry = StoredResponse(response, history, items)
            self.store.put(owner, response_id, entry)
        if not request.stream:
            yield response
            return
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}
        yield sse(
            {"type": kind.get(response["status"], "response.completed"), "response": response}
        )
