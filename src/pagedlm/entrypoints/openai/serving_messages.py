"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: the Anthropic Messages API.

A stream is the event sequence message_start, then per content block content_block_start,
content_block_delta*, content_block_stop, then message_delta (stop reason, usage),
message_stop. The reply is a ``thinking`` block when the server's ``--reasoning-parser``
found reasoning, a text block when the model wrote text, then one ``tool_use`` block per
tool call, numbered from 0 as they come: no empty block (a reply that only calls a tool is
its ``tool_use`` blocks, one with nothing ``[]``). Tools are planned, forced
and parsed exactly as for chat completions (``structured_request.plan_tools`` and the
server's ``--tool-call-parser``), and a streamed tool call arrives whole, as one
``input_json_delta``, once the model has finished it. A call's id is Anthropic's ``toolu_``
form of the chat id, except where the parser's family has its own (Mistral's 9 characters,
which its chat template checks when the ``tool_use`` block comes back).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pagedlm.entrypoints.openai.chat_images import anthropic_conversation, multimodal_prompt
from pagedlm.entrypoints.openai.chat_output import ChatOutputParser, reasoning_factory
from pagedlm.entrypoints.openai.errors import from_value_error
from pagedlm.entrypoints.openai.protocol_anthropic import (
    TOOL_SCHEMA_FIELD,
    CountTokensRequest,
    MessagesRequest,
)
from pagedlm.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedlm.entrypoints.openai.request_body import off_loop_if_large
from pagedlm.entrypoints.openai.serving_engine import (
    ServingContext,
    merge_streams,
    stream_or_collect,
)
from pagedlm.entrypoints.openai.structured_request import ToolPlan, plan_tools
from pagedlm.generation_config import request_fields
from pagedlm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def _stop_reason(
    finish_reason: str | None, stop_reason: int | str | None
) -> tuple[str | None, str | None]:
    """(Anthropic stop_reason, stop_sequence) for an engine finish; an aborted request
    (``pause_generation``) has no stop reason (null, as vLLM's Messages API answers)."""
    if finish_reason == "abort":
        return None, None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def _tool_use_blocks(parser: ChatOutputParser) -> list[dict[str, Any]]:
    """The parser's finished tool calls as Anthropic ``tool_use`` blocks."""
    blocks = []
    for call_id, name, pieces in zip(parser.call_ids, parser.call_names, parser.call_arguments):
        arguments = "".join(pieces)
        try:
            tool_input = json.loads(arguments) if arguments else {}
        except ValueError:
            logger.warning("tool call %s has arguments that are not JSON: %r", name, arguments)
            tool_input = {}
        if not isinstance(tool_input, dict):
            tool_input = {"value": tool_input}
        tool_id = (
            "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id
        )
        blocks.append({"type": "tool_use", "id": tool_id, "name": name, "input": tool_input})
    return blocks


class MessagesServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _plan(self, request: CountTokensRequest) -> ToolPlan:
        tool_choice, parallel = request.function_tool_choice()
        return plan_tools(
            request.function_tools(),
            tool_choice,
            parallel,
            self.ctx.tool_parser,
            self.ctx.enable_auto_tool_choice,
            self.ctx.exclude_tools_when_tool_choice_none,
            grammar=self.ctx.grammar_check,
            schema_field=TOOL_SCHEMA_FIELD,
        )

    async def _prompt(self, request: CountTokensRequest, plan: ToolPlan) -> list[int]:
        continues = request.continues_assistant
        template_kwargs = {} if plan.template_tools is None else {"tools": plan.template_tools}
        return await self.ctx.apply_chat_template(
            await off_loop_if_large(request.body_bytes, request.conversation),
            None,
            add_generation_prompt=not continues,
            continue_final_message=continues,
            template_kwargs=template_kwargs,
        )

    async def count_tokens(self, request: CountTokensRequest) -> dict:
        self.ctx.check_model(request.model)
        continues = request.continues_assistant
        images = await off_loop_if_large(request.body_bytes, anthropic_conversation, request)
        conversation, places = images or (None, None)
        prompt = await multimodal_prompt(
            self.ctx,
            conversation,
            places=places,
            add_generation_prompt=not continues,
            continue_final_message=continues,
        )
        if prompt is not None:  # images: their placeholders expanded, as generation sees them
            processor = self.ctx.engine.input_processor
            try:
                _, token_ids, _ = await asyncio.to_thread(processor.tokenize_multimodal, prompt)
            except ValueError as error:
                raise from_value_error(error) from error
            return {"input_tokens": len(token_ids)}
        return {"input_tokens": len(await self._prompt(request, self._plan(request)))}

    async def create(
        self, request: MessagesRequest
    ) -> tuple[dict | None, AsyncIterator[str] | None]:
        self.ctx.check_model(request.model)
        plan = self._plan(request)
        continues = request.continues_assistant
        images = await off_loop_if_large(request.body_bytes, anthropic_conversation, request)
        conversation, places = images or (None, None)
        prompt: dict = await multimodal_prompt(
            self.ctx,
            conversation,
            places=places,
            add_generation_prompt=not continues,
            continue_final_message=continues,
        ) or {"prompt_token_ids": await self._prompt(request, plan)}
        reasoning_parser = self._reasoning_parser(plan)
        keep_special_tokens = plan.needs_special_tokens or (
            reasoning_parser is not None and reasoning_parser.needs_special_tokens
        )
        try:
            requested = {
                "temperature": request.temperature,
                "top_p": request.top_p,
                "top_k": request.top_k,
                "max_tokens": request.max_tokens,
            }
            params = SamplingParams(
                **request_fields(requested, self.ctx.sampling_defaults),
                stop=request.stop_sequences,
                skip_special_tokens=not keep_special_tokens,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=plan.structured_outputs,
            )
        except ValueError as error:
            raise from_value_error(error) from error
        # Anthropic's form, "msg_..." (request_id gives "msg-..."), for the engine too.
        message_id = "msg_" + self.ctx.request_id("msg").removeprefix("msg-")
        started = await self.ctx.start(
            [prompt],
            params,
            message_id,
            lora_request=self.ctx.lora_request(request.model),
        )
        prompt_ids = started[0][0].prompt_token_ids
        input_tokens = len(prompt_ids)
        new_reasoning_parser = reasoning_factory(reasoning_parser, self.ctx.tokenizer, prompt_ids)
        parser = ChatOutputParser.build(new_reasoning_parser, plan.new_parser, plan.new_call_id)
        events = self._events(request, message_id, started, input_tokens, parser)
        return await stream_or_collect(events, request.stream)

    def _reasoning_parser(self, plan: ToolPlan) -> type[ReasoningParser] | None:
        """The server's reasoning parser, unless a forced tool call is all the output (its
        grammar, applied from the first token, leaves no room for a thought), as for chat
        completions."""
        return self.ctx.reasoning_parser_class(forced_call=plan.structured_outputs is not None)

    async def _events(
        self,
        request: MessagesRequest,
        message_id: str,
        started,
        input_tokens: int,
        parser: ChatOutputParser,
    ) -> AsyncIterator:
        message = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.response_model(request.model),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        blocks = _BlockEvents()
        if request.stream:
            yield _event("message_start", {"type": "message_start", "message": message})
        output_tokens = 0
        finish: tuple[str | None, str | None] = ("end_turn", None)
        async for _, output in merge_streams(started):
            sample = output.outputs[0] if output.outputs else None
            if sample is None:
                continue
            output_tokens += len(sample.token_ids)
            delta = parser.feed(sample.text)
            thinking, text = delta.get("reasoning_content", ""), delta.get("content", "")
            if sample.finish_reason is not None:
                last = parser.finish()
                thinking += last.get("reasoning_content", "")
                text += last.get("content", "")
                finish = _stop_reason(sample.finish_reason, sample.stop_reason)
            if request.stream and thinking:
                thinking_delta = {"type": "thinking_delta", "thinking": thinking}
                for event in blocks.delta(_THINKING_START, thinking_delta):
                    yield event
            if request.stream and text:
                for event in blocks.delta({"type": "text", "text": ""}, _text_delta(text)):
                    yield event
        tool_uses = _tool_use_blocks(parser)
        if tool_uses and finish[0] not in ("max_tokens", None):
            finish = ("tool_use", None)
        stop_reason, stop_sequence = finish
        usage = {"input_tokens": input_tokens, "output_tokens": output_tokens}
        if request.stream:
            for block in tool_uses:
                for event in blocks.whole_tool_use(block):
                    yield event
            for event in blocks.stop():
                yield event
            yield _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": usage,  # cumulative, as Anthropic's
                },
            )
            yield _event("message_stop", {"type": "message_stop"})
            return
        thinking, text = "".join(parser.reasoning), "".join(parser.content)
        content = [{**_THINKING_START, "thinking": thinking}] if thinking else []
        content += [{"type": "text", "text": text}] if text else []
        yield {
            **message,
            "content": [*content, *tool_uses],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }


_THINKING_START = {"type": "thinking", "thinking": "", "signature": ""}
"""A thinking block as it opens. Its signature stays empty: Anthropic's signs the thought
for its own servers to verify when it comes back; nothing here signs or verifies one."""


def _text_delta(text: str) -> dict[str, str]:
    return {"type": "text_delta", "text": text}


class _BlockEvents:
    """The content-block events of a streamed reply. Blocks are numbered from 0 in the
    order they open; one is open at a time, and a block opens at its first delta, so the
    stream holds no block a whole reply would leave out (an empty text block before a
    tool call: Anthropic never answers one)."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.open_type: str | None = None

    def delta(self, empty_block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        """Events for ``delta`` to a block of ``empty_block``'s type: the open one, or a new
        one (``empty_block`` its start) after closing the open one of another type."""
        events = []
        if self.open_type != empty_block["type"]:
            events = self.stop()
            start = {
                "type": "content_block_start",
                "index": self.num_blocks,
                "content_block": empty_block,
            }
            events.append(_event("content_block_start", start))
            self.open_type = empty_block["type"]
            self.num_blocks += 1
        body = {"type": "content_block_delta", "index": self.num_blocks - 1, "delta": delta}
        events.append(_event("content_block_delta", body))
        return events

    def whole_tool_use(self, block: dict[str, Any]) -> list[str]:
        """A finished tool call as its own block: its input in one ``input_json_delta``."""
        events = self.stop()
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += self.delta({**block, "input": {}}, delta)
        events += self.stop()
        return events

    def stop(self) -> list[str]:
        """The open block's ``content_block_stop`` (nothing when none is open)."""
        if self.open_type is None:
            return []
        self.open_type = None
        body = {"type": "content_block_stop", "index": self.num_blocks - 1}
        return [_event("content_block_stop", body)]
