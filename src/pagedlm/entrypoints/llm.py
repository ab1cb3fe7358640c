"""``LLM``: offline batch generation and chat, with vLLM's names and defaults (its pooling
API, ``encode``, ``embed``, ``classify``, ``reward`` and ``score``, in ``llm_pooling.py``)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from tqdm.auto import tqdm

from pagedlm.beam_search import BeamSearchOutput, BeamSearchParams
from pagedlm.chat_content import (
    ContentFormatOption,
    check_content_format,
    check_continuable,
    format_conversation,
    resolve_content_format,
    template_source,
)
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.core_profiler import CoreProfiler, profile_directory
from pagedlm.engine.exceptions import RequestFailedError, request_failure
from pagedlm.engine.input_processor import ProcessedRequest, PromptType, cache_salt_of
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.entrypoints.llm_args import (
    UseTqdm,
    check_conversations,
    one_per_prompt,
    per_prompt,
    prompt_list,
)
from pagedlm.entrypoints.llm_pooling import PoolingMethods
from pagedlm.lora.request import LoRARequest
from pagedlm.metrics import Metric
from pagedlm.multimodal.chat import has_images, load_chat_image, split_images
from pagedlm.outputs import Logprob, RequestOutput
from pagedlm.pooling import (
    PoolingRequestOutput,
)
from pagedlm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedlm.config import ModelConfig
    from pagedlm.worker.rpc import RpcMethod

Conversation = list[dict[str, Any]]

MAX_PREPROCESS_THREADS = 8
"""Threads that preprocess a batch's image prompts (the transformers image processor and
the content hash release the GIL for their heavy parts: resizing, normalizing, sha256)."""

T = TypeVar("T")
R = TypeVar("R")


def _progress_bar(use_tqdm: UseTqdm) -> Callable[..., Any]:
    return use_tqdm if callable(use_tqdm) else tqdm


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    params = copy.copy(params)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def _has_multimodal_data(prompt: PromptType) -> bool:
    return isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None


def _map_in_order(pool: ThreadPoolExecutor | None, fn: Callable[[T], R], items: list[T]) -> list[R]:
    """``[fn(item) for item in items]``, on ``pool`` when given: results in input order and,
    if any call raises, the error of the first such item, as the loop would raise it (the
    calls not yet started are cancelled; those running are waited for)."""
    if pool is None:
        return [fn(item) for item in items]
    futures: list[Future[R]] = [pool.submit(fn, item) for item in items]
    try:
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                future.exception()  # wait: nothing of this call runs on after it raises
        raise


def _raise_failures(request_ids: list[str], outputs: list[Any]) -> None:
    """A call whose every request finished, some failed by the engine core (a custom logits
    processor raised for them): ``RequestFailedError`` naming the first, by its prompt's
    place in the call, with every output on it."""
    failed = [(i, m) for i, out in enumerate(outputs) if (m := request_failure(out)) is not None]
    if not failed:
        return
    index, message = failed[0]
    more = f" ({len(failed) - 1} more of this call's prompts failed too)" if len(failed) > 1 else ""
    raise RequestFailedError(
        request_ids[index], f"(prompt {index} of the call) {message}{more}", outputs
    )


def _arrivals_in_prompt_order(processed: list[ProcessedRequest]) -> list[ProcessedRequest]:
    """Arrival times that never decrease in prompt order, as serial processing stamps them
    (the priority policy breaks ties by arrival; a parallel batch finishes out of order)."""
    out: list[ProcessedRequest] = []
    latest = float("-inf")
    for request in processed:
        if request.arrival_time < latest:
            request = dataclasses.replace(request, arrival_time=latest)
            for child in request.children:
                child.arrival_time = latest
        latest = request.arrival_time
        out.append(request)
    return out


class LLM(PoolingMethods):
    """An in-process engine for batch inference.

    >>> llm = LLM()                       # the embedded SmolLM2-135M-Instruct
    >>> llm.generate("Hello, my name is")[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        skip_tokenizer_init: bool = False,
        platform: str | None = None,
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(
                f"LLM() got unknown argument(s) {sorted(unknown)}; known engine arguments: "
                f"{sorted(EngineArgs.field_names())}."
            )
        # As vLLM's LLM: no metrics unless asked for (get_metrics needs them).
        kwargs.setdefault("disable_log_stats", True)
        args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            seed=seed,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            skip_tokenizer_init=skip_tokenizer_init,
            platform=platform,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._request_counter = itertools.count()
        self._preprocess_pool: ThreadPoolExecutor | None = None
        self._profiler = CoreProfiler()

    def _pool_for(self, num_image_prompts: int) -> ThreadPoolExecutor | None:
        """The preprocessing pool, for a batch with at least two image prompts (text is
        tokenized faster than a thread hand-off); started on first use."""
        if num_image_prompts < 2:
            return None
        if self._preprocess_pool is None:
            threads = min(MAX_PREPROCESS_THREADS, len(os.sched_getaffinity(0)))
            self._preprocess_pool = ThreadPoolExecutor(
                max(2, threads), thread_name_prefix="pagedlm-preprocess"
            )
        return self._preprocess_pool

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    @property
    def model_config(self) -> ModelConfig:
        """The resolved model configuration (``model``, ``dtype``, ``max_model_len``, ...)."""
        return self.llm_engine.config.model

    def start_profile(self, directory: str | None = None) -> None:
        """Start a torch profiler around the engine's steps in this process (vLLM's);
        ``stop_profile`` writes its trace into ``directory`` (default
        ``$PAGEDLM_TORCH_PROFILER_DIR``, or vLLM's ``$VLLM_TORCH_PROFILER_DIR``)."""
        self._profiler.start(profile_directory(directory))

    def stop_profile(self) -> None:
        self._profiler.stop()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without ``sampling_params``: pagedlm's
        defaults, with those of the model's generation config over them (vLLM's
        ``generation_config``, ``pagedlm.generation_config``). A new object each call."""
        return SamplingParams(**self.llm_engine.config.model.sampling_defaults)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics (vLLM's): needs ``LLM(..., disable_log_stats=False)``;
        ValueError otherwise."""
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's); False while requests hold KV blocks."""
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory the engine holds until ``wake_up`` (vLLM's sleep mode): the
        KV cache always; the weights move to host memory (``level=1``) or are dropped and
        read again on waking (``level=2``, for weights about to be replaced). Requests
        added meanwhile raise ValueError."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep`` (vLLM's): ``tags`` wakes one part at a time, "weights" (back on
        the device, or read again after level 2) and then "kv_cache" (a new, empty cache);
        None wakes both. A reinforcement-learning loop wakes the weights, replaces them
        (``update_weights_from_disk``/``_tensor``, ``collective_rpc``), then wakes the KV
        cache. Requests are admitted once both are awake; ValueError for an unknown tag or
        for the KV cache before the weights."""
        self.llm_engine.wake_up(tags)

    def update_weights_from_disk(self, model_path: str) -> None:
        """Replace the weights with those of the checkpoint at ``model_path`` (a local
        directory or ``.gguf`` file of the model's shape and format; SGLang's name), e.g.
        a trainer's between rollouts. The model is built again from them (kernels, graphs
        and an empty KV cache: cached prefixes are forgotten); a level-2 ``wake_up`` reads
        this checkpoint from then on. ValueError while requests run, while asleep, or for a
        checkpoint of another shape; if loading fails, the previous checkpoint's weights
        are loaded again."""
        self.llm_engine.update_weights_from_disk(model_path)

    def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Replace the weights with ``named_tensors`` (a state dict, or ``(name, tensor)``
        pairs, by the checkpoint's names; every weight of the model), as
        ``update_weights_from_disk`` does with a checkpoint (SGLang's name). Float
        checkpoints only (``quantization="fp8"`` or ``"bitsandbytes"`` quantize the given
        tensors as at load); with one worker in this process. A later level-2 ``wake_up``
        reads the checkpoint's weights, not these."""
        self.llm_engine.update_weights_from_tensor(named_tensors)

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run a method on every worker and return one result per worker, in rank order
        (vLLM's worker RPC, as RL frameworks use it). ``method``: the name of a worker
        method (the worker's own, e.g. ``"apply_model"``, or one that
        ``worker_extension_cls`` adds), or a function called as ``method(worker, *args,
        **kwargs)``. Workers in this process take any values; workers in other processes
        (``distributed_executor_backend="mp"`` or ``"ray"``) take msgspec-encodable values
        and functions by importable name, nothing pickled (``pagedlm.worker.rpc_codec``).
        A worker's exception raises ``WorkerRpcError`` naming its rank and the method, and
        the engine carries on; ``timeout`` (seconds) bounds the wait for worker processes
        (``TimeoutError``), not a call running in this process."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], R]) -> list[R]:
        """``func(model)`` on every worker's model (its shard under tensor parallelism);
        one result per worker (vLLM's). With worker processes ``func`` must be importable
        by name and its result msgspec-encodable."""
        return self.llm_engine.apply_model(func)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order. ``priority``: one
        value per prompt (lower first), for an engine with ``scheduling_policy="priority"``.
        ``lora_request``: the adapter of every prompt, or one (or None) per prompt; needs
        ``enable_lora=True``. ``tokenization_kwargs``: how text prompts are tokenized,
        e.g. ``{"add_special_tokens": False}`` (vLLM's;
        ``pagedlm.engine.tokenization_kwargs``). A request that a custom logits processor
        fails, or whose adapter cannot be read when a step needs it, raises
        ``RequestFailedError`` once the others finish (all outputs on it)."""
        if self.llm_engine.config.model.runner == "pooling":
            raise ValueError(
                "This model runs with runner='pooling', which does not generate; use "
                "LLM.embed(), LLM.classify(), LLM.score(), LLM.reward() or LLM.encode() (to "
                "generate, load "
                "a generative model with runner='generate')."
            )
        prompts = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = one_per_prompt(sampling_params, len(prompts), SamplingParams)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(
                f"Got {len(priorities)} priorities for {len(prompts)} prompts; pass exactly "
                "one per prompt."
            )
        loras = per_prompt(lora_request, len(prompts))
        # The offline API returns finished outputs only; skip building intermediate ones.
        params_list = [_final_only(p) for p in params_list]
        engine = self.llm_engine
        # Validate everything first: one bad prompt must not leave the others queued.
        # Image prompts are preprocessed in parallel, the first bad one's error raised.
        jobs = [
            (str(next(self._request_counter)), prompt, params, rank, lora, tokenization_kwargs)
            for prompt, params, rank, lora in zip(prompts, params_list, priorities, loras)
        ]
        pool = self._pool_for(sum(map(_has_multimodal_data, prompts)))
        processed = _map_in_order(pool, lambda job: engine.process_request(*job), jobs)
        if pool is not None:
            processed = _arrivals_in_prompt_order(processed)
        for request in processed:
            engine.add_processed_request(request)
        return self._run_engine([r.request_id for r in processed], use_tqdm)  # type: ignore[return-value]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: UseTqdm = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's): each prompt's ``params.beam_width`` best beams, best first
        (``pagedlm.beam_search``); every step sends all live beams to the engine at once,
        each with its prompt's ``cache_salt`` (prompts of different salts are searched one
        salt after the other)."""
        from pagedlm.beam_search import beam_prompt, search

        if not isinstance(params, BeamSearchParams):
            raise TypeError(
                f"beam_search takes a BeamSearchParams (beam_width, max_tokens, ...), got "
                f"{type(params).__name__}; use generate() for a SamplingParams."
            )
        engine = self.llm_engine
        processor = engine.input_processor
        token_prompts = []
        salts: list[str | None] = []
        for prompt in prompt_list(prompts):
            if _has_multimodal_data(prompt):
                raise ValueError("beam_search takes text or token-id prompts, not images.")
            if isinstance(prompt, Mapping) and "prompt_embeds" in prompt:
                raise ValueError(
                    "beam_search takes text or token-id prompts, not prompt_embeds (each "
                    "beam runs as a token prompt); use generate() for embeddings."
                )
            token_prompts.append(processor.tokenize(prompt)[1])
            salts.append(cache_salt_of(prompt))
        # One search per cache salt: a beam carries its prompt's salt, as its prompt would.
        groups: dict[str | None, list[int]] = {}
        for index, salt in enumerate(salts):
            groups.setdefault(salt, []).append(index)

        def step_for(salt: str | None) -> Callable[..., list[dict[int, Logprob]]]:
            def step(beams: list[list[int]], sampling: SamplingParams) -> list[dict[int, Logprob]]:
                outputs = self.generate(
                    [beam_prompt(tokens, salt) for tokens in beams],
                    sampling,
                    use_tqdm=False,
                    lora_request=lora_request,
                )
                return [output.outputs[0].logprobs[0] for output in outputs]  # type: ignore[index]

            return step

        tokenizer = self.get_tokenizer()
        total = params.max_tokens * len(groups)
        bar = (
            _progress_bar(use_tqdm)(total=total, desc="Beam search", unit="token")
            if use_tqdm
            else None
        )
        results: list[BeamSearchOutput | None] = [None] * len(token_prompts)
        try:
            for salt, indices in groups.items():
                found = search(
                    [token_prompts[index] for index in indices],
                    params,
                    step_for(salt),
                    set(processor.eos_token_ids),
                    engine.config.model.max_model_len,
                    None if tokenizer is None else tokenizer.decode,
                    None if bar is None else bar.update,
                    engine.config.model.max_logprobs,
                )
                for index, output in zip(indices, found, strict=True):
                    results[index] = output
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_content_format: ContentFormatOption = "auto",
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate.
        ``tools``: OpenAI-style tool definitions for the template to render (vLLM's).
        ``chat_template_content_format`` (vLLM's): message content as a string ("string":
        text parts joined with newlines), as OpenAI's list of parts ("openai"), or
        ("auto") as the template reads it (``pagedlm.chat_content``); conversations with
        images keep their parts for the processor's template. ``mm_processor_kwargs``
        (vLLM's): image processor options for the conversations with images, over
        ``--mm-processor-kwargs``."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer; do not set skip_tokenizer_init=True.")
        content_format = resolve_content_format(
            check_content_format(chat_template_content_format),
            template_source(tokenizer, chat_template, tools),
        )
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message=True continues the last message; set "
                "add_generation_prompt=False with it."
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        check_conversations(conversations)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(
                f"chat_template_kwargs must be a dict of template variables, got "
                f"{type(chat_template_kwargs).__name__}."
            )
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        if mm_processor_kwargs is not None:  # checked once, images or not
            self.llm_engine.input_processor.multimodal.processor_kwargs(mm_processor_kwargs)

        def to_prompt(conversation: Conversation) -> PromptType:
            if has_images(conversation):
                return self._multimodal_chat_prompt(
                    conversation,
                    mm_processor_kwargs,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(chat_template_kwargs or {}),
                )
            formatted = format_conversation(conversation, content_format)
            if continue_final_message:
                check_continuable(formatted)
            token_ids = tokenizer.apply_chat_template(
                formatted,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                return_dict=False,
                **(chat_template_kwargs or {}),
            )
            return {"prompt_token_ids": list(token_ids)}

        # Image conversations load their images (data URLs decoded, URLs fetched) in
        # parallel, like generate's preprocessing.
        conversations = list(conversations)
        pool = self._pool_for(sum(map(has_images, conversations)))
        prompts = _map_in_order(pool, to_prompt, conversations)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _multimodal_chat_prompt(
        self,
        conversation: Conversation,
        mm_processor_kwargs: dict[str, Any] | None,
        **template_kwargs: Any,
    ) -> dict[str, Any]:
        """A conversation with image parts as a ``multi_modal_data`` prompt, rendered by
        the model processor's chat template (one placeholder per image)."""
        inputs = self.llm_engine.input_processor.multimodal
        messages, parts = split_images(conversation)
        inputs.check_count("image", len(parts))
        if template_kwargs.get("continue_final_message"):
            check_continuable(messages)
        images = [load_chat_image(part, inputs.config) for part in parts]
        text = inputs.processor.render_chat(messages, **template_kwargs)
        prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        if mm_processor_kwargs is not None:
            prompt["mm_processor_kwargs"] = mm_processor_kwargs
        return prompt

    def _run_engine(
        self, request_ids: list[str], use_tqdm: UseTqdm
    ) -> list[RequestOutput | PoolingRequestOutput]:
        final: dict[str, RequestOutput | PoolingRequestOutput] = {}
        try:
            bar = _progress_bar(use_tqdm)(
                total=len(request_ids),
                desc="Processed prompts",
                dynamic_ncols=True,
                disable=not use_tqdm,
                postfix="est. speed input: 0 toks/s, output: 0 toks/s",
            )
            with bar:
                self._step_until_done(final, bar)
        except BaseException:
            # Nothing of this call stays queued: after a failed step (or Ctrl-C) its
            # requests would otherwise run in, or fail, every later call.
            self.llm_engine.abort_request([r for r in request_ids if r not in final])
            raise
        outputs = [final[r] for r in request_ids]
        _raise_failures(request_ids, outputs)
        return outputs

    def _step_until_done(
        self, final: dict[str, RequestOutput | PoolingRequestOutput], bar: Any
    ) -> None:
        """Step the engine until no request is left, each finished output into ``final``."""
        engine = self.llm_engine
        input_tokens = output_tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
                    input_tokens += len(out.prompt_token_ids or ())
                    if isinstance(out, RequestOutput):
                        output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    elapsed = bar.format_dict.get("elapsed") or 0
                    if elapsed > 0:
                        bar.set_postfix_str(
                            f"est. speed input: {input_tokens / elapsed:.0f} toks/s, "
                            f"output: {output_tokens / elapsed:.0f} toks/s",
                            refresh=False,
                        )
