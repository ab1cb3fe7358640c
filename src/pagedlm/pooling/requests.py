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
from pagedlm.engine.tokenization_kwargs import (
    check_tokenization_kwargs,
    pads,
    tokenizer_kwargs,
    truncate_ids,
    truncation_limit,
)
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
    priority: int = 0,
) -> ProcessedRequest:
    """Validate and tokenize one pooling prompt (raises ``ValueError`` naming the fix).
    ``tokenization_kwargs``: how its text is tokenized, cut and padded (vLLM's;
    ``pagedlm.engine.tokenization_kwargs``). ``priority``: as a generation request's."""
    config = processor.model_config
    require_pooling(config)
    assert config.pooler is not None, "a pooling model config has a pooler"
    processor.check_priority(priority)
    params.validate(config.pooler, config.arch.hidden_size)
    keep = processor.truncation_size(params.truncate_prompt_tokens)
    kwargs = check_tokenization_kwargs(tokenization_kwargs) or {}
    padding = pads(kwargs)
    kwargs.pop("padding", None)
    limit = truncation_limit(processor.tokenizer, kwargs)
    if limit is not None and keep is not None:
        keep = min(keep, limit)  # the tighter bound holds
    elif limit is not None and kwargs.get("truncation_side") is not None:
        keep = limit  # the tokenizer does not cut: the ids are cut on the side asked
    pair = pair_texts(prompt)
    if pair is not None:
        text, token_ids, token_types = _tokenize_pair(processor, pair, keep, kwargs)
    else:
        text, token_ids = _tokenize(processor, prompt, keep, kwargs)
        token_types = None
    if padding:
        target = config.max_model_len if keep is None else keep
        token_ids, token_types = _padded(processor, token_ids, token_types, target)
    if len(token_ids) > config.max_model_len:
        raise ValueError(
            f"The input has {len(token_ids)} tokens, more than max_model_len="
            f"{config.max_model_len}; shorten it or raise max_model_len."
        )
    engine_ids = token_ids
    if token_types is not None:
        from pagedlm.model_executor.models.bert import encode_token_types

        engine_ids = encode_token_types(token_ids, token_types, config.arch.vocab_size)
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
        priority=priority,
    )
    return ProcessedRequest(request_id, text, token_ids, sampling, [child], arrival)


def _tokenize(
    processor: InputProcessor, prompt: PromptType, keep: int | None, kwargs: dict[str, Any]
) -> tuple[str | None, list[int]]:
    """A prompt's text and ids, at most ``keep`` of them (see ``PoolingParams``; with a
    ``truncation_side``, cut on that side)."""
    text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, dict) and prompt.get("prompt_token_ids") is None:
        text = prompt.get("prompt")
    side = kwargs.get("truncation_side")
    tokenizer = processor.tokenizer
    if keep is None or side is not None or not isinstance(text, str) or tokenizer is None:
        text, token_ids = processor.tokenize(prompt, kwargs)
        return text, truncate_ids(token_ids, keep, side or "left")
    encoded = as_transformers(tokenizer)(
        text, **{**tokenizer_kwargs(kwargs), "truncation": True, "max_length": keep}
    )
    return text, processor.tokenize({"prompt_token_ids": encoded["input_ids"]})[1]


def _tokenize_pair(
    processor: InputProcessor,
    pair: tuple[object, object],
    keep: int | None,
    kwargs: dict[str, Any],
) -> tuple[None, list[int], list[int] | None]:
    """(no single text, the joined prompt's ids, their token types where the model reads
    them), at most ``keep`` ids: the tokenizer's longest-first truncation, or with a
    ``truncation_side`` the joined ids cut on that side."""
    text_1, text_2 = pair
    if not isinstance(text_1, str) or not isinstance(text_2, str):
        raise ValueError("A text pair is two strings (text_1, text_2).")
    tokenizer = processor.tokenizer
    if tokenizer is None:
        raise ValueError(
            "skip_tokenizer_init=True: a cross-encoder's text pairs cannot be joined "
            "without the tokenizer; start the engine with its tokenizer."
        )
    side = kwargs.get("truncation_side")
    call = tokenizer_kwargs(kwargs)
    if keep is not None and side is None:
        call.update(truncation=True, max_length=keep)
    encoded = as_transformers(tokenizer)(text_1, text_pair=text_2, **call)
    token_ids = truncate_ids([int(t) for t in encoded["input_ids"]], keep, side or "right")
    if not token_ids:
        raise ValueError("The text pair tokenizes to no tokens.")
    token_types = encoded.get("token_type_ids")
    if token_types is None or not reads_token_types(processor.model_config.arch):
        return None, token_ids, None
    return None, token_ids, truncate_ids(list(token_types), keep, side or "right")


def _padded(
    processor: InputProcessor, token_ids: list[int], token_types: list[int] | None, target: int
) -> tuple[list[int], list[int] | None]:
    """``padding="max_length"``: ``token_ids`` padded to ``target`` with the tokenizer's pad
    token (the second segment's token types with 0s, as BERT's tokenizer pads them)."""
    missing = target - len(token_ids)
    if missing <= 0:
        return token_ids, token_types
    pad_id = getattr(processor.tokenizer, "pad_token_id", None)
    if pad_id is None:
        raise ValueError(
            "padding='max_length' needs the tokenizer's pad token, and this tokenizer has "
            "none; drop padding (or send 'do_not_pad')."
        )
    padded_types = None if token_types is None else token_types + [0] * missing
    return token_ids + [pad_id] * missing, padded_types
