"""``POST /v1/chat/completions``: chat through the tokenizer's (or the server's) template.

Streaming sends, per choice, a first chunk with ``{"role": "assistant", "content": ""}``
(the role as vLLM picks it: ``ChatCompletionRequest.reply_role``), with vLLM's ``echo`` a
chunk with the echoed last message, then content deltas (with ``reasoning_content`` and
``tool_calls`` pieces when a reasoning parser or tools apply, see ``chat_output``), then an
empty delta with ``finish_reason``; with ``stream_options.include_usage`` a last chunk with
no choices carries the usage (and with vLLM's ``continuous_usage_stats`` every chunk its
choice's usage so far). Echoed text counts in no usage: it is not generated.

A request whose parsers read special tokens (Mistral's ``[TOOL_CALLS]``, ``[THINK]``) is
detokenized with them kept; the token that ended the output (EOS) is still left out of the
text unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedlm.entrypoints.openai.chat_images import multimodal_prompt, openai_conversation
from pagedlm.entrypoints.openai.chat_output import ChatOutputParser, reasoning_factory
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.logprobs_format import chat_logprobs, prompt_logprobs_json
from pagedlm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedlm.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedlm.entrypoints.openai.request_body import off_loop_if_large
from pagedlm.entrypoints.openai.serving_engine import (
    ServingContext,
    merge_streams,
    reported_cached_tokens,
    stream_or_collect,
)
from pagedlm.entrypoints.openai.structured_request import ToolPlan, plan_tools


@dataclass
class _ChatChoice:
    index: int
    parser: ChatOutputParser
    num_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)
    num_token_ids_sent: int = 0
    """How many of ``token_ids`` streamed chunks carried (``return_token_ids``)."""


class ChatServer:
    def __init__(self, ctx: ServingContext, report_cached_tokens: bool = False) -> None:
        """``report_cached_tokens``: the final usage has ``prompt_tokens_details`` whatever
        ``--enable-prompt-tokens-details`` says (the Responses API, whose usage always
        counts the cached input tokens, as vLLM's)."""
        self.ctx = ctx
        self.report_cached_tokens = report_cached_tokens

    def _decode(self, token_id: int) -> str:
        return self.ctx.tokenizer.decode([token_id]) if self.ctx.tokenizer is not None else ""

    async def create(
        self, request: ChatCompletionRequest
    ) -> tuple[dict | None, AsyncIterator[str] | None]:
        """(response body, None) or (None, SSE event stream); raises ``APIError``."""
        ctx = self.ctx
        ctx.check_model(request.model)
        plan = plan_tools(
            request.tools,
            request.tool_choice,
            request.parallel_tool_calls,
            ctx.tool_parser,
            ctx.enable_auto_tool_choice,
            ctx.exclude_tools_when_tool_choice_none,
            grammar=ctx.grammar_check,
        )
        if plan.structured_outputs is not None and (
            request.response_format or request.asks_structured_outputs
        ):
            raise APIError(
                f'tool_choice="{plan.mode}" constrains the output itself; drop '
                "response_format/structured_outputs or use tool_choice='auto'.",
                param="tool_choice",
            )
        template_kwargs = request.template_kwargs()
        if plan.template_tools is not None:
            template_kwargs["tools"] = plan.template_tools
        if request.reasoning_effort is not None:
            template_kwargs.setdefault("reasoning_effort", request.reasoning_effort)
        size = request.body_bytes
        prompt: dict = await multimodal_prompt(
            ctx,
            await off_loop_if_large(size, openai_conversation, request.messages),
            request_template=request.chat_template,
            mm_processor_kwargs=request.mm_processor_kwargs,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            **template_kwargs,
        ) or {
            "prompt_token_ids": await ctx.apply_chat_template(
                await off_loop_if_large(size, request.conversation),
                request.chat_template,
                request.add_generation_prompt,
                request.continue_final_message,
                template_kwargs,
                request.add_special_tokens,
            )
        }
        max_tokens = request.max_completion_tokens or request.max_tokens
        reasoning_parser = self._reasoning_parser(plan)
        keep_special_tokens = plan.needs_special_tokens or (
            reasoning_parser is not None and reasoning_parser.needs_special_tokens
        )
        params = request.base_sampling_params(
            max_tokens,
            request.num_logprobs(),
            plan.structured_outputs,
            ctx.sampling_defaults,
            keep_special_tokens,
            grammar=ctx.grammar_check,
        )
        if request.echo and request.prompt_logprobs is None and not request.stream:
            # vLLM's: an echoing request scores its prompt too (a stream never sends them).
            params.prompt_logprobs = request.top_logprobs or 0
        request_id = ctx.request_id("chatcmpl", request.request_id)
        prompts = request.engine_prompts([prompt])
        lora = ctx.lora_request(request.model)
        beam = request.beam_search_params(max_tokens, ctx.max_model_len)
        if beam is not None and plan.structured_outputs is not None:
            raise APIError(
                f'use_beam_search does not combine with tool_choice="{plan.mode}" (a forced '
                "call's grammar); use tool_choice='auto' or drop one.",
                param="tool_choice",
            )
        started = await ctx.start_for(request, prompts, params, beam, request_id, lora)
        # Where the engine applies a grammar from the first token (it has no reasoning
        # parser's markers), the output starts after any thought, and the parser must say
        # so too; where it applies it after the thought, the model thinks first. A
        # structural tag leaves free text (a thought may come first) until its triggers.
        grammar = params.structured_outputs
        constrained = (
            grammar is not None
            and grammar.structural_tag is None
            and not ctx.structured_outputs_after_reasoning
        )
        events = self._events(request, request_id, started, plan, reasoning_parser, constrained)
        return await stream_or_collect(events, request.stream)

    def _reasoning_parser(self, plan: ToolPlan) -> type[ReasoningParser] | None:
        """The server's reasoning parser, unless a forced tool call is all the output (its
        grammar, applied from the first token, leaves no room for a thought)."""
        return self.ctx.reasoning_parser_class(forced_call=plan.structured_outputs is not None)

    async def _events(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        started,
        plan: ToolPlan,
        reasoning_parser: type[ReasoningParser] | None,
        constrained: bool,
    ) -> AsyncIterator:
        num_top = request.top_logprobs or 0
        as_ids = self.ctx.tokens_as_ids(request.return_tokens_as_token_ids)
        choices: dict[int, _ChatChoice] = {}
        prompt_ids = started[0][0].prompt_token_ids
        prompt_tokens = len(prompt_ids)
        new_reasoning_parser = reasoning_factory(
            reasoning_parser, self.ctx.tokenizer, prompt_ids, constrained
        )
        base = {
            "id": request_id,
            "created": self.ctx.created,
            "model": self.ctx.response_model(request.model),
        }
        chunk_base = {**base, "object": "chat.completion.chunk"}
        role = request.reply_role(self.ctx.response_role)
        echoed = request.echoed_text(role)

        def chunk(index: int, delta: dict, finish: str | None = None, **extra) -> str:
            body = {
                **chunk_base,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            body["choices"][0].update(extra)
            choice = choices[index]
            if request.continuous_usage:
                body["usage"] = self.ctx.usage(prompt_tokens, choice.num_tokens)
            if request.return_token_ids:
                if not announced:  # vLLM's place: the stream's first chunk, top level
                    body["prompt_token_ids"] = prompt_ids
                    announced.add(index)
                body["choices"][0]["token_ids"] = choice.token_ids[choice.num_token_ids_sent :]
                choice.num_token_ids_sent = len(choice.token_ids)
            return f"data: {json.dumps(body)}\n\n"

        announced: set[int] = set()

        prompt_logprobs = None
        cached = 0
        async for _, output in merge_streams(started):
            cached = max(cached, reported_cached_tokens(output, request.stream))
            if output.prompt_logprobs is not None and prompt_logprobs is None:
                prompt_logprobs = prompt_logprobs_json(output.prompt_logprobs)
            for sample in output.outputs:
                choice = choices.get(sample.index)
                if choice is None:
                    parser = ChatOutputParser.build(
                        new_reasoning_parser, plan.new_parser, plan.new_call_id
                    )
                    choice = choices[sample.index] = _ChatChoice(sample.index, parser)
                    if request.stream:
                        yield chunk(sample.index, {"role": role, "content": ""})
                        if echoed:  # vLLM's place: the first content delta of each choice
                            yield chunk(sample.index, {"content": echoed})
                delta = choice.parser.feed(sample.text, len(sample.token_ids))
                choice.num_tokens += len(sample.token_ids)
                choice.token_ids += sample.token_ids
                new_logprobs = None
                if request.logprobs and sample.logprobs is not None:
                    new_logprobs = chat_logprobs(
                        sample.token_ids, sample.logprobs, num_top, self._decode, as_ids
                    )
                    choice.logprobs.extend(new_logprobs)
                if request.stream and (delta or new_logprobs):
                    logprobs = {"content": new_logprobs} if new_logprobs is not None else None
                    yield chunk(sample.index, delta, logprobs=logprobs)
                if sample.finish_reason is not None:
                    last = choice.parser.finish()
                    if request.stream and last:
                        yield chunk(sample.index, last)
                    choice.finish_reason = sample.finish_reason
                    called = choice.parser.has_tool_calls and plan.mode in ("auto", "required")
                    if called and choice.finish_reason == "stop":
                        choice.finish_reason = "tool_calls"
                    choice.stop_reason = sample.stop_reason
                    if request.stream:
                        yield chunk(
                            sample.index, {}, choice.finish_reason, stop_reason=sample.stop_reason
                        )
        completion_tokens = sum(c.num_tokens for c in choices.values())
        usage = self.ctx.usage(prompt_tokens, completion_tokens, cached)
        if self.report_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        if new_reasoning_parser is not None:  # OpenAI's and vLLM's field
            reasoning_tokens = sum(c.parser.num_reasoning_tokens for c in choices.values())
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        if request.stream:
            if request.include_usage or self.ctx.force_include_usage:
                yield f"data: {json.dumps({**chunk_base, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            return
        yield {
            **base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": c.index,
                    "message": _echoing(c.parser.message(role), request.echo, echoed),
                    "logprobs": {"content": c.logprobs} if request.logprobs else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **({"token_ids": c.token_ids} if request.return_token_ids else {}),
                }
                for c in sorted(choices.values(), key=lambda c: c.index)
            ],
            "usage": usage,
            **(
                {"prompt_logprobs": prompt_logprobs}
                if request.prompt_logprobs is not None or request.echo
                else {}
            ),
            **({"prompt_token_ids": prompt_ids} if request.return_token_ids else {}),
        }


def _echoing(message: dict, echo: bool, echoed: str) -> dict:
    """A choice's ``message`` with ``echo``: its content after the echoed text (vLLM's: a
    content-less message, such as a tool call's, gets the echoed text or "")."""
    if echo:
        message["content"] = echoed + (message["content"] or "")
    return message
