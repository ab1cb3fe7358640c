"""``POST /v1/embeddings``: one vector per input, from a pooling model.

Every input is its own engine request (all started together, so they share steps); a bad
input fails the whole request with 400 and aborts the others. Vectors go out as JSON
floats, or with ``encoding_format="base64"`` as base64 of their little-endian float32
bytes (what OpenAI's SDK asks for by default, and decodes).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np

from pagedlm.entrypoints.openai.errors import APIError, from_value_error
from pagedlm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from pagedlm.entrypoints.openai.serving_engine import ServingContext
from pagedlm.pooling import PoolingParams, PoolingRequestOutput


def encode_vector(vector: Any, encoding_format: str) -> list[float] | str:
    """A float32 vector (tensor) as the response's ``embedding`` field."""
    values = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    return values.tolist()


class EmbeddingServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _check(self, body: EmbeddingRequest) -> PoolingParams:
        ctx = self.ctx
        ctx.check_model(body.model)
        if body.model in ctx.loras:
            raise APIError("LoRA adapters do not embed; name the base model.", param="model")
        if ctx.runner != "pooling":
            raise APIError(
                "This model is served for generation; /v1/embeddings needs a pooling model. "
                "Restart the server with --runner pooling (or serve an embedding model).",
            )
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        config = ctx.engine.config.model
        try:
            params.validate(config.pooler, config.arch.hidden_size)
        except ValueError as error:
            raise APIError(str(error), param="dimensions") from None
        return params

    async def create(self, body: EmbeddingRequest) -> tuple[dict[str, Any], None]:
        params = self._check(body)
        prompts = body.prompts()
        limit = self.ctx.limits.max_completion_prompts
        if len(prompts) > limit:
            raise APIError(
                f"input has {len(prompts)} entries; this server accepts at most {limit} (its "
                "--max-completion-prompts flag). Send fewer, or raise the flag.",
                param="input",
            )
        request_id = self.ctx.request_id("embd")
        tasks = [
            asyncio.ensure_future(self._one(prompt, params, f"{request_id}-{i}"))
            for i, prompt in enumerate(prompts)
        ]
        try:
            outputs = await asyncio.gather(*tasks)
        except ValueError as error:
            raise from_value_error(error) from error
        finally:  # a failure (or the client leaving) aborts what still runs
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        data = [
            {
                "object": "embedding",
                "index": index,
                "embedding": encode_vector(output.outputs.data, body.encoding_format),
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

    async def _one(
        self, prompt: Any, params: PoolingParams, request_id: str
    ) -> PoolingRequestOutput:
        final = None
        async for output in self.ctx.engine.encode(prompt, params, request_id):
            final = output
        if final is None:
            raise APIError("The request was aborted before it finished.", status=503)
        return final
