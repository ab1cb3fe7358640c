"""Turns a user prompt and SamplingParams into validated engine-core requests.

Every check happens here, before anything enters the engine, so a bad request raises
``ValueError`` without disturbing the others.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pagedlm.config import LoRAConfig, ModelConfig, MultiModalConfig, ReasoningMarkers
from pagedlm.core.request import Request
from pagedlm.engine.prompt_embeds import checked_prompt_embeds, embeds_of
from pagedlm.engine.tokenization_kwargs import (
    check_tokenization_kwargs,
    encode_text,
    pads,
    pretokenized_limit,
    tighter,
    truncate_ids,
)
from pagedlm.inputs import PromptType
from pagedlm.lora.frontend import AdapterChecker
from pagedlm.lora.request import LoRARequest
from pagedlm.sampling_params import SamplingParams
from pagedlm.step.multimodal import MultiModalFeature

UINT64_RANGE = 2**64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    """Resolved: max_tokens set, stop token ids filled in."""
    children: list[Request]
    """One engine-core request per sample (``n`` of them)."""
    arrival_time: float


def _token_id_list(token_ids: object) -> list[int]:
    """``prompt_token_ids`` as a list of ints (NumPy's and integer tensors' elements too);
    a float or a string is an error, not a token id rounded or parsed."""
    usage = "prompt_token_ids must be a list of token ids (integers)"
    if isinstance(token_ids, str | bytes | Mapping) or not hasattr(token_ids, "__iter__"):
        raise ValueError(f"{usage}, got {type(token_ids).__name__}.")
    ids = []
    for token_id in token_ids:
        try:
            if isinstance(token_id, bool):
                raise TypeError
            ids.append(operator.index(token_id))
        except TypeError:
            raise ValueError(f"{usage}, got {token_id!r} in them.") from None
    return ids


def cache_salt_of(prompt: object) -> str | None:
    """A prompt's ``cache_salt`` (None: it has none): requests with different salts never
    share prefix-cache blocks. ValueError unless it is a non-empty string."""
    cache_salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt must be a non-empty string.")
    return cache_salt


def checked_params(params: object) -> SamplingParams:
    """A copy of ``params`` checked again: a field set after the object was built (users
    set ``max_tokens`` and the like on a shared object) skipped its checks, and a bad one
    would fail in an engine step, for every request in it."""
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"sampling_params must be a SamplingParams, got {type(params).__name__}; e.g. "
            "SamplingParams(max_tokens=16)."
        )
    return replace(params)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def _child_seed(seed: int, index: int) -> int:
    """Sample ``index``'s seed: ``seed + index``, wrapped to stay a 64-bit seed."""
    child = seed + index
    return child - UINT64_RANGE if child >= UINT64_RANGE else child


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any | None,
        structured_outputs_backend: str = "xgrammar",
        scheduling_policy: str = "fcfs",
        structured_outputs_max_spec_chars: int | None = None,
        lora_config: LoRAConfig | None = None,
        multimodal_config: MultiModalConfig | None = None,
        logits_processors: tuple[type, ...] = (),
        compact_json: bool = False,
        reasoning: ReasoningMarkers | None = None,
    ) -> None:
        """``logits_processors``: the engine's custom processor classes; each request's
        parameters pass their ``validate_params``. ``compact_json``: every JSON-constrained
        request gets ``disable_any_whitespace`` (the engine's structured-outputs config).
        ``reasoning``: grammars apply after the thought, so each constrained request is
        told where its output starts (``Request.reasoning_ended``)."""
        from pagedlm.multimodal.inputs import MultiModalInputs
        from pagedlm.structured_output.params import DEFAULT_MAX_SPEC_CHARS

        self.model_config = model_config
        self.adapters = AdapterChecker(lora_config, model_config.arch, model_config.model_impl)
        self.multimodal = MultiModalInputs(model_config, multimodal_config or MultiModalConfig())
        self.scheduling_policy = scheduling_policy
        self.logits_processors = logits_processors
        self.compact_json = compact_json
        self.reasoning = reasoning
        self.tokenizer = tokenizer
        if tokenizer is not None and hasattr(tokenizer, "truncation_side"):
            # vLLM's: a generating model keeps a truncated prompt's end, a pooling one its
            # start (tokenization_kwargs' truncation; truncate_prompt_tokens keeps the end).
            tokenizer.truncation_side = "right" if model_config.runner == "pooling" else "left"
        self.structured_outputs_backend = structured_outputs_backend
        self.structured_outputs_max_spec_chars = (
            DEFAULT_MAX_SPEC_CHARS
            if structured_outputs_max_spec_chars is None
            else structured_outputs_max_spec_chars
        )
        self.vocab_size = model_config.arch.vocab_size
        eos = set(model_config.arch.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = eos

    def tokenize(
        self, prompt: PromptType, tokenization_kwargs: Mapping[str, Any] | None = None
    ) -> tuple[str | None, list[int]]:
        """``(text, token ids)``; ``tokenization_kwargs``: how a text prompt is tokenized
        (``pagedlm.engine.tokenization_kwargs``)."""
        text, token_ids, _ = self.tokenize_multimodal(prompt, tokenization_kwargs)
        return text, token_ids

    def tokenize_multimodal(
        self, prompt: PromptType, tokenization_kwargs: Mapping[str, Any] | None = None
    ) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """``tokenize``, and the prompt's images as features (a text prompt has none)."""
        kwargs = check_tokenization_kwargs(tokenization_kwargs)
        features: list[MultiModalFeature] = []
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
        if mm_data is not None:
            assert isinstance(prompt, Mapping)
            if kwargs:
                raise ValueError(
                    "tokenization_kwargs do not reach the image processor, which tokenizes "
                    "a prompt with images itself; drop them for this prompt."
                )
            text, token_ids, features = self.multimodal.process(prompt, mm_data)
            if token_ids:
                return text, self._checked(token_ids), features
        text, token_ids = self._tokenize_text(prompt, kwargs)
        return text, token_ids, features

    def _tokenize_text(
        self, prompt: PromptType, kwargs: dict[str, Any] | None
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, Mapping):
            text = prompt.get("prompt")
            token_ids = prompt.get("prompt_token_ids")
            if text is None and token_ids is None:
                raise ValueError(
                    "A prompt dict needs 'prompt' (text) or 'prompt_token_ids' (list of ints)."
                )
        else:
            raise ValueError(
                f"Unsupported prompt of type {type(prompt).__name__}; pass a string, "
                "{'prompt': str} or {'prompt_token_ids': [int, ...]}."
            )
        if token_ids is None:
            if self.tokenizer is None:
                raise ValueError(
                    "skip_tokenizer_init=True: text prompts cannot be tokenized; pass "
                    "{'prompt_token_ids': [...]} instead."
                )
            token_ids = encode_text(self.tokenizer, text, kwargs)
        return text, self._checked(token_ids)

    def _checked(self, token_ids: list[int]) -> list[int]:
        token_ids = _token_id_list(token_ids)
        if not token_ids:
            raise ValueError("The prompt is empty; pass at least one token.")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}); "
                "check that the token ids come from this model's tokenizer."
            )
        return token_ids

    def check_priority(self, priority: int) -> None:
        """Raise ``ValueError`` naming the fix for a priority this engine cannot honour
        (vLLM's rule: not 0 without the "priority" scheduling policy)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}.")
        if not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be a 64-bit integer, got {priority}.")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"Got priority {priority} but priority scheduling is not enabled; start the "
                "engine with scheduling_policy='priority' (--scheduling-policy priority), or "
                "send priority 0."
            )

    def prompt_token_ids(
        self,
        prompt: PromptType,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """A text or token prompt's ``(text, token ids, image features)`` as a request
        carries them: tokenized under ``tokenization_kwargs``, then cut as the request
        asks (``_truncation``)."""
        kwargs = check_tokenization_kwargs(tokenization_kwargs)
        keep, side = self._truncation(prompt, truncate_prompt_tokens, kwargs)
        text, token_ids, mm_features = self.tokenize_multimodal(prompt, kwargs)
        if keep is not None and len(token_ids) > keep:
            if mm_features:
                raise ValueError(
                    "truncate_prompt_tokens would cut through the prompt's images; drop it, "
                    "or shorten the text around them."
                )
            token_ids = truncate_ids(token_ids, keep, side)
        return text, token_ids, mm_features

    def _truncation(
        self,
        prompt: PromptType,
        truncate_prompt_tokens: int | None,
        kwargs: Mapping[str, Any] | None,
    ) -> tuple[int | None, str]:
        """How many of the prompt's ids (or embedding rows) a request keeps (None: all),
        and the side it cuts (``kwargs``' ``truncation_side``, else the left: a generating
        model keeps the prompt's end): ``truncate_prompt_tokens``, and for a prompt given
        as ids or rows the kwargs' ``truncation`` too (the tokenizer cuts a text), the
        tighter bound holding, as vLLM's renderer cuts them."""
        keep = self.truncation_size(truncate_prompt_tokens)
        given = isinstance(prompt, Mapping) and (
            prompt.get("prompt_token_ids") is not None or embeds_of(prompt) is not None
        )
        if given:
            limit = pretokenized_limit(kwargs, self.model_config.max_model_len)
            keep = tighter(keep, limit)
        return keep, (kwargs or {}).get("truncation_side") or "left"

    def truncation_size(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many prompt tokens a request's ``truncate_prompt_tokens`` keeps (None: all)."""
        max_model_len = self.model_config.max_model_len
        if truncate_prompt_tokens == -1:
            return max_model_len
        if truncate_prompt_tokens is not None and truncate_prompt_tokens > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens={truncate_prompt_tokens} exceeds max_model_len="
                f"{max_model_len}; use at most {max_model_len}, or -1 for max_model_len."
            )
        return truncate_prompt_tokens

    def resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        max_model_len = self.model_config.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise ValueError(
                f"The prompt has {num_prompt_tokens} tokens, which leaves no room to generate "
                f"within max_model_len={max_model_len}; shorten the prompt or raise "
                "max_model_len."
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - num_prompt_tokens
        elif num_prompt_tokens + max_tokens > max_model_len:
            raise ValueError(
                f"max_tokens={max_tokens} exceeds the context: the prompt has "
                f"{num_prompt_tokens} tokens and max_model_len is {max_model_len}; lower "
                f"max_tokens to at most {max_model_len - num_prompt_tokens} or raise "
                "max_model_len."
            )
        self._check_token_ids(params)
        counts = self._logprob_counts(params)
        if params.detokenize and self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead.")
        if params.structured_outputs is not None:
            self._validate_structured_outputs(params)
        for processor in self.logits_processors:
            processor.validate_params(params)
        resolved = params.clone()
        resolved.max_tokens = max_tokens
        structured = params.structured_outputs
        if self.compact_json and structured is not None and not structured.disable_any_whitespace:
            resolved.structured_outputs = replace(structured, disable_any_whitespace=True)
        resolved.logprobs, resolved.prompt_logprobs = counts
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        resolved.all_stop_token_ids = stop_ids
        always: set[int] = set()  # tokens no step may sample
        if params.bad_words:
            resolved.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
            always = {ids[0] for ids in resolved.bad_words_token_ids if len(ids) == 1}
        allowed = None if params.allowed_token_ids is None else set(params.allowed_token_ids)
        if allowed is not None and always >= allowed:
            raise ValueError(
                "bad_words block every token of allowed_token_ids, so nothing could be "
                "generated; allow more tokens or drop a bad word."
            )
        if allowed is not None and params.min_tokens and always | stop_ids >= allowed:
            raise ValueError(
                "allowed_token_ids holds only stop tokens (and bad words), which "
                f"min_tokens={params.min_tokens} forbids until that many tokens are generated, "
                "so nothing could be generated; allow another token or drop min_tokens."
            )
        if self.tokenizer is None:
            resolved.detokenize = False
        return resolved

    def _logprob_counts(self, params: SamplingParams) -> tuple[int | None, int | None]:
        """``logprobs`` and ``prompt_logprobs`` with -1 as the vocabulary size, each within
        the engine's ``max_logprobs``."""
        limit = self.model_config.max_logprobs
        counts = []
        for name in ("logprobs", "prompt_logprobs"):
            value = asked = getattr(params, name)
            if value == -1:
                value = self.vocab_size
                asked = f"-1 (the whole vocabulary, {value} tokens)"
            if value is not None and value > limit:
                raise ValueError(
                    f"{name}={asked} exceeds max_logprobs={limit}; ask for at most {limit}, or "
                    "start the engine with a larger max_logprobs (--max-logprobs; -1 for the "
                    "whole vocabulary)."
                )
            counts.append(value)
        return counts[0], counts[1]

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token sequence as it starts a text and after a space (a tokenizer
        may spell the two differently), without duplicates."""
        if self.tokenizer is None:
            raise ValueError(
                "bad_words need the tokenizer to find their tokens; do not pass "
                "skip_tokenizer_init=True, or ban token ids with logit_bias."
            )
        sequences: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    sequences[ids] = None
        return [list(ids) for ids in sequences]

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Everything that names a token must name one of this model's."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise ValueError(
                f"top_k={params.top_k} exceeds the vocabulary size ({vocab}); use at most "
                f"{vocab}, or -1 to disable top-k."
            )
        for name, token_ids in (
            ("logit_bias", params.logit_bias or ()),
            ("stop_token_ids", params.stop_token_ids or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab})."
                )

    def _reasoning_ended(self, params: SamplingParams, prompt_token_ids: list[int]) -> bool | None:
        """Where a constrained request's output starts (``Request.reasoning_ended``), by
        the reasoning parser's rule for the prompt's current turn (the rule the server's
        parsers follow: ``reasoning_parsers/prompt.py``); True without a grammar that
        applies after the thought."""
        if self.reasoning is None or params.structured_outputs is None:
            return True
        from pagedlm.engine.reasoning_args import reasoning_parser_class
        from pagedlm.entrypoints.openai.reasoning_parsers.prompt import prompt_reasoning_ended

        parser_class = reasoning_parser_class(self.reasoning.reasoning_parser)
        return prompt_reasoning_ended(parser_class, self.tokenizer, prompt_token_ids)

    def _validate_structured_outputs(self, params: SamplingParams) -> None:
        from pagedlm.structured_output.params import validate_structured_outputs

        if self.tokenizer is None:
            raise ValueError(
                "structured_outputs need the tokenizer to map grammars to tokens; do not "
                "pass skip_tokenizer_init=True."
            )
        assert params.structured_outputs is not None
        validate_structured_outputs(
            params.structured_outputs,
            self.structured_outputs_backend,
            self.structured_outputs_max_spec_chars,
        )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
    ) -> ProcessedRequest:
        self.check_priority(priority)
        self.adapters.check(lora_request)
        params = checked_params(params)
        tokenization_kwargs = check_tokenization_kwargs(tokenization_kwargs)  # embeds too
        if pads(tokenization_kwargs):
            raise ValueError(
                "tokenization_kwargs padding='max_length' applies to pooling requests; drop "
                "it (or send 'do_not_pad') for generation."
            )
        embeds = None
        if embeds_of(prompt) is not None:
            assert isinstance(prompt, Mapping)
            keep, side = self._truncation(
                prompt, params.truncate_prompt_tokens, tokenization_kwargs
            )
            embeds = checked_prompt_embeds(prompt, params, self.model_config, keep, side)
            # Placeholder ids keep the scheduler's lengths; the rows are what is fed.
            text, token_ids, mm_features = None, [0] * embeds.shape[0], []
        else:
            text, token_ids, mm_features = self.prompt_token_ids(
                prompt, params.truncate_prompt_tokens, tokenization_kwargs
            )
        resolved = self.resolve_params(params, len(token_ids))
        reasoning_ended = self._reasoning_ended(resolved, [] if embeds is not None else token_ids)
        cache_salt = cache_salt_of(prompt)
        arrival = time.monotonic()
        children = []
        for i in range(resolved.n):
            child_params = resolved
            if resolved.n > 1:
                child_params = resolved.clone()
                child_params.n = 1
                if resolved.seed is not None:
                    child_params.seed = _child_seed(resolved.seed, i)
            children.append(
                Request(
                    child_request_id(request_id, i, resolved.n),
                    token_ids,
                    child_params,
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=arrival,
                    cache_salt=cache_salt,
                    priority=priority,
                    lora_request=lora_request,
                    mm_features=mm_features,
                    prompt_embeds=embeds,
                    reasoning_ended=reasoning_ended,
                )
            )
        # An embeddings prompt reports no prompt token ids (vLLM's None), and its output
        # is detokenized without a prompt context.
        prompt_ids = [] if embeds is not None else token_ids
        return ProcessedRequest(request_id, text, prompt_ids, resolved, children, arrival)
