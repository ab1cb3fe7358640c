"""``POST /v1/embeddings``: one vector per input, from a pooling model.

Every input is its own engine request (``serving_pooling.pool_all``: all started
together, so they share steps); a bad input fails the whole request with 400 and aborts
the others. Vectors go out as JSON floats, or with ``encoding_format="base64"`` as base64
of their float32 bytes (what OpenAI's SDK asks for by default, and decodes), or in vLLM's
other ``embed_dtype``s, byte orders and binary answers (``pooling_encoding``).
"""

from __future__ import annotations

import time
from typing import Any

from starlette.responses import Response

from pagedlm.entrypoints.openai.pooling_encoding import BYTES_FORMATS, encode_vector
from pagedlm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from pagedlm.entrypoints.openai.serving_engine import ServingContext
from pagedlm.entrypoints.openai.serving_pooling import (
    body_prompts,
    bytes_answer,
    pool_all,
    pooling_model,
    pooling_params,
)
from pagedlm.pooling import PoolingParams


class EmbeddingServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _check(self, body: EmbeddingRequest) -> PoolingParams:
        pooler = pooling_model(self.ctx, body.model, "/v1/embeddings", "embed")
        return pooling_params(
            self.ctx,
            pooler,
            dimensions=body.dimensions,
            normalize=body.normalize,
            use_activation=body.use_activation,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )

    async def create(self, body: EmbeddingRequest) -> tuple[dict[str, Any] | Response, None]:
        params = self._check(body)
        request_id = self.ctx.request_id("embd", body.request_id)
        prompts = await body_prompts(self.ctx, body)
        outputs = await pool_all(self.ctx, prompts, params, request_id, body)
        if body.encoding_format in BYTES_FORMATS:
            return bytes_answer(self.ctx, request_id, body, outputs), None
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        data = [
            {
                "object": "embedding",
                "index": index,
                "embedding": encode_vector(
                    output.outputs.data, body.encoding_format, body.embed_dtype, body.endianness
                ),
            }
            for index, output in enumerate(outputs)
        ]
        response = {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": self.ctx.model_name,
            "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
        return response, None
