"""``POST /classify``, ``/score``, ``/rerank`` and ``/pooling``: a pooling model's
classifications, pair scores and raw outputs, with vLLM's request and response shapes
(``/pooling`` takes vLLM's ``task``: a token-wise one answers with a row per prompt token,
``data`` a list of lists; its results go on the wire as ``pooling_encoding`` says).

Every prompt is its own engine request (``pool_all``: all started together, so they share
steps; a bad one fails the whole request with 400 and aborts the others). Scoring follows
``pagedlm.pooling.scoring``: a cross-encoder reads each (text_1, text_2) pair as one
prompt, an embedding model scores the cosine similarity of the two texts' embeddings.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.responses import Response

from pagedlm.config import PoolerConfig
from pagedlm.engine.concurrent_requests import final_output, gather_all
from pagedlm.entrypoints.openai.cache_salt import salted
from pagedlm.entrypoints.openai.errors import APIError, from_value_error
from pagedlm.entrypoints.openai.pooling_encoding import BYTES_FORMATS, bytes_response, encode_vector
from pagedlm.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EncodingFields,
    InputOrMessages,
    PoolingBodyFields,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedlm.entrypoints.openai.request_body import off_loop_if_large
from pagedlm.entrypoints.openai.serving_engine import ServingContext
from pagedlm.pooling import PoolingParams, PoolingRequestOutput, scoring, tasks


async def body_prompts(ctx: ServingContext, body: InputOrMessages) -> list[Any]:
    """The engine prompts of a body's ``input``, or its conversation rendered by the chat
    template (one prompt; the tokenizer's special tokens added only on request)."""
    chat = body.chat()
    if chat is None:
        return body.prompts()
    ids = await ctx.apply_chat_template(
        await off_loop_if_large(body.body_bytes, chat.conversation),
        chat.chat_template,
        chat.add_generation_prompt,
        chat.continue_final_message,
        chat.template_kwargs(),
        bool(body.add_special_tokens),
    )
    return [{"prompt_token_ids": ids}]


async def pool_all(
    ctx: ServingContext,
    prompts: list[Any],
    params: PoolingParams,
    request_id: str,
    body: PoolingBodyFields,
) -> list[PoolingRequestOutput]:
    """Each prompt's final output, in order; an engine-side ``ValueError`` becomes a 400,
    and a failure (or the client leaving) aborts what still runs. Every prompt is an engine
    request ``<request_id>-<index>`` with the body's ``cache_salt`` and ``priority``,
    tokenized as its fields say (``PoolingBodyFields.tokenization_kwargs``; an ``input``
    body's ``add_special_tokens`` too)."""
    limit = ctx.limits.max_completion_prompts
    if len(prompts) > limit:
        raise APIError(
            f"The request has {len(prompts)} inputs; this server accepts at most {limit} (its "
            "--max-completion-prompts flag). Send fewer, or raise the flag.",
        )
    special = not isinstance(body, InputOrMessages) or body.add_special_tokens is not False
    options: dict[str, Any] = {"priority": body.priority}
    tokenization_kwargs = body.tokenization_kwargs(special)
    if tokenization_kwargs is not None:
        options["tokenization_kwargs"] = tokenization_kwargs
    try:
        return await gather_all(
            _one(ctx, salted(prompt, body.cache_salt), params, f"{request_id}-{i}", options)
            for i, prompt in enumerate(prompts)
        )
    except ValueError as error:
        raise from_value_error(error) from error


async def _one(
    ctx: ServingContext,
    prompt: Any,
    params: PoolingParams,
    request_id: str,
    options: dict[str, Any],
) -> PoolingRequestOutput:
    ctx.log_request(request_id, prompt, params)
    final = await final_output(ctx.engine.encode(prompt, params, request_id, **options))
    if final is None:
        raise APIError("The request was aborted before it finished.", status=503)
    return final


def pooling_model(
    ctx: ServingContext, model: str | None, route: str, task: str | None = None
) -> PoolerConfig:
    """The served pooling model's config, checked to serve ``task`` (``tasks.POOLING_TASKS``;
    None: any); 400 naming ``--runner`` on a generative server, for LoRA adapters (which
    do not pool), and naming the tasks the model serves and their routes otherwise."""
    ctx.check_model(model)
    if model in ctx.loras:
        raise APIError(f"LoRA adapters do not serve {route}; name the base model.", param="model")
    if ctx.runner != "pooling":
        raise APIError(
            f"This model is served for generation; {route} needs a pooling model. Serve an "
            "embedding model or a *ForSequenceClassification checkpoint (--runner pooling)."
        )
    pooler = ctx.engine.config.model.pooler
    assert pooler is not None, "a pooling engine has a pooler config"
    if task is not None:
        try:
            tasks.check_task(pooler, task)
        except ValueError as error:
            raise APIError(str(error), param="task" if route == "/pooling" else None) from None
    return pooler


def pooling_params(ctx: ServingContext, pooler: PoolerConfig, **fields: Any) -> PoolingParams:
    """``PoolingParams(**fields)`` checked against the model; a 400 naming the field."""
    params = PoolingParams(**fields)
    try:
        params.validate(pooler, ctx.engine.config.model.arch.hidden_size)
    except ValueError as error:
        raise from_value_error(error) from None
    return params


def bytes_answer(
    ctx: ServingContext,
    request_id: str,
    body: EncodingFields,
    outputs: list[PoolingRequestOutput],
) -> Response:
    """vLLM's "bytes" / "bytes_only" answer of ``outputs`` (``pooling_encoding``)."""
    header = {"id": request_id, "created": int(time.time()), "model": ctx.model_name}
    return bytes_response(
        [output.outputs.data for output in outputs],
        _usage(outputs)["prompt_tokens"],
        header,
        body.encoding_format,
        body.embed_dtype,
        body.endianness,
    )


def _usage(outputs: list[PoolingRequestOutput]) -> dict[str, Any]:
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


class PoolingServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def classify(self, body: ClassificationRequest) -> tuple[dict[str, Any], None]:
        pooler = pooling_model(self.ctx, body.model, "/classify", "classify")
        params = pooling_params(
            self.ctx,
            pooler,
            use_activation=body.activation_choice(),
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
        request_id = self.ctx.request_id("classify", body.request_id)
        prompts = await body_prompts(self.ctx, body)
        outputs = await pool_all(self.ctx, prompts, params, request_id, body)
        labels = pooler.labels
        assert labels is not None
        data = []
        for index, output in enumerate(outputs):
            probs = output.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(
                {"index": index, "label": labels[best], "probs": probs, "num_classes": len(probs)}
            )
        return self._listing(request_id, data, outputs), None

    async def score(self, body: ScoreRequest) -> tuple[dict[str, Any], None]:
        request_id = self.ctx.request_id("score", body.request_id)
        names, first, second = body.sides()
        scores, outputs = await self._scores(
            body, scoring.as_list(first), scoring.as_list(second), names, request_id
        )
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self._listing(request_id, data, outputs), None

    async def rerank(self, body: RerankRequest) -> tuple[dict[str, Any], None]:
        request_id = self.ctx.request_id("rerank", body.request_id)
        scores, outputs = await self._scores(
            body, [body.query], body.documents, ("query", "documents"), request_id
        )
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = [
            {"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]}
            for i in order
        ]
        response = {
            "id": request_id,
            "model": self.ctx.response_model(body.model),
            "usage": {"total_tokens": _usage(outputs)["total_tokens"]},
            "results": results,
        }
        return response, None

    async def pooling(self, body: PoolingRequest) -> tuple[dict[str, Any] | Response, None]:
        pooler = pooling_model(self.ctx, body.model, "/pooling", body.task)
        params = pooling_params(
            self.ctx,
            pooler,
            dimensions=body.dimensions,
            normalize=body.normalize,
            use_activation=body.activation_choice(),
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            task=body.task,
        )
        request_id = self.ctx.request_id("pool", body.request_id)
        prompts = await body_prompts(self.ctx, body)
        outputs = await pool_all(self.ctx, prompts, params, request_id, body)
        vectors = [output.outputs.data for output in outputs]
        if body.encoding_format in BYTES_FORMATS:
            return bytes_answer(self.ctx, request_id, body, outputs), None
        data = [
            {
                "index": index,
                "object": "pooling",
                "data": encode_vector(
                    vector, body.encoding_format, body.embed_dtype, body.endianness
                ),
            }
            for index, vector in enumerate(vectors)
        ]
        return self._listing(request_id, data, outputs), None

    async def _scores(
        self,
        body: ScoreRequest | RerankRequest,
        first: list[str],
        second: list[str],
        names: tuple[str, str],
        request_id: str,
    ) -> tuple[list[float], list[PoolingRequestOutput]]:
        route = "/rerank" if isinstance(body, RerankRequest) else "/score"
        pooler = pooling_model(self.ctx, body.model, route, "score")
        try:
            pairs = scoring.pair_up(first, second, names)
        except ValueError as error:
            raise APIError(str(error), param=names[1]) from None
        truncate = body.truncate_prompt_tokens
        if scoring.is_cross_encoder(pooler):
            params = pooling_params(
                self.ctx,
                pooler,
                use_activation=body.activation_choice(),
                truncate_prompt_tokens=truncate,
            )
            outputs = await pool_all(self.ctx, pairs, params, request_id, body)
            return [float(output.outputs.data[0]) for output in outputs], outputs
        if body.activation_choice() is not None:
            raise APIError(
                "use_activation applies to cross-encoders; this model embeds and scores by "
                "cosine similarity. Omit it.",
                param="use_activation",
            )
        params = pooling_params(self.ctx, pooler, truncate_prompt_tokens=truncate)
        firsts = first[:1] if len(first) == 1 else first
        texts = firsts + [b for _, b in pairs]
        outputs = await pool_all(self.ctx, texts, params, request_id, body)
        vectors = [output.outputs.data for output in outputs]
        heads = vectors[:1] * len(pairs) if len(firsts) == 1 else vectors[: len(firsts)]
        tails = vectors[len(firsts) :]
        return [scoring.cosine(a, b) for a, b in zip(heads, tails, strict=True)], outputs

    def _listing(
        self, request_id: str, data: list[dict[str, Any]], outputs: list[PoolingRequestOutput]
    ) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": self.ctx.model_name,
            "data": data,
            "usage": _usage(outputs),
        }
