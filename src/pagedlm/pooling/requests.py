"""A pooling prompt as an engine-core request.

The engine core runs a pooling request like a prompt that samples nothing: the whole
prompt in one step (``SchedulerConfig.whole_prompts``), or in chunks where the model's
pooling allows it (``model_config.chunks_prompts``), then the scheduler finishes it with
the pooled vector or rows (``ModelRunnerOutput.pooler_output``). Its ``SamplingParams``
only keep the core's length bookkeeping true: one output slot (``max_tokens=1``), never
filled; its ``PoolingSpec`` tells the core and the workers its task.

A cross-encoder scores a text pair as one prompt: a ``(text_1, text_2)`` tuple, or the
same as a dict that may carry a ``cache_salt`` (``TextPairPrompt``), joined by the
tokenizer as it joins pairs (``[CLS] a [SEP] b [SEP]`` for BERT); a model that reads
token types gets the second segment's inside the engine-core ids (``encode_token_types``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from typing_extensions import NotRequired, TypedDict

from pagedlm.config import ModelConfig
from pagedlm.core.request import Request
from pagedlm.engine.input_processor import (
    InputProcessor,
    ProcessedRequest,
    PromptType,
    cache_salt_of,
)
from pagedlm.engine.tokenization_kwargs import check_tokenization_kwargs
from pagedlm.pooling.model_config import reads_token_types
from pagedlm.pooling.params import PoolingParams
from pagedlm.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.step.pooling import TOKEN_TASKS, PoolingSpec
from pagedlm.tokenizer import as_transformers


class TextPairPrompt(TypedDict):
    """A cross-encoder's pair with the keys of the other prompt dicts (``pagedlm.inputs``)."""

    text_1: str
    text_2: str
    cache_salt: NotRequired[str]


PairPrompt = tuple[str, str] | TextPairPrompt
"""A cross-encoder's input: the query (or first text) and the document."""


def pair_texts(prompt: object) -> tuple[object, object] | None:
    """A pair prompt's two texts, unchecked (None: ``prompt`` is not a pair)."""
    if isinstance(prompt, tuple):
        return prompt if len(prompt) == 2 else (None, None)
    if isinstance(prompt, Mapping) and ("text_1" in prompt or "text_2" in prompt):
        return prompt.get("text_1"), prompt.get("text_2")
    return None


def pooling_sampling_params() -> SamplingParams:
    """What the engine core sees of a pooling request: one step, no text, final only."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def require_pooling(model_config: ModelConfig) -> None:
    if model_config.runner != "pooling":
        raise ValueError(
            f"{model_config.arch.architecture} runs as a generative model; start the engine "
            "with runner='pooling' (--runner pooling) to embed with it."
        )


def process_pooling_request(
    processor: InputProcessor,
    request_id: str,
    prompt: PromptType | PairPrompt,
    params: PoolingParams,
    tokenization_kwargs: Mapping[str, Any] | None = None,
) -> ProcessedRequest:
    """Validate and tokenize one pooling prompt (raises ``ValueError`` naming the fix).
    ``tokenization_kwargs``: how its text is tokenized (vLLM's;
    ``pagedlm.engine.tokenization_kwargs``)."""
    config = processor.model_config
    require_pooling(config)
    assert config.pooler is not None, "a pooling model config has a pooler"
    params.validate(config.pooler, config.arch.hidden_size)
    keep = processor.truncation_size(params.truncate_prompt_tokens)
    kwargs = check_tokenization_kwargs(tokenization_kwargs) or {}
    if keep is not None and kwargs.get("truncation") not in (None, False, "do_not_truncate"):
        keep = min(keep, kwargs.get("max_length") or keep)  # the tighter bound holds
    pair = pair_texts(prompt)
    if pair is not None:
        text, token_ids, engine_ids = _tokenize_pair(processor, pair, keep, kwargs)
    else:
        text, token_ids = _tokenize(processor, prompt, keep, kwargs)
        engine_ids = token_ids
    if len(token_ids) > config.max_model_len:
        raise ValueError(
            f"The input has {len(token_ids)} tokens, more than max_model_len="
            f"{config.max_model_len}; shorten it or raise max_model_len."
        )
    sampling = pooling_sampling_params()
    arrival = time.monotonic()
    task = params.resolved_task(config.pooler)
    spec = PoolingSpec(task, params.step_tag(config.pooler) if task in TOKEN_TASKS else None)
    child = Request(
        request_id,
        engine_ids,
        sampling,
        arrival_time=arrival,
        cache_salt=cache_salt_of(prompt),
        pooling=spec,
    )
    return ProcessedRequest(request_id, text, token_ids, sampling, [child], arrival)


def _tokenize(
    processor: InputProcessor, prompt: PromptType, keep: int | None, kwargs: dict[str, Any]
) -> tuple[str | None, list[int]]:
    """A prompt's text and ids, at most ``keep`` of them (see ``PoolingParams``)."""
    text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, dict) and prompt.get("prompt_token_ids") is None:
        text = prompt.get("prompt")
    if keep is None or not isinstance(text, str) or processor.tokenizer is None:
        text, token_ids = processor.tokenize(prompt, kwargs)
        return text, token_ids if keep is None else token_ids[-keep:]
    encoded = as_transformers(processor.tokenizer)(
        text, **{**kwargs, "truncation": True, "max_length": keep}
    )
    return text, processor.tokenize({"prompt_token_ids": encoded["input_ids"]})[1]


def _tokenize_pair(
    processor: InputProcessor,
    pair: tuple[object, object],
    keep: int | None,
    kwargs: dict[str, Any],
) -> tuple[None, list[int], list[int]]:
    """(no single text, the joined prompt's ids, the ids the engine core runs), at most
    ``keep`` ids (the tokenizer's longest-first truncation)."""
    text_1, text_2 = pair
    if not isinstance(text_1, str) or not isinstance(text_2, str):
        raise ValueError("A text pair is two strings (text_1, text_2).")
    tokenizer = processor.tokenizer
    if tokenizer is None:
        raise ValueError(
            "skip_tokenizer_init=True: a cross-encoder's text pairs cannot be joined "
            "without the tokenizer; start the engine with its tokenizer."
        )
    truncation = {} if keep is None else {"truncation": True, "max_length": keep}
    encoded = as_transformers(tokenizer)(text_1, text_pair=text_2, **{**kwargs, **truncation})
    token_ids = [int(t) for t in encoded["input_ids"]]
    if not token_ids:
        raise ValueError("The text pair tokenizes to no tokens.")
    arch = processor.model_config.arch
    token_types = encoded.get("token_type_ids")
    if token_types is None or not reads_token_types(arch):
        return None, token_ids, token_ids
    from pagedlm.model_executor.models.bert import encode_token_types

    return None, token_ids, encode_token_types(token_ids, token_types, arch.vocab_size)
