"""``AsyncLLM``: streamed generation for asyncio code, the engine core in its own process.

The front end (this process) tokenizes and validates (``InputProcessor``), and
detokenizes, applies stop strings and assembles ``RequestOutput`` objects
(``OutputProcessor``); the engine core only sees token ids (see ``core_client``).

One background task per event loop pulls every ``CoreMessage`` and dispatches it: step
outputs go through the output processor into one ``RequestStream`` per user request;
utility answers resolve their futures; heartbeats feed ``CoreLiveness`` (``health()``).
When the core dies (the process exits, or it reports ``CoreFailed``) that task fails
every stream and future with ``EngineDeadError`` within ``DEATH_POLL_MS``, and every
later call raises it at once.

Tokenizing a long prompt and checking a grammar run on a worker thread
(``INLINE_PROMPT_CHARS``), so they never hold up other requests' streams or ``health()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedlm.beam_search import BeamSearchParams
from pagedlm.config import EngineConfig
from pagedlm.core.pause import PauseMode, check_mode
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.core_client import CoreClient
from pagedlm.engine.core_launch import CoreLaunch
from pagedlm.engine.core_profiler import profile_directory
from pagedlm.engine.exceptions import (
    EngineDeadError,
    EngineStalledError,
    RequestFailedError,
    request_failure,
)
from pagedlm.engine.health import CoreLiveness, EngineHealth
from pagedlm.engine.input_processor import (
    InputProcessor,
    ProcessedRequest,
    PromptType,
    cache_salt_of,
)
from pagedlm.engine.messages import (
    AbortRequests,
    AddRequests,
    CoreFailed,
    CoreOutputs,
    Heartbeat,
    Ready,
    RequestRejected,
    UtilityCall,
    UtilityResult,
    request_to_wire,
)
from pagedlm.engine.output_processor import OutputProcessor
from pagedlm.engine.request_stream import RequestStream
from pagedlm.gc_heap import freeze_startup_heap, thaw_heap
from pagedlm.lora.request import LoRARequest
from pagedlm.metrics import EngineMetrics, Metric
from pagedlm.metrics.stats import cache_info
from pagedlm.outputs import RequestOutput
from pagedlm.pooling import PoolingParams, PoolingRequestOutput
from pagedlm.pooling.requests import PairPrompt
from pagedlm.sampling_params import SamplingParams
from pagedlm.worker import rpc_codec
from pagedlm.worker.rpc import RpcMethod, check_call, method_label
from pagedlm.worker.sleep import check_tags

logger = logging.getLogger(__name__)
ErrorT = TypeVar("ErrorT", bound=BaseException)

DEATH_POLL_MS = 200
"""The output task checks that the core process is alive at least this often."""
HEALTH_TIMEOUT_S = 5.0
"""How long ``get_scheduler_stats`` waits for the core's answer."""
READY_TIMEOUT_S = 600.0
ADMIN_TIMEOUT_S = 600.0
"""How long ``sleep``/``wake_up`` and the profiler calls may take (a level-2 wake-up reloads
the weights; starting torch's profiler took 11 s on a loaded 2-core machine)."""
RPC_ANSWER_GRACE_S = 5.0
"""How much longer than a ``collective_rpc`` timeout the front end waits for the core's
answer (which, for worker processes, is the core's own ``TimeoutError``)."""
MAX_MESSAGES_PER_WAKEUP = 32
"""The output task handles at most this many waiting core messages before it lets the
consumers run (a bound on how long it holds the event loop: a few ms per message)."""
INLINE_PROMPT_CHARS = 4096
"""Prompts up to this long are tokenized on the event loop (well under a millisecond);
longer ones, and requests with a grammar to check, on ``_input_pool``."""
FRESH_HEARTBEAT_WAIT_S = 0.5
"""``health()`` of a silent core first waits this long for heartbeats the event loop has
not read yet (it may have been busy), before calling the core unresponsive; once per
silence, so a stopped core's later 503s come at once."""


class UtilityError(RuntimeError):
    """The engine core refused a utility call (its message says why)."""


def _fresh(error: ErrorT) -> ErrorT:
    """A copy of ``error`` to raise in one caller: raising the one shared instance in
    every waiter and every later call grew its traceback by each caller's frames,
    keeping them (and their locals) alive as long as the engine object."""
    return type(error)(*error.args)


class AsyncLLM:
    """An asyncio engine whose core runs in a child process.

    >>> engine = AsyncLLM.from_engine_args(EngineArgs(model="/path/to/model"))
    >>> async for output in engine.generate("Hello", SamplingParams(), "req-0"):
    ...     print(output.outputs[0].text)
    >>> engine.shutdown()
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        client: CoreClient,
        ready: Ready,
        args: EngineArgs | None = None,
    ):
        args = args or EngineArgs()
        self.config = config
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(
            config.model,
            tokenizer,
            config.structured_outputs_backend,
            config.scheduler.scheduling_policy,
            args.structured_outputs_max_spec_chars,
            lora_config=config.lora,
            multimodal_config=config.multimodal,
            logits_processors=config.logits_processors,
            compact_json=config.structured_outputs_compact_json,
            reasoning=config.structured_outputs_reasoning,
        )
        # Not at a lower priority: a niced thread descheduled while it holds the GIL stalls
        # the event loop (a 2.5M-character prompt: /health p99 202 ms niced, 57 ms not).
        self._input_pool = ThreadPoolExecutor(2, thread_name_prefix="pagedlm-input")
        self._liveness = CoreLiveness(
            args.engine_heartbeat_timeout_s, busy_num_waiting=config.scheduler.max_num_seqs
        )
        self._death_waiters: list[asyncio.Future] = []
        self.output_processor = OutputProcessor(tokenizer, config.scheduler.stream_interval)
        self.metrics = EngineMetrics(
            config.model.max_model_len,
            cache_info(config.cache, ready.num_kv_blocks),
            config.parallel.data_parallel_size,
        )
        self.num_kv_blocks = ready.num_kv_blocks
        self._client = client
        self._last_stats: SchedulerStats = ready.stats
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._output_task: asyncio.Task | None = None
        self._dead_error: EngineDeadError | None = None
        self._shut_down = False
        self.sleep_level = 0
        """0 awake; else the level of the last successful ``sleep``."""
        self._paused = False
        """``pause_generation`` was called: ``_run`` holds new requests until resumed."""
        self._resume_waiters: list[asyncio.Future] = []
        """Requests held by a pause (``resume_generation`` releases them)."""
        self._held: dict[object, str] = {}
        """A token per call a pause holds -> its request id (two calls may share one)."""
        self._aborted_holds: set[object] = set()
        """The tokens of held calls that ``abort`` ended."""
        self._idle_waiters: list[asyncio.Future] = []
        """``pause_generation(mode="wait")``, until no request is unfinished."""

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        core_launch: CoreLaunch | None = None,
        while_loading: Callable[[], object] | None = None,
    ) -> AsyncLLM:
        """Resolve the configuration, start the engine-core process (in ``core_launch``'s,
        started early, if given) and wait until it has loaded the model. Meanwhile this
        process loads the tokenizer and runs ``while_loading`` (the server imports itself)."""
        thaw_heap()  # a previous engine's frozen cycles
        config, _ = args.create_engine_config()
        # The core resolves the same arguments again; pin the model path it resolved here.
        client = CoreClient(dataclasses.replace(args, model=config.model.model), core_launch)
        try:
            tokenizer = None
            if not config.model.skip_tokenizer_init:
                from pagedlm.tokenizer import model_tokenizer

                tokenizer = model_tokenizer(config.model)
            if while_loading is not None:
                while_loading()
            ready = client.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            client.shutdown()
            raise
        engine = cls(config, tokenizer, client, ready, args)
        freeze_startup_heap("front end")
        return engine

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def errored(self) -> bool:
        """True once the engine core is dead or the engine was shut down."""
        return self._dead_error is not None

    @property
    def core_pid(self) -> int:
        """Process id of the engine core (for monitoring and fault tests)."""
        return self._client.process.pid

    # ------------------------------------------------------------------------- requests

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request, following ``sampling_params.output_kind``.
        ``priority`` (lower first) needs the engine's "priority" scheduling policy.
        ``tokenization_kwargs``: how a text prompt is tokenized (vLLM's;
        ``pagedlm.engine.tokenization_kwargs``).

        Bad input raises ``ValueError`` at the first ``__anext__``, before anything reaches
        the core. Closing the iterator early (or cancelling its task) aborts the request;
        ``abort(request_id)`` ends it without a further output. A dead core raises
        ``EngineDeadError``; a request the core failed (a custom logits processor raised
        for it, its adapter could not be read) raises ``RequestFailedError``, the other
        requests going on.
        """
        self._check_alive()
        self._ensure_output_task()
        self._check_unique(request_id)
        processed = await self._process(
            request_id, prompt, sampling_params, priority, lora_request, tokenization_kwargs
        )
        async with contextlib.aclosing(self._run(processed)) as outputs:
            async for output in outputs:  # closing early aborts the request at once
                yield output

    async def beam_search(
        self,
        prompt: PromptType,
        request_id: str,
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        *,
        generate: Callable[..., AsyncIterator[RequestOutput]] | None = None,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's beam search for one prompt (``pagedlm.beam_search``): one final output
        whose ``outputs`` are the ``beam_width`` best beams, best first (each one's
        generated tokens, text, cumulative logprob and logprobs). Each step runs every live
        beam as a request of its own; closing the iterator aborts them.

        ``generate``: what runs each beam's request, with ``generate``'s arguments
        (default: this engine's ``generate``); a server passes its own, which tracks the
        requests it must abort at shutdown. ``truncate_prompt_tokens`` and
        ``tokenization_kwargs`` (its ``truncation_side``) cut the prompt before the search,
        as a sampled request's (vLLM's server cuts every prompt before it is searched)."""
        from pagedlm.beam_search import engine_step, request_output, search_async

        self._check_alive()
        if isinstance(prompt, Mapping) and (
            prompt.get("multi_modal_data") is not None or "prompt_embeds" in prompt
        ):
            # Each beam runs as a prompt of token ids: images or embedding rows would be
            # dropped, their placeholder ids generated from (and prefix-cached) as text.
            raise ValueError(
                "use_beam_search takes text or token prompts, not images or prompt_embeds; "
                "sample with n instead, or send the prompt without them."
            )
        text, prompt_ids, _ = self.input_processor.prompt_token_ids(
            prompt, truncate_prompt_tokens, tokenization_kwargs
        )
        cache_salt = cache_salt_of(prompt)
        result = await search_async(
            prompt_ids,
            params,
            engine_step(generate or self.generate, request_id, lora_request, cache_salt),
            set(self.input_processor.eos_token_ids),
            self.config.model.max_model_len,
            self.config.model.max_logprobs,
        )
        tokenizer = self.get_tokenizer()
        decode = None if tokenizer is None else tokenizer.decode
        yield request_output(request_id, text, prompt_ids, result, decode)

    async def encode(
        self,
        prompt: PromptType | PairPrompt,
        pooling_params: PoolingParams | None,
        request_id: str,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """The one output of a pooling request (``outputs.data``: its vector, after
        ``pooling_params``; a classifier's label probabilities); needs a pooling model. A
        ``(text_1, text_2)`` tuple is a cross-encoder's pair. Errors, ``priority`` and
        ``tokenization_kwargs`` as in ``generate``."""
        from pagedlm.pooling.requests import process_pooling_request

        self._check_alive()
        self._ensure_output_task()
        self._check_unique(request_id)
        params = pooling_params or PoolingParams()
        processed = process_pooling_request(
            self.input_processor, request_id, prompt, params, tokenization_kwargs, priority
        )
        pooler = self.config.model.pooler
        assert pooler is not None
        async with contextlib.aclosing(self._run(processed)) as outputs:
            async for output in outputs:
                if not isinstance(output, PoolingRequestOutput):  # finished by "abort"
                    raise RuntimeError(
                        f"pooling request {request_id!r} was aborted (pause_generation) "
                        "before its vector was computed; send it again."
                    )
                output.outputs.data = params.finish(output.outputs.data, pooler)
                yield output

    async def _run(self, processed: ProcessedRequest) -> AsyncIterator[Any]:
        """Send a processed request to the core and stream its outputs (see ``generate``).
        While generation is paused the request waits here, before anything is recorded."""
        request_id = processed.request_id
        if self._paused:
            hold = object()
            self._held[hold] = request_id
            try:
                while self._paused and hold not in self._aborted_holds:
                    self._check_alive()
                    await self._wait_on(self._resume_waiters)
                if hold in self._aborted_holds:
                    return  # aborted while held: it never reached the core
            finally:
                del self._held[hold]
                self._aborted_holds.discard(hold)
        self._check_alive()
        self._check_unique(request_id)  # the same id may have started while we tokenized
        self.output_processor.add_request(
            request_id,
            processed.prompt,
            processed.prompt_token_ids,
            processed.params,
            [child.request_id for child in processed.children],
            processed.arrival_time,
            processed.children[0].lora_request,
        )
        num_prompt_tokens = len(processed.prompt_token_ids)
        stream = RequestStream(processed.params.output_kind, num_prompt_tokens * processed.params.n)
        self._streams[request_id] = stream
        finished = False
        try:
            self._client.send(
                AddRequests(request_id, [request_to_wire(c) for c in processed.children])
            )
            self.metrics.record_request(request_id, processed.children)
            while True:
                output = await stream.get()
                if output is None:  # aborted through abort()
                    finished = True
                    return
                finished = output.finished
                failure = request_failure(output)
                if failure is not None:  # its other samples, if any, are aborted
                    raise RequestFailedError(request_id, failure)
                yield output
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self._abort_now(request_id)

    def _check_unique(self, request_id: str) -> None:
        if not isinstance(request_id, str):  # the core would fail to decode the request
            raise TypeError(
                f"request_id must be a string, got {type(request_id).__name__}; e.g. "
                "str(uuid.uuid4())."
            )
        if request_id in self._streams:
            raise ValueError(
                f"Request id {request_id!r} is already in use; give each request a unique id."
            )

    async def _process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> ProcessedRequest:
        """``InputProcessor.process``: inline when cheap, else on a worker thread (it has no
        side effects, so a caller that gives up mid-way leaves nothing behind)."""
        text = prompt.get("prompt") if isinstance(prompt, Mapping) else prompt
        token_ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else None
        # Any shape of token ids: the input processor says what is wrong with a bad one.
        sized = text if isinstance(text, str) else token_ids
        size = len(sized) if isinstance(sized, Sized) else 0
        process = functools.partial(
            self.input_processor.process,
            request_id,
            prompt,
            params,
            priority,
            lora_request,
            tokenization_kwargs,
        )
        # Images and prompt embeddings (checked and converted whole) go to the pool too.
        has_images = isinstance(prompt, Mapping) and (
            prompt.get("multi_modal_data") or prompt.get("prompt_embeds") is not None
        )
        structured = getattr(params, "structured_outputs", None)  # process() checks the type
        if size <= INLINE_PROMPT_CHARS and structured is None and not has_images:
            return process()
        return await asyncio.get_running_loop().run_in_executor(self._input_pool, process)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (or several, vLLM's form); each one's ``generate`` iterator
        ends. Unknown ids are ignored."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not all(isinstance(one, str) for one in request_ids):
            raise TypeError(f"abort takes a request id or a list of them, got {request_id!r}.")
        for one in request_ids:
            self._abort_now(one)
            stream = self._streams.get(one)
            if stream is not None:
                stream.put(None)
            holds = [hold for hold, held_id in self._held.items() if held_id == one]
            if holds:  # waiting out a pause: each such call ends without being sent
                self._aborted_holds.update(holds)
                self._release(self._resume_waiters)  # the others wait again

    def _abort_now(self, request_id: str) -> None:
        self.metrics.forget_request(request_id)
        child_ids = self.output_processor.abort_requests([request_id])
        if child_ids and not self.errored:
            try:
                self._client.send(AbortRequests(child_ids))
            except EngineDeadError as error:
                self._fail(error)
        self._notify_if_idle()

    # ------------------------------------------------------------------------- health and stats

    async def health(self) -> EngineHealth:
        """The core's state from its heartbeat thread, answered without waiting for a step
        (see ``engine.health``); never raises."""
        if self._dead_error is None and not self._client.is_alive():
            self._fail(EngineDeadError(f"The engine core died: {self._client.exit_description()}."))
        if self._dead_error is None:
            self._ensure_output_task()
            if self._liveness.is_silent() and not self._liveness.silence_confirmed():
                waited = 0.0
                while self._liveness.is_silent() and waited < FRESH_HEARTBEAT_WAIT_S:
                    await asyncio.sleep(0.05)
                    waited += 0.05
                self._liveness.confirm_silence()
        dead = None if self._dead_error is None else str(self._dead_error)
        return self._liveness.assess(dead, self._last_stats)

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the core is dead, ``EngineStalledError`` if it is
        alive but makes no progress (stopped, frozen or hung in a step)."""
        self._check_alive()
        health = await self.health()
        if health.status == "dead":
            self._check_alive()
        if not health.live:
            raise EngineStalledError(health.reason)

    async def wait_until_dead(self) -> EngineDeadError:
        """Return the error once the core has died (or the engine was shut down)."""
        if self._dead_error is None:
            self._ensure_output_task()
            future = asyncio.get_running_loop().create_future()
            self._death_waiters.append(future)
            return await future
        return self._dead_error

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the model (ValueError naming the problem) and have
        every worker read it into its host cache (``LLMEngine.add_lora``). True."""
        self.input_processor.adapters.check(lora_request)
        lora = lora_request
        return bool(
            await self._admin_call(
                "add_lora", ADMIN_TIMEOUT_S, lora.lora_name, lora.lora_int_id, lora.lora_path
            )
        )

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (``LLMEngine.remove_lora``); False if it was not loaded."""
        removed = bool(await self._admin_call("remove_lora", ADMIN_TIMEOUT_S, int(lora_id)))
        self.input_processor.adapters.forget(lora_id)
        return removed

    async def list_loras(self) -> set[int]:
        """The ids of the adapters loaded: added, or read for a request since."""
        return set(await self._admin_call("list_loras", ADMIN_TIMEOUT_S))

    async def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter for good (``LLMEngine.pin_lora``); ValueError if it is
        not loaded."""
        return bool(await self._admin_call("pin_lora", ADMIN_TIMEOUT_S, int(lora_id)))

    async def get_scheduler_stats(self) -> SchedulerStats:
        """A fresh snapshot from the core (ordered after every earlier add and abort)."""
        return await self._call("get_stats", HEALTH_TIMEOUT_S)

    def get_metrics(self) -> list[Metric]:
        """Front-end counters plus the scheduler stats the core sent with its last step."""
        return self.metrics.snapshot(self._last_stats, self.sleep_level)

    # ------------------------------------------------------------------------- admin

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while requests hold KV blocks."""
        return bool(await self._call("reset_prefix_cache", HEALTH_TIMEOUT_S))

    async def pause_generation(
        self,
        *,
        mode: PauseMode = "abort",
        wait_for_inflight_requests: bool | None = None,
        clear_cache: bool = True,
    ) -> None:
        """Pause generation for a weight update (vLLM's, ``pagedlm.core.pause``): new
        requests wait, neither sent nor failed, until ``resume_generation``; in-flight ones
        end now with finish reason "abort" (``mode="abort"``), finish first ("wait"), or
        freeze until resumed ("keep"). ``clear_cache`` forgets the cached prefixes (kept
        requests then recompute their KV on resume). Returns once paused; the aborted
        requests' final outputs have reached their streams by then.
        ``wait_for_inflight_requests=True`` is the deprecated spelling of ``mode="wait"``."""
        if wait_for_inflight_requests:
            warnings.warn(
                "pause_generation(wait_for_inflight_requests=True) is deprecated; pass "
                "mode='wait'.",
                DeprecationWarning,
                stacklevel=2,
            )
            mode = "wait"
        check_mode(mode)
        self._check_alive()
        self._ensure_output_task()
        self._paused = True
        if mode == "wait":
            while self.output_processor.has_unfinished_requests():
                await self._wait_on(self._idle_waiters)
            if not self._paused:
                return  # resume_generation() came while waiting
        core_mode = "keep" if mode == "wait" else mode  # nothing is left to keep
        await self._admin_call("pause", ADMIN_TIMEOUT_S, core_mode, int(clear_cache))

    async def resume_generation(self) -> None:
        """Undo ``pause_generation``: kept requests continue, waiting ones are sent."""
        await self._admin_call("resume", ADMIN_TIMEOUT_S)
        self._paused = False
        self._release(self._resume_waiters)

    async def is_paused(self) -> bool:
        return self._paused

    async def _wait_on(self, waiters: list[asyncio.Future]) -> None:
        """Until ``_release(waiters)`` (or the engine dies: ``EngineDeadError``)."""
        future = asyncio.get_running_loop().create_future()
        waiters.append(future)
        try:
            await future
        finally:
            with contextlib.suppress(ValueError):
                waiters.remove(future)

    @staticmethod
    def _release(waiters: list[asyncio.Future], error: BaseException | None = None) -> None:
        for future in list(waiters):
            if not future.done():
                with contextlib.suppress(RuntimeError):  # its event loop is already closed
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(_fresh(error))
        waiters.clear()

    def _notify_if_idle(self) -> None:
        if self._idle_waiters and not self.output_processor.has_unfinished_requests():
            self._release(self._idle_waiters)

    async def sleep(self, level: int = 1) -> None:
        """Release device memory (level 1: weights to host memory; level 2: dropped) until
        ``wake_up``. ValueError while requests are unfinished or for a bad level; new
        requests meanwhile raise ValueError."""
        await self._admin_call("sleep", ADMIN_TIMEOUT_S, level)
        self.sleep_level = level

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep`` for the parts ``tags`` names (``LLM.wake_up``): "weights" back on
        the device (level 2: loaded again), "kv_cache" an empty KV cache; None: both. The
        engine sleeps (``is_sleeping``) until both are awake. ValueError for an unknown
        tag or for the KV cache before the weights."""
        if tags is not None:
            tags = list(check_tags(tags))
            if not tags:
                return
        still_asleep = await self._admin_call("wake_up", ADMIN_TIMEOUT_S, *(tags or ()))
        if not still_asleep:
            self.sleep_level = 0

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Load the checkpoint at ``model_path`` (the model's shape and format) in place of
        the current weights (``LLM.update_weights_from_disk``). ValueError while requests
        run, while asleep, or for another shape; the previous weights come back if it fails.
        """
        await self._admin_call("update_weights_from_disk", ADMIN_TIMEOUT_S, model_path)

    async def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    async def start_profile(self, directory: str | None = None) -> None:
        """Start a torch profiler in the engine core; ``stop_profile`` writes its trace
        into ``directory`` (default ``$PAGEDLM_TORCH_PROFILER_DIR``, or vLLM's
        ``$VLLM_TORCH_PROFILER_DIR``)."""
        await self._admin_call("start_profile", ADMIN_TIMEOUT_S, profile_directory(directory))

    async def stop_profile(self) -> None:
        await self._admin_call("stop_profile", ADMIN_TIMEOUT_S)

    async def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run a method on every worker of the engine core; one result per worker, in
        rank order (``LLM.collective_rpc``). The engine core is another process, so
        ``method`` is a worker method's name or a function importable by name, and the
        values are msgspec-encodable (``pagedlm.worker.rpc_codec``: ``TypeError``
        otherwise, before anything is sent). ``WorkerRpcError`` names the rank whose call
        raised; ``TimeoutError`` after ``timeout`` seconds (the call may still be running)."""
        check_call(method, timeout)
        payload = rpc_codec.encode_call(method, args, kwargs or {}, timeout)
        label = method_label(method)
        # The core bounds its wait for worker processes by ``timeout``; this bounds the wait
        # for the core, whose own worker (the "uni" executor) nothing can interrupt.
        wait = None if timeout is None else timeout + RPC_ANSWER_GRACE_S
        late = TimeoutError(
            f"collective_rpc {label!r}: the engine core did not answer within {timeout} s; the "
            "call may still be running there (requests wait for it). Pass a larger timeout."
        )
        reply = await self._call("collective_rpc", wait, payload=payload, late=late)
        return rpc_codec.results_of(reply)

    async def _admin_call(self, method: str, timeout_s: float, *args: int | str) -> Any:
        """A utility call whose refusal (the core's error) is the caller's ValueError."""
        try:
            return await self._call(method, timeout_s, *args)
        except UtilityError as error:
            raise ValueError(str(error)) from None

    async def _call(
        self,
        method: str,
        timeout_s: float | None,
        *args: int | str,
        payload: bytes = b"",
        late: Exception | None = None,
    ) -> Any:
        """The core's answer; past ``timeout_s`` (None: no bound), ``late`` is raised, or
        ``EngineDeadError``: a core that does not answer a quick call is hung."""
        self._check_alive()
        self._ensure_output_task()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._client.send(UtilityCall(call_id, method, list(args), payload))
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:  # not yet TimeoutError itself on Python 3.10
            if late is not None:
                raise late from None
            raise EngineDeadError(
                f"The engine core did not answer {method!r} within {timeout_s:.0f} s; it is "
                "hung or overloaded."
            ) from None
        finally:
            self._calls.pop(call_id, None)

    def _check_alive(self) -> None:
        if self._dead_error is None and not self._client.is_alive():
            self._fail(EngineDeadError(f"The engine core died: {self._client.exit_description()}."))
        if self._dead_error is not None:
            raise _fresh(self._dead_error)

    # ------------------------------------------------------------------------- output task

    def _ensure_output_task(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._output_task
        if task is None or task.done() or task.get_loop() is not loop:
            # A task from an earlier, finished event loop (asyncio.run) is replaced.
            self._output_task = loop.create_task(self._output_loop(), name="pagedlm-output")

    async def _output_loop(self) -> None:
        try:
            while True:
                message = await self._client.recv(DEATH_POLL_MS)
                if message is None:
                    if not self._client.is_alive():
                        description = self._client.exit_description()
                        self._fail(EngineDeadError(f"The engine core died: {description}."))
                        return
                    continue
                self._handle(message)
                # Take every step that is already waiting before the consumers run: their
                # outputs then merge in the streams (one SSE event per request per wake-up,
                # not per step), so a front end that falls behind catches up instead of
                # handing out one step's tokens per pass of the event loop.
                for _ in range(MAX_MESSAGES_PER_WAKEUP - 1):
                    if self._dead_error is not None:
                        break
                    message = self._client.recv_nowait()
                    if message is None:
                        break
                    self._handle(message)
                if self._dead_error is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logger.exception("pagedlm output task failed")
            self._fail(EngineDeadError(f"The engine's output handler failed: {error!r}"))

    def _handle(self, message: Any) -> None:
        if isinstance(message, CoreOutputs):
            self._handle_outputs(message)
        elif isinstance(message, UtilityResult):
            if message.stats is not None:
                self._last_stats = message.stats
                self.metrics.record_stats(message.stats)
            future = self._calls.pop(message.call_id, None)
            if future is not None and not future.done():
                if message.error is not None:
                    future.set_exception(UtilityError(message.error))
                elif message.payload is not None:
                    future.set_result(message.payload)
                elif message.value is not None:
                    future.set_result(message.value)
                else:
                    future.set_result(message.stats)
        elif isinstance(message, RequestRejected):
            self.output_processor.abort_requests([message.parent_id])
            stream = self._streams.get(message.parent_id)
            self.metrics.forget_request(message.parent_id)
            if stream is not None:
                stream.put(ValueError(message.message))
            self._notify_if_idle()
        elif isinstance(message, Heartbeat):
            self._liveness.record(message)
        elif isinstance(message, CoreFailed):
            self._fail(EngineDeadError(f"The engine core failed:\n{message.message}"))
        else:
            logger.warning("ignoring unexpected engine-core message %s", type(message).__name__)

    def _handle_outputs(self, message: CoreOutputs) -> None:
        self._last_stats = message.stats
        self.metrics.record_stats(message.stats)
        outputs = message.outputs
        self.metrics.record_outputs(outputs, message.timestamp or None)
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            # Finished by a stop string, which only the front end can see.
            self.metrics.record_stopped(processed.reqs_to_abort)
            self._client.send(AbortRequests(processed.reqs_to_abort))
        for output in processed.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
        self._notify_if_idle()

    def _fail(self, error: EngineDeadError) -> None:
        """Mark the engine dead and wake every waiter with ``error`` (first error wins)."""
        if self._dead_error is not None:
            return
        self._dead_error = error
        if not self._shut_down:
            logger.error("%s", error)
        for stream in self._streams.values():
            stream.put(_fresh(error))
        self._release(list(self._calls.values()), error)
        self._calls.clear()
        self._release(self._resume_waiters, error)
        self._release(self._idle_waiters, error)
        for future in self._death_waiters:
            if not future.done():
                with contextlib.suppress(RuntimeError):
                    future.set_result(error)
        self._death_waiters.clear()

    # ------------------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stop the engine core and release the sockets; idempotent. Pending requests end
        with ``EngineDeadError``."""
        if self._shut_down:
            return
        self._shut_down = True
        self._fail(EngineDeadError("The engine has been shut down."))
        task = self._output_task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # its event loop is already closed
                task.cancel()
        self._input_pool.shutdown(wait=False, cancel_futures=True)
        self._client.shutdown()
        thaw_heap()
