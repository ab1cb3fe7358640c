"""What every endpoint shares: model-name checks, the chat template (off the event loop:
``chat_template.py``), and streaming generation that always ends (finished, failed,
aborted on disconnect, or cut at shutdown).

``ServingContext.generate`` asks the engine for DELTA outputs; endpoints accumulate them
for non-streaming responses.

Shutdown: ``begin_shutdown(timeout_s)`` (on SIGTERM) lets in-flight requests run for
``timeout_s`` seconds, then aborts those still generating, whose handlers get
``APIError`` 503: a stream ends with an error event (and ``[DONE]`` for OpenAI), a
plain request answers the JSON error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from pagedlm.beam_search import BeamSearchParams
from pagedlm.chat_content import check_content_format
from pagedlm.engine.concurrent_requests import final_output, gather_all
from pagedlm.engine.exceptions import EngineDeadError
from pagedlm.entrypoints.openai.chat_template import ChatTemplateRenderer
from pagedlm.entrypoints.openai.errors import APIError, from_value_error
from pagedlm.entrypoints.openai.http_options import MAX_LOGGED_PROMPT_CHARS
from pagedlm.entrypoints.openai.limits import RequestLimits
from pagedlm.entrypoints.openai.middleware import INCOMING_REQUEST_ID
from pagedlm.entrypoints.openai.request_log import OutputLog, log_received
from pagedlm.entrypoints.openai.serving_lora import LoRARegistry
from pagedlm.entrypoints.openai.structured_request import GrammarCheck
from pagedlm.lora.request import LoRARequest
from pagedlm.metrics.prometheus import PrometheusMetrics
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import SamplingParams
from pagedlm.structured_output.params import DEFAULT_MAX_SPEC_CHARS

T = TypeVar("T")
logger = logging.getLogger("pagedlm.server")

SHUTDOWN_MESSAGE = (
    "The server is shutting down and its --shutdown-timeout ran out before this request "
    "finished; send it again (to another replica)."
)


@dataclass
class ServingContext:
    """State shared by the handlers of one server."""

    engine: Any
    """An ``AsyncLLM`` (or anything with its interface)."""
    model_names: list[str]
    """Names a request's ``model`` may use; the first is reported in responses."""
    metrics: PrometheusMetrics
    chat_template: str | None = None
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """``--default-chat-template-kwargs``: every chat template render gets these under the
    request's own ``chat_template_kwargs``."""
    chat_template_content_format: str = "auto"
    """``--chat-template-content-format``: message content as a string, OpenAI's list of
    parts, or ("auto") whichever the template reads (``pagedlm.chat_content``)."""
    tokenizer: Any = None
    max_model_len: int = 0
    tool_parser: str | None = None
    """``--tool-call-parser``: how ``tool_choice="auto"`` reads calls from the text."""
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    """``--reasoning-parser``: splits ``reasoning_content`` from chat answers."""
    structured_outputs_after_reasoning: bool = False
    """The engine applies a request's grammar after the model's thought (it has the
    reasoning parser's markers: ``EngineConfig.structured_outputs_reasoning``), so a
    constrained output may start with a thought; False: from the first output token."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """The ``--max-...`` caps on a request's list sizes."""
    trust_request_chat_template: bool = False
    """``--trust-request-chat-template``: render a request's own chat_template (sandboxed)."""
    loras: LoRARegistry = field(default_factory=LoRARegistry)
    """The LoRA adapters a request's ``model`` may name."""
    structured_outputs_backend: str = "xgrammar"
    """The engine's grammar backend (what a request's ``guided_decoding_backend`` must name)."""
    structured_outputs_max_spec_chars: int = DEFAULT_MAX_SPEC_CHARS
    """``--structured-outputs-max-spec-chars``: the longest schema or grammar compiled."""
    runner: str = "generate"
    """The engine's runner: "pooling" serves /v1/embeddings, /classify, /score, /rerank and
    /pooling, and answers 400 to generation."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """The model's defaults for sampling fields a request leaves unset (its generation
    config: ``ModelConfig.sampling_defaults``); ``max_tokens`` there caps every request's."""
    tracer: Any = None
    """A ``tracing.RequestTracer`` with ``--otlp-traces-endpoint``, else None."""
    enable_prompt_tokens_details: bool = False
    """``--enable-prompt-tokens-details``: usage reports the prompt's cached tokens."""
    return_tokens_as_token_ids: bool = False
    """``--return-tokens-as-token-ids``: the default of the request field."""
    force_include_usage: bool = False
    """``--enable-force-include-usage``: streams end with the usage chunk whether or not
    the request asks (``stream_options.include_usage``)."""
    tokenizer_info_endpoint: bool = False
    """``--enable-tokenizer-info-endpoint``: serve ``GET /tokenizer_info``."""
    log_error_stack: bool = False
    """``--log-error-stack``: log the traceback of every exception answered as an error."""
    exclude_tools_when_tool_choice_none: bool = False
    """``--exclude-tools-when-tool-choice-none``: such requests' templates see no tools."""
    response_role: str = "assistant"
    """``--response-role``: the role of chat completions' messages."""
    log_requests: bool = False
    """``--enable-log-requests``: one INFO line per engine request (its id, prompt and
    parameters)."""
    log_outputs: bool = False
    """``--enable-log-outputs`` (with ``log_requests``): an INFO line per completion when
    its request finishes."""
    log_deltas: bool = True
    """``--enable-log-deltas`` (with ``log_outputs``): a line per streamed piece too."""
    max_log_len: int = MAX_LOGGED_PROMPT_CHARS
    """``--max-log-len``: the most characters of a logged prompt or output."""
    created: int = field(default_factory=lambda: int(time.time()))
    _counter: itertools.count = field(default_factory=itertools.count)
    _background: set[asyncio.Task] = field(default_factory=set)
    _generating: set[str] = field(default_factory=set)
    """Engine request ids with a ``generate`` running (what shutdown must cut)."""
    _shutdown_expired: bool = False
    _templates: ChatTemplateRenderer | None = None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def grammar_check(self) -> GrammarCheck:
        """What a request's constraints are checked against as they are built from its
        body (the engine's backend and spec limit), so their 400s name the body's field."""
        return GrammarCheck(self.structured_outputs_backend, self.structured_outputs_max_spec_chars)

    def reasoning_parser_class(self, forced_call: bool = False) -> Any:
        """The ``--reasoning-parser`` class (None: no parser) for a request; none for a
        forced tool call (``tool_choice`` required or named) where the engine applies its
        grammar from the first token, which leaves no room for a thought."""
        from pagedlm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

        if not self.reasoning_parser or (
            forced_call and not self.structured_outputs_after_reasoning
        ):
            return None
        return get_reasoning_parser(self.reasoning_parser)

    def log_request(self, request_id: str, prompt: Any, params: Any) -> OutputLog | None:
        """Logs the request with ``--enable-log-requests``; its output log with
        ``--enable-log-outputs`` too."""
        if not self.log_requests:
            return None
        log_received(request_id, prompt, params, self.max_log_len)
        return (
            OutputLog(request_id, self.log_deltas, self.max_log_len) if self.log_outputs else None
        )

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """A request's ``return_tokens_as_token_ids``, the server's flag when unset."""
        return self.return_tokens_as_token_ids if requested is None else requested

    def usage(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> dict[str, Any]:
        """A response's ``usage``; with ``--enable-prompt-tokens-details`` and a
        ``cached_tokens`` (the prompt's tokens the prefix cache served, 0 included, as
        vLLM's since it stopped omitting a zero count), its ``prompt_tokens_details``. A
        stream's running usage (``continuous_usage_stats``) passes none, as vLLM's
        chunks carry none."""
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.enable_prompt_tokens_details and cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage

    def request_id(self, prefix: str, requested: str | None = None) -> str:
        """``prefix-<the client's X-Request-Id>``, else ``prefix-<requested>`` (the body's
        ``request_id``), else a fresh one (vLLM's order). A client's id still in use by
        another of its requests makes the engine refuse the new one (400)."""
        base = INCOMING_REQUEST_ID.get() or requested
        if base:
            return f"{prefix}-{base}"
        return f"{prefix}-{uuid.uuid4().hex[:16]}-{next(self._counter)}"

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names and name not in self.loras:
            served = self.model_names + list(self.loras.adapters)
            raise APIError(
                f"The model {name!r} does not exist; this server serves {served}.",
                status=404,
                param="model",
            )

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response reports: the adapter's name for an adapter (as vLLM),
        else the first served name."""
        is_adapter = model in self.loras and model not in self.model_names
        return model if is_adapter else self.model_name

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model, whose served names
        win over an adapter's, as in vLLM); 404 for a name unloaded since ``check_model``."""
        self.check_model(model)
        return None if model in self.model_names else self.loras.get(model)

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(
                "This server runs without a tokenizer (--skip-tokenizer-init); send token ids."
            )
        return self.tokenizer

    def chat_templates(self) -> ChatTemplateRenderer:
        if self._templates is None:
            self._templates = ChatTemplateRenderer(
                self.require_tokenizer(),
                self.chat_template,
                self.trust_request_chat_template,
                self.default_chat_template_kwargs,
                check_content_format(self.chat_template_content_format),
            )
        return self._templates

    async def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any],
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Prompt token ids of ``conversation`` rendered with the (request's or server's)
        template, off the event loop."""
        return await self.chat_templates().render(
            conversation,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            template_kwargs,
            add_special_tokens,
        )

    def spawn(self, awaitable: Awaitable[Any]) -> None:
        """Run ``awaitable`` in the background, keeping a reference until it is done."""
        task = asyncio.ensure_future(awaitable)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's DELTA outputs for one prompt (the engine observes its metrics),
        logged (``--enable-log-requests``) and traced (``--otlp-traces-endpoint``);
        ``tokenization_kwargs`` as the engine's ``generate`` takes them (None: none).

        Leaving early (client gone, error elsewhere) aborts the request, even from inside a
        cancelled task, because the abort runs as its own task.
        """
        return self._outputs(
            prompt,
            params,
            request_id,
            priority,
            lora_request,
            log_and_trace=True,
            tokenization_kwargs=tokenization_kwargs,
        )

    def _beam_request(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """One step of one beam (``start_beam_search``): ``generate`` without its logging
        and tracing, since the search, not each of its steps, is the client's request."""
        return self._outputs(
            prompt, params, request_id, priority, lora_request, log_and_trace=False
        )

    async def _outputs(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        priority: int,
        lora_request: LoRARequest | None,
        log_and_trace: bool,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """What ``generate`` and ``_beam_request`` share: refused once shutdown has expired,
        on a pooling runner (beam searches are refused before) or for an id in use; the
        request registered as generating (``_tracked``); ``log_and_trace``: logged and traced."""
        if self._shutdown_expired:
            raise APIError(SHUTDOWN_MESSAGE, status=503)
        if self.runner == "pooling":
            raise APIError(
                "This model is served with --runner pooling, which does not generate; use "
                "/v1/embeddings for an embedding model, /classify, /score or /rerank for a "
                "classifier (to generate, serve a generative model with --runner generate)."
            )
        self._check_unused(request_id)
        output_log = self.log_request(request_id, prompt, params) if log_and_trace else None
        # Passed only when given: an engine whose generate lacks the keyword still serves.
        extra = {} if tokenization_kwargs is None else {"tokenization_kwargs": tokenization_kwargs}
        stream = self.engine.generate(prompt, params, request_id, priority, lora_request, **extra)
        if log_and_trace and self.tracer is not None:
            stream = self.tracer.trace(stream, request_id, params)
        async with contextlib.aclosing(self._tracked(stream, request_id)) as outputs:
            async for output in outputs:
                if output_log is not None:
                    output_log.add(output)
                yield output

    def _check_unused(self, request_id: str) -> None:
        if request_id in self._generating:
            # Refused here, before ``_tracked``'s cleanup could abort the request holding it.
            raise APIError(
                f"Request id {request_id!r} is already in use; give each request a unique "
                "id (X-Request-Id, request_id).",
            )

    async def _tracked(
        self, stream: AsyncIterator[RequestOutput], request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """``stream`` registered as generating (what shutdown aborts); leaving it early
        aborts its request."""
        finished = False
        self._generating.add(request_id)
        try:
            async for output in stream:
                finished = output.finished
                yield output
            if not finished and self._shutdown_expired:
                raise APIError(SHUTDOWN_MESSAGE, status=503)
        finally:
            self._generating.discard(request_id)
            if not finished:
                self.spawn(self._abort_quietly(request_id))
            await stream.aclose()

    def begin_shutdown(self, timeout_s: float) -> None:
        """Called once the server stops accepting connections: in ``timeout_s`` seconds,
        abort what still generates (its handlers then answer 503)."""
        asyncio.get_running_loop().call_later(max(timeout_s, 0.0), self._expire_requests)

    def _expire_requests(self) -> None:
        self._shutdown_expired = True
        for request_id in list(self._generating):
            self.spawn(self._abort_quietly(request_id))

    async def _abort_quietly(self, request_id: str) -> None:
        with contextlib.suppress(EngineDeadError):
            await self.engine.abort(request_id)

    async def start(
        self,
        prompts: list[Any],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]:
        """Start one request per prompt and wait for each one's first output.

        Input errors surface here (``APIError`` 400) before any response is sent; then no
        request of the batch stays in the engine.
        """
        streams = [
            self.generate(
                prompt, params, f"{request_id}-{i}", priority, lora_request, tokenization_kwargs
            )
            for i, prompt in enumerate(prompts)
        ]
        firsts = await asyncio.gather(
            *(anext(stream) for stream in streams), return_exceptions=True
        )
        failure = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failure is not None:
            for stream in streams:
                await stream.aclose()
            if isinstance(failure, ValueError):
                raise from_value_error(failure) from failure
            raise failure
        return list(zip(firsts, streams))

    async def start_for(
        self,
        request: Any,
        prompts: list[Any],
        params: SamplingParams,
        beam: BeamSearchParams | None,
        request_id: str,
        lora_request: LoRARequest | None,
    ) -> list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]:
        """``start``, or ``start_beam_search`` where the request asked for beams (``beam``),
        with a completions or chat request's priority and prompt truncation."""
        if beam is not None:
            return await self.start_beam_search(
                prompts,
                beam,
                request_id,
                lora_request,
                request.truncate_prompt_tokens,
                request.tokenization_kwargs(),
            )
        return await self.start(
            prompts, params, request_id, request.priority, lora_request,
            request.tokenization_kwargs(),
        )  # fmt: skip

    async def start_beam_search(
        self,
        prompts: list[Any],
        params: BeamSearchParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]:
        """``start`` for vLLM's ``use_beam_search``: each prompt's search runs to the end
        (``AsyncLLM.beam_search``), and its one output holds the beams as its samples.
        ``truncate_prompt_tokens`` and ``tokenization_kwargs`` cut each prompt first, as
        ``start``'s requests are cut."""
        if self.runner == "pooling":
            raise APIError("This model is served with --runner pooling, which does not generate.")
        # Passed only when given: an engine whose beam_search lacks them still serves.
        cut: dict[str, Any] = {}
        if truncate_prompt_tokens is not None:
            cut["truncate_prompt_tokens"] = truncate_prompt_tokens
        if tokenization_kwargs is not None:
            cut["tokenization_kwargs"] = tokenization_kwargs
        searches = (
            final_output(
                self.engine.beam_search(
                    prompt,
                    f"{request_id}-{i}",
                    params,
                    lora_request,
                    generate=self._beam_request,
                    **cut,
                )
            )
            for i, prompt in enumerate(prompts)
        )
        try:
            finals = await gather_all(searches)
        except ValueError as error:
            raise from_value_error(error) from error
        return [(final, _nothing()) for final in finals]


def reported_cached_tokens(output: RequestOutput, stream: bool) -> int:
    """What of ``output`` a response's ``cached_tokens`` counts, as vLLM's: a streamed one
    the first sample's count (vLLM's stream keeps its first output's, the first child's:
    for a new prompt 0, the later samples finding the blocks it computed), a whole one the
    request's (vLLM's final output carries the last child to finish; here the most any
    sample was served, the same when they finish together). A response reports the most
    its outputs give."""
    if not stream:
        return output.num_cached_tokens
    return max((s.num_cached_tokens for s in output.outputs if s.index == 0), default=0)


async def _nothing() -> AsyncIterator[RequestOutput]:
    return
    yield  # an async generator that yields nothing


async def merge_streams(
    started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several started streams, in arrival order."""
    for index, (first, _) in enumerate(started):
        yield index, first
    if len(started) == 1:
        async for output in started[0][1]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output, None))
            queue.put_nowait((index, None, None))
        except Exception as error:
            queue.put_nowait((index, None, error))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, (_, stream) in enumerate(started)]
    try:
        remaining = len(tasks)
        while remaining:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_or_collect(
    events: AsyncIterator[T], stream: bool
) -> tuple[T | None, AsyncIterator[T] | None]:
    """A handler's answer: ``(None, events)`` when ``stream`` (sent as they come); else the
    events run to the end here and the last one, the whole response body, is ``(body, None)``.
    """
    if stream:
        return None, events
    body = None
    async for event in events:
        body = event
    return body, None


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, but cancel it (aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()
