"""``POST /v1/completions``: text completions, streamed (SSE) or whole.

Choice ``i * n + j`` is sample ``j`` of prompt ``i``, the ``prompt_embeds`` (vLLM's:
base64 ``torch.save`` bytes, ``--enable-prompt-embeds``) counted before the ``prompt``'s.
``echo`` prepends each prompt (and, with ``logprobs``, the prompt tokens' logprobs, the
first one ``None``).
``max_tokens=0`` with ``echo`` scores the prompt without generating (lm-eval's
loglikelihood requests): the engine samples one token, which is dropped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.logprobs_format import LegacyLogprobs, prompt_logprobs_json
from pagedlm.entrypoints.openai.protocol import CompletionRequest
from pagedlm.entrypoints.openai.serving_engine import (
    ServingContext,
    merge_streams,
    reported_cached_tokens,
    stream_or_collect,
)
from pagedlm.outputs import CompletionOutput, RequestOutput


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    echoed: bool = False
    prompt_logprobs: list[dict | None] | None = None
    """vLLM extra, when the request asked for ``prompt_logprobs``."""
    token_ids: list[int] = field(default_factory=list)
    num_token_ids_sent: int = 0
    """How many of ``token_ids`` streamed chunks carried (``return_token_ids``)."""


class CompletionServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _decode(self, token_id: int) -> str:
        tokenizer = self.ctx.tokenizer
        return "" if tokenizer is None else tokenizer.decode([token_id])

    async def create(self, request: CompletionRequest) -> tuple[dict | None, AsyncIterator[str]]:
        """(response body, None) or (None, SSE event stream); raises ``APIError``."""
        ctx = self.ctx
        ctx.check_model(request.model)
        if request.suffix:
            raise APIError("suffix is not supported by this server.", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError("best_of is not supported; use n.", param="best_of")
        score_only = request.max_tokens == 0
        if score_only and not request.echo:
            raise APIError(
                "max_tokens=0 generates nothing; set echo=true to score the prompt or raise "
                "max_tokens.",
                param="max_tokens",
            )
        params = request.base_sampling_params(
            max_tokens=1 if score_only else request.max_tokens,
            logprobs=request.logprobs,
            defaults=ctx.sampling_defaults,
            grammar=ctx.grammar_check,
        )
        if request.echo and request.logprobs is not None:
            params.prompt_logprobs = max(params.prompt_logprobs or 0, request.logprobs)
        request_id = ctx.request_id("cmpl", request.request_id)
        prompts = request.prompts()
        if not request.add_special_tokens:
            tokenizer = ctx.require_tokenizer()
            prompts = await asyncio.to_thread(_without_special_tokens, tokenizer, prompts)
        prompts = await _embeds_prompts(ctx, request) + prompts  # vLLM's order: embeds first
        prompts = request.engine_prompts(prompts)
        lora = ctx.lora_request(request.model)
        beam = request.beam_search_params(request.max_tokens, ctx.max_model_len)
        if beam is not None and request.prompt_embeds:
            raise APIError(
                "use_beam_search takes text or token prompts, not prompt_embeds.",
                param="prompt_embeds",
            )
        if beam is not None and score_only:
            raise APIError("use_beam_search needs max_tokens >= 1.", param="max_tokens")
        started = await ctx.start_for(request, prompts, params, beam, request_id, lora)
        rows = [_embeds_rows(p, request.truncate_prompt_tokens) for p in prompts]
        events = self._events(request, request_id, started, score_only, rows)
        return await stream_or_collect(events, request.stream)

    def _new_choice(self, request: CompletionRequest, index: int) -> _Choice:
        logprobs = None
        if request.logprobs is not None:
            as_ids = self.ctx.tokens_as_ids(request.return_tokens_as_token_ids)
            logprobs = LegacyLogprobs(request.logprobs, self._decode, as_ids)
        return _Choice(index, logprobs=logprobs)

    def _fold(
        self,
        request: CompletionRequest,
        choice: _Choice,
        output: RequestOutput,
        sample: CompletionOutput,
        prompt_logprobs: list | None,
        score_only: bool,
    ) -> str:
        """Add one DELTA sample to ``choice``; returns the new text."""
        new_text = ""
        if request.prompt_logprobs is not None and choice.prompt_logprobs is None:
            choice.prompt_logprobs = prompt_logprobs_json(prompt_logprobs or [])
        if request.echo and not choice.echoed:
            choice.echoed = True
            prompt_text = output.prompt
            if prompt_text is None:
                prompt_text = (
                    self.ctx.tokenizer.decode(output.prompt_token_ids)
                    if self.ctx.tokenizer is not None
                    else ""
                )
            new_text += prompt_text
            if choice.logprobs is not None:
                positions = prompt_logprobs or [None] * len(output.prompt_token_ids)
                choice.logprobs.add(output.prompt_token_ids, positions)
        if not score_only:
            new_text += sample.text
            choice.num_tokens += len(sample.token_ids)
            choice.token_ids += sample.token_ids
            if choice.logprobs is not None and sample.logprobs is not None:
                choice.logprobs.add(sample.token_ids, sample.logprobs)
        if sample.finish_reason is not None:
            choice.finish_reason = sample.finish_reason
            choice.stop_reason = sample.stop_reason
        choice.text.append(new_text)
        return new_text

    async def _events(
        self,
        request: CompletionRequest,
        request_id: str,
        started,
        score_only: bool,
        embeds_rows: list[int],
    ) -> AsyncIterator:
        """SSE strings when streaming; otherwise yields the one response body at the end.
        ``embeds_rows``: each prompt's rows if given as embeddings (its usage), else 0."""
        n = request.n
        choices: dict[int, _Choice] = {}
        prompt_tokens = [
            len(first.prompt_token_ids) or rows
            for (first, _), rows in zip(started, embeds_rows, strict=True)
        ]
        base = {
            "id": request_id,
            "object": "text_completion",
            "created": self.ctx.created,
            "model": self.ctx.response_model(request.model),
        }
        prompt_logprobs: dict[int, list] = {}
        announced: set[int] = set()
        cached = [0] * len(started)
        # vLLM's usage counts one prompt's cached tokens: a stream the prompt of its first
        # output (here the first prompt: merge_streams yields the first outputs in order),
        # a whole response the last prompt's.
        counted = None if request.stream else len(started) - 1
        async for prompt_index, output in merge_streams(started):
            counted = prompt_index if counted is None else counted
            reported = reported_cached_tokens(output, request.stream)
            cached[prompt_index] = max(cached[prompt_index], reported)
            # DELTA outputs carry the prompt's logprobs once; later samples still echo them.
            if output.prompt_logprobs is not None:
                prompt_logprobs.setdefault(prompt_index, output.prompt_logprobs)
            for sample in output.outputs:
                index = prompt_index * n + sample.index
                choice = choices.get(index) or choices.setdefault(
                    index, self._new_choice(request, index)
                )
                text = self._fold(
                    request, choice, output, sample, prompt_logprobs.get(prompt_index), score_only
                )
                if not request.stream:
                    continue
                finish = choice.finish_reason if sample.finish_reason is not None else None
                chunk_logprobs = choice.logprobs.take() if choice.logprobs is not None else None
                first_chunk = index not in announced
                if not text and finish is None and not chunk_logprobs and not first_chunk:
                    continue
                announced.add(index)
                body = {
                    **base,
                    "choices": [
                        {
                            "index": index,
                            "text": text,
                            "logprobs": chunk_logprobs,
                            "finish_reason": finish,
                            "stop_reason": choice.stop_reason if finish else None,
                        }
                    ],
                }
                if first_chunk and choice.prompt_logprobs is not None:
                    body["choices"][0]["prompt_logprobs"] = choice.prompt_logprobs
                if request.continuous_usage:
                    body["usage"] = self.ctx.usage(prompt_tokens[prompt_index], choice.num_tokens)
                if request.return_token_ids:
                    extra = body["choices"][0]
                    if first_chunk:
                        extra["prompt_token_ids"] = output.prompt_token_ids
                    extra["token_ids"] = choice.token_ids[choice.num_token_ids_sent :]
                    choice.num_token_ids_sent = len(choice.token_ids)
                yield f"data: {json.dumps(body)}\n\n"
        usage = self.ctx.usage(
            sum(prompt_tokens), sum(c.num_tokens for c in choices.values()), cached[counted or 0]
        )
        prompt_ids = [first.prompt_token_ids for first, _ in started]
        if request.stream:
            if request.include_usage or self.ctx.force_include_usage:
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            return
        yield {
            **base,
            "choices": [
                {
                    "index": c.index,
                    "text": "".join(c.text),
                    "logprobs": c.logprobs.to_dict() if c.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **({"prompt_logprobs": c.prompt_logprobs} if c.prompt_logprobs else {}),
                    **(
                        {"prompt_token_ids": prompt_ids[c.index // n], "token_ids": c.token_ids}
                        if request.return_token_ids
                        else {}
                    ),
                }
                for c in sorted(choices.values(), key=lambda c: c.index)
            ],
            "usage": usage,
        }


def _without_special_tokens(tokenizer: Any, prompts: list[str | dict[str, Any]]) -> list[Any]:
    """Text prompts tokenized without the tokenizer's BOS (``add_special_tokens=false``);
    token-id prompts as they are."""
    return [
        {"prompt": p, "prompt_token_ids": tokenizer.encode(p, add_special_tokens=False)}
        if isinstance(p, str)
        else p
        for p in prompts
    ]


async def _embeds_prompts(ctx: ServingContext, request: CompletionRequest) -> list[Any]:
    """``prompt_embeds`` as engine prompts, decoded off the event loop; a 400 naming the
    problem (or the flag, on an engine without it)."""
    encoded = request.embeds_list()
    if not encoded:
        return []
    config = getattr(ctx.engine, "config", None)
    if config is not None and not config.model.enable_prompt_embeds:
        raise APIError(
            "prompt_embeds needs a server started with --enable-prompt-embeds.",
            param="prompt_embeds",
        )
    from pagedlm.engine.prompt_embeds import load_base64_embeds

    try:
        tensors = await asyncio.to_thread(lambda: [load_base64_embeds(e) for e in encoded])
    except ValueError as error:
        raise APIError(str(error), param="prompt_embeds") from None
    return [{"prompt_embeds": tensor} for tensor in tensors]


def _embeds_rows(prompt: Any, truncate_prompt_tokens: int | None) -> int:
    """The prompt rows an embeddings prompt feeds (0 for other prompts)."""
    tensor = prompt.get("prompt_embeds") if isinstance(prompt, dict) else None
    if tensor is None:
        return 0
    rows = tensor.shape[-2] if tensor.dim() > 1 else 0
    if truncate_prompt_tokens is not None and truncate_prompt_tokens >= 0:
        rows = min(rows, truncate_prompt_tokens)
    return rows
