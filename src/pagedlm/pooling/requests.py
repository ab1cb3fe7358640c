"""A pooling prompt as an engine-core request.

The engine core runs a pooling request like a prompt that samples nothing: the whole
prompt in one step (``SchedulerConfig.whole_prompts``), then the scheduler finishes it
with the pooled vector (``ModelRunnerOutput.pooler_output``). Its ``SamplingParams`` only
keep the core's length bookkeeping true: one output slot (``max_tokens=1``), never filled.
"""

from __future__ import annotations

import time

from pagedlm.config import ModelConfig
from pagedlm.core.request import Request
from pagedlm.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagedlm.pooling.params import PoolingParams
from pagedlm.sampling_params import RequestOutputKind, SamplingParams


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
    processor: InputProcessor, request_id: str, prompt: PromptType, params: PoolingParams
) -> ProcessedRequest:
    """Validate and tokenize one pooling prompt (raises ``ValueError`` naming the fix)."""
    config = processor.model_config
    require_pooling(config)
    assert config.pooler is not None, "a pooling model config has a pooler"
    params.validate(config.pooler, config.arch.hidden_size)
    text, token_ids = processor.tokenize(prompt)
    if len(token_ids) > config.max_model_len:
        raise ValueError(
            f"The input has {len(token_ids)} tokens, more than max_model_len="
            f"{config.max_model_len}; shorten it or raise max_model_len."
        )
    sampling = pooling_sampling_params()
    arrival = time.monotonic()
    child = Request(request_id, token_ids, sampling, arrival_time=arrival)
    return ProcessedRequest(request_id, text, token_ids, sampling, [child], arrival)
