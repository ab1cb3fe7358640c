"""The HTTP application: routes, error mapping and middleware around one engine.

``build_app(ctx, api_key, max_body_bytes)`` takes a ready ``ServingContext`` (so tests
can serve any engine with AsyncLLM's interface); ``api_server.run_server`` serves it with
uvicorn. Every route with a body parses it with ``request_body.parse_body`` and declares
its model for ``/openapi.json`` (``/docs`` and ``/redoc`` render it).

Health: ``/health`` is 200 while the engine core is alive and progressing (busy
included) and 503 with the reason when it is dead, stopped or hung; ``/ready`` is 200
only when it could start a new request now, else 503 with the reason ("busy" among
them). Both answer from the core's heartbeat, never waiting for a step.

Engine death: requests get 503 naming the cause, streams end with an error event, and
``build_app``'s ``on_engine_death(error)`` runs once (``pagedlm serve`` exits non-zero
after a grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import msgspec
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pagedlm.engine.exceptions import EngineDeadError, RequestFailedError
from pagedlm.entrypoints.openai import serving_tokenize
from pagedlm.entrypoints.openai.admin import (
    MODEL_ROUTES,
    AdminOptions,
    SleepingModelGuard,
    install_admin_routes,
)
from pagedlm.entrypoints.openai.errors import (
    APIError,
    error_response,
    is_anthropic_path,
    sse_error_event,
)
from pagedlm.entrypoints.openai.extras import missing_package_error
from pagedlm.entrypoints.openai.http_options import HttpOptions
from pagedlm.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    CancelledRequestMiddleware,
    ServerLoad,
    ServerLoadMiddleware,
)
from pagedlm.entrypoints.openai.openapi import install_openapi, request_body_spec
from pagedlm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedlm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from pagedlm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from pagedlm.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedlm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedlm.entrypoints.openai.request_body import parse_body, read_json, warning_header
from pagedlm.entrypoints.openai.responses_store import owner_of
from pagedlm.entrypoints.openai.serving_chat import ChatServer
from pagedlm.entrypoints.openai.serving_completion import CompletionServer
from pagedlm.entrypoints.openai.serving_embedding import EmbeddingServer
from pagedlm.entrypoints.openai.serving_engine import ServingContext, until_disconnected
from pagedlm.entrypoints.openai.serving_lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from pagedlm.entrypoints.openai.serving_messages import MessagesServer
from pagedlm.entrypoints.openai.serving_pooling import PoolingServer
from pagedlm.entrypoints.openai.serving_responses import ResponsesServer
from pagedlm.entrypoints.openai.tokenizer_info import tokenizer_info
from pagedlm.metrics.log_line import StatsLine

logger = logging.getLogger("pagedlm.server")

HEALTH_TIMEOUT_S = 5.0
ENGINE_DEAD_STATUS = 503
REQUEST_FAILED_STATUS = 500
"""A request the engine core failed alone (a custom logits processor raised for it): a
server-side error, as vLLM answers its finish reason "error", with what failed."""

Handler = Callable[[Request], Awaitable[Response]]
BodyHandler = Callable[[Request, Any], Awaitable[Response]]


def _engine_dead_message(error: BaseException) -> str:
    return f"The engine core is not running ({error}); restart the server."


def _health_message(state: Any) -> str:
    return _engine_dead_message(state.reason) if state.status == "dead" else state.reason


def _guarded(anthropic: bool) -> Callable[[Handler], Handler]:
    """Map exceptions raised by a handler to error responses of the right shape."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapper(request: Request) -> Response:
            response = await _answer(handler, request, anthropic)
            warnings = getattr(request.state, "warnings", None)
            if warnings:  # ignored and deprecated fields (see request_body)
                response.headers["warning"] = warning_header(warnings)
            return response

        return wrapper

    return decorate


def _log_stack(ctx: ServingContext, error: BaseException) -> None:
    """``--log-error-stack``: the traceback of an exception answered as an error."""
    if ctx.log_error_stack:
        logger.error("Error response from %r", error, exc_info=error)


async def _answer(handler: Handler, request: Request, anthropic: bool) -> Response:
    try:
        return await handler(request)
    except ClientDisconnect:  # gone before its body arrived: nobody reads this
        return Response(status_code=499)
    except APIError as error:
        _log_stack(request.app.state.ctx, error)
        return error_response(error.message, error.status, error.param, anthropic=anthropic)
    except EngineDeadError as error:
        _log_stack(request.app.state.ctx, error)
        return error_response(_engine_dead_message(error), ENGINE_DEAD_STATUS, anthropic=anthropic)
    except RequestFailedError as error:  # this request alone (vLLM's finish reason "error")
        _log_stack(request.app.state.ctx, error)
        return error_response(str(error), REQUEST_FAILED_STATUS, anthropic=anthropic)
    except ImportError as error:  # an optional package: name the extra, never a bare 500
        _log_stack(request.app.state.ctx, error)
        missing = missing_package_error(error)
        return error_response(missing.message, missing.status, anthropic=anthropic)
    except Exception:
        logger.exception("Unhandled error in %s", request.url.path)
        return error_response(
            "Internal server error; see the server log.", 500, anthropic=anthropic
        )


def _body_route(
    app: FastAPI, ctx: ServingContext, path: str, model: type[BaseModel], anthropic: bool
) -> Callable[[BodyHandler], BodyHandler]:
    """Register ``handler(request, body)`` for POST ``path`` with a ``model`` body (and
    ``model`` in ``app.state.body_models``, for /openapi.json)."""

    def decorate(handler: BodyHandler) -> BodyHandler:
        if model not in app.state.body_models:  # a model may serve several paths
            app.state.body_models.append(model)
        app.state.body_routes[path] = (model, handler)

        async def route(request: Request) -> Response:
            return await handler(request, await parse_body(request, model, ctx.limits))

        app.post(path, name=handler.__name__, openapi_extra=request_body_spec(model))(
            _guarded(anthropic)(route)
        )
        return handler

    return decorate


async def _guard_stream(
    events: AsyncIterator[str], anthropic: bool, ctx: ServingContext
) -> AsyncIterator[str]:
    """Errors after the stream started become an error event (then [DONE] for OpenAI)."""
    try:
        async for event in events:
            yield event
        return
    except APIError as error:
        _log_stack(ctx, error)
        yield sse_error_event(error.message, error.status, anthropic)
    except EngineDeadError as error:
        _log_stack(ctx, error)
        yield sse_error_event(_engine_dead_message(error), ENGINE_DEAD_STATUS, anthropic)
    except RequestFailedError as error:
        _log_stack(ctx, error)
        yield sse_error_event(str(error), REQUEST_FAILED_STATUS, anthropic)
    except ImportError as error:
        _log_stack(ctx, error)
        missing = missing_package_error(error)
        yield sse_error_event(missing.message, missing.status, anthropic)
    except Exception:
        logger.exception("Unhandled error while streaming")
        yield sse_error_event("Internal server error; see the server log.", 500, anthropic)
    if not anthropic:
        yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """A ``StreamingResponse`` that closes its events however it ends. A client that
    disconnects while a write is pending (a slow reader's full socket buffer) cancels the
    response inside ``send``, outside the events' generator, which then stays suspended at
    a yield: its request would generate on (holding KV blocks and its id) until the garbage
    collector came across it. Closing it aborts the request at once."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


async def _respond(
    request: Request, create: Awaitable[tuple[dict | Response | None, Any]], anthropic: bool
) -> Response:
    result = await until_disconnected(request, create)
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    body, events = result
    if isinstance(body, Response):  # an answer that is not JSON (vLLM's binary embeddings)
        return body
    if events is not None:
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return _EventStream(
            _guard_stream(events, anthropic, request.app.state.ctx),
            media_type="text/event-stream",
            headers=headers,
        )
    return JSONResponse(body)


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    completions, chat, messages = CompletionServer(ctx), ChatServer(ctx), MessagesServer(ctx)

    @_body_route(app, ctx, "/v1/completions", CompletionRequest, anthropic=False)
    async def create_completion(request: Request, body: CompletionRequest) -> Response:
        body.check_backend(ctx.structured_outputs_backend)
        return await _respond(request, completions.create(body), anthropic=False)

    @_body_route(app, ctx, "/v1/chat/completions", ChatCompletionRequest, anthropic=False)
    async def create_chat_completion(request: Request, body: ChatCompletionRequest) -> Response:
        body.check_backend(ctx.structured_outputs_backend)
        return await _respond(request, chat.create(body), anthropic=False)

    @_body_route(app, ctx, "/v1/messages", MessagesRequest, anthropic=True)
    async def create_message(request: Request, body: MessagesRequest) -> Response:
        return await _respond(request, messages.create(body), anthropic=True)

    @_body_route(app, ctx, "/v1/messages/count_tokens", CountTokensRequest, anthropic=True)
    async def count_tokens(request: Request, body: CountTokensRequest) -> Response:
        return JSONResponse(await messages.count_tokens(body))


def _add_responses_routes(app: FastAPI, ctx: ServingContext) -> None:
    responses = ResponsesServer(ctx)

    def owner(request: Request) -> str:  # stored responses belong to the caller's API key
        return owner_of(request.headers.get("authorization"))

    @_body_route(app, ctx, "/v1/responses", ResponsesRequest, anthropic=False)
    async def create_response(request: Request, body: ResponsesRequest) -> Response:
        return await _respond(request, responses.create(body, owner(request)), anthropic=False)

    @app.get("/v1/responses/{response_id}")
    @_guarded(anthropic=False)
    async def retrieve_response(request: Request) -> Response:
        return JSONResponse(responses.retrieve(owner(request), request.path_params["response_id"]))

    @app.delete("/v1/responses/{response_id}")
    @_guarded(anthropic=False)
    async def delete_response(request: Request) -> Response:
        return JSONResponse(responses.delete(owner(request), request.path_params["response_id"]))

    @app.get("/v1/responses/{response_id}/input_items")
    @_guarded(anthropic=False)
    async def list_input_items(request: Request) -> Response:
        query = request.query_params
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            message = f"limit must be an integer, got {query['limit']!r}."
            raise APIError(message, param="limit") from None
        return JSONResponse(
            responses.input_items(
                owner(request),
                request.path_params["response_id"],
                limit=limit,
                order=query.get("order", "desc"),
                after=query.get("after"),
                include=tuple(query.getlist("include") + query.getlist("include[]")),
            )
        )

    @app.post("/v1/responses/{response_id}/cancel")
    @_guarded(anthropic=False)
    async def cancel_response(request: Request) -> Response:
        return JSONResponse(responses.cancel(owner(request), request.path_params["response_id"]))


def _add_embedding_routes(app: FastAPI, ctx: ServingContext) -> None:
    embeddings = EmbeddingServer(ctx)

    @_body_route(app, ctx, "/v1/embeddings", EmbeddingRequest, anthropic=False)
    async def create_embedding(request: Request, body: EmbeddingRequest) -> Response:
        return await _respond(request, embeddings.create(body), anthropic=False)

    pooling = PoolingServer(ctx)

    @_body_route(app, ctx, "/classify", ClassificationRequest, anthropic=False)
    async def create_classification(request: Request, body: ClassificationRequest) -> Response:
        return await _respond(request, pooling.classify(body), anthropic=False)

    @_body_route(app, ctx, "/pooling", PoolingRequest, anthropic=False)
    async def create_pooling(request: Request, body: PoolingRequest) -> Response:
        return await _respond(request, pooling.pooling(body), anthropic=False)

    for path in ("/score", "/v1/score"):

        @_body_route(app, ctx, path, ScoreRequest, anthropic=False)
        async def create_score(request: Request, body: ScoreRequest) -> Response:
            return await _respond(request, pooling.score(body), anthropic=False)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):

        @_body_route(app, ctx, path, RerankRequest, anthropic=False)
        async def do_rerank(request: Request, body: RerankRequest) -> Response:
            return await _respond(request, pooling.rerank(body), anthropic=False)


def _invocation_path(raw: Any, ctx: ServingContext) -> str:
    """The route an ``/invocations`` body belongs to, by the fields that route requires."""
    if isinstance(raw, dict):
        if "messages" in raw:
            return "/v1/chat/completions"
        if "prompt" in raw:
            return "/v1/completions"
        if "query" in raw and "documents" in raw:
            return "/rerank"
        if any(name in raw for name in ("queries", "data_1", "text_1")):  # vLLM's names
            return "/score"
        if "input" in raw:
            pooler = ctx.engine.config.model.pooler if ctx.runner == "pooling" else None
            return "/classify" if pooler is not None and pooler.labels else "/v1/embeddings"
    raise APIError(
        "/invocations answers the body of another route: send messages (chat), prompt "
        "(completions), input (embeddings, or classification on a classifier), queries and "
        "documents or text_1 and text_2 (score) or query and documents (rerank)."
    )


def _add_invocations_route(app: FastAPI, ctx: ServingContext) -> None:
    """SageMaker's one route (as vLLM serves it): the body decides which route answers."""

    @app.post("/invocations")
    @_guarded(anthropic=False)
    async def invocations(request: Request) -> Response:
        path = _invocation_path(await read_json(request), ctx)
        model, handler = app.state.body_routes[path]
        return await handler(request, await parse_body(request, model, ctx.limits))


def _add_info_routes(app: FastAPI, ctx: ServingContext) -> None:
    from pagedlm import __version__

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        data = [
            {
                "id": name,
                "object": "model",
                "created": ctx.created,
                "owned_by": "pagedlm",
                "root": ctx.model_name,
                "max_model_len": ctx.max_model_len,
            }
            for name in ctx.model_names
        ]
        data += ctx.loras.model_cards(ctx.created, ctx.max_model_len)
        return JSONResponse({"object": "list", "data": data})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/load")
    async def load(request: Request) -> JSONResponse:
        return JSONResponse({"server_load": request.app.state.server_load.value})

    if ctx.tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        @_guarded(anthropic=False)
        async def get_tokenizer_info(request: Request) -> Response:
            info = tokenizer_info(ctx.require_tokenizer(), ctx.chat_template)
            return JSONResponse({**info, "model_max_length": ctx.max_model_len})

    @app.get("/health")
    async def health() -> Response:
        state = await ctx.engine.health()
        if not state.live:
            return error_response(_health_message(state), 503)
        return Response(status_code=200)

    # SageMaker's health check, as vLLM serves it: /health under another name.
    app.get("/ping")(health)
    app.post("/ping")(health)

    @app.get("/ready")
    async def ready() -> Response:
        state = await ctx.engine.health()
        return JSONResponse(state.to_json(), status_code=200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        with contextlib.suppress(EngineDeadError, asyncio.TimeoutError):
            await asyncio.wait_for(ctx.engine.get_scheduler_stats(), HEALTH_TIMEOUT_S)
        ctx.metrics.update_engine_metrics(ctx.engine.get_metrics())
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @_body_route(app, ctx, "/tokenize", TokenizeRequest, anthropic=False)
    async def tokenize(request: Request, body: TokenizeRequest) -> Response:
        return _json_answer(await serving_tokenize.tokenize(ctx, body))

    @_body_route(app, ctx, "/detokenize", DetokenizeRequest, anthropic=False)
    async def detokenize(request: Request, body: DetokenizeRequest) -> Response:
        return _json_answer(await serving_tokenize.detokenize(ctx, body))


def _json_answer(content: dict[str, Any]) -> Response:
    """``content`` as JSON, the bytes ``JSONResponse`` renders, encoded by msgspec: a
    /tokenize answer of 1.5M tokens (11 MB) held the event loop 105 ms in ``json.dumps``
    and takes 13 ms (the encoder holds the interpreter either way, so a worker thread
    would not free the loop). For answers without floats (``json.dumps`` refuses NaN,
    msgspec writes null)."""
    return Response(msgspec.json.encode(content), media_type="application/json")


async def _log_stats(ctx: ServingContext, interval_s: float, aggregate: bool) -> None:
    line = StatsLine(aggregate)
    while True:
        engine = ctx.engine
        for level, text in line.lines(
            engine.get_metrics(), engine.metrics.hit_rates, time.monotonic()
        ):
            logger.log(level, text)
        await asyncio.sleep(interval_s)


async def _watch_engine(ctx: ServingContext, on_death: Callable[[BaseException], None]) -> None:
    on_death(await ctx.engine.wait_until_dead())  # the engine has logged the cause


def _add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    loras = ctx.loras

    @_body_route(app, ctx, "/v1/load_lora_adapter", LoadLoRAAdapterRequest, anthropic=False)
    async def load_lora_adapter(request: Request, body: LoadLoRAAdapterRequest) -> Response:
        loras.require_runtime_updating()
        if body.lora_name in ctx.model_names:  # requests for it must keep the base model
            raise APIError(
                f"lora_name {body.lora_name!r} is a name this server serves the base model "
                "under; load the adapter under another name.",
                param="lora_name",
            )
        await loras.load(ctx.engine, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @_body_route(app, ctx, "/v1/unload_lora_adapter", UnloadLoRAAdapterRequest, anthropic=False)
    async def unload_lora_adapter(request: Request, body: UnloadLoRAAdapterRequest) -> Response:
        loras.require_runtime_updating()
        lora = loras.unload(body.lora_name, body.lora_int_id)
        if lora.lora_int_id not in {other.lora_int_id for other in loras.adapters.values()}:
            await ctx.engine.remove_lora(lora.lora_int_id)  # out of the workers' memory too
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def build_app(
    ctx: ServingContext,
    api_key: str | Sequence[str] | None = None,
    max_body_bytes: int = 10 << 20,
    on_engine_death: Callable[[BaseException], None] | None = None,
    admin: AdminOptions | None = None,
    http: HttpOptions | None = None,
    log_stats_interval_s: float | None = None,
    middleware: Sequence[Any] = (),
    aggregate_engine_logging: bool = False,
) -> Any:
    """The ASGI app: FastAPI routes inside the body-size and API-key middleware, those
    inside CORS (``http``: vLLM's defaults when None), and outermost the one that answers
    requests cancelled at shutdown.

    ``on_engine_death(error)`` is called once if the engine core dies while serving.
    ``admin``: the sleep-mode and profiler switches of the admin routes (``admin.py``).
    ``log_stats_interval_s``: log vLLM's engine stats lines that often (None: never): one
    per engine, or with ``aggregate_engine_logging`` one for all (``metrics/log_line.py``).
    ``middleware``: ``--middleware``'s classes and ``(request, call_next)`` functions, run
    inside the API-key check, around the routes.
    """
    http = http or HttpOptions()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = stats = None
        if on_engine_death is not None:
            watcher = asyncio.ensure_future(_watch_engine(ctx, on_engine_death))
        if log_stats_interval_s is not None:
            stats = asyncio.ensure_future(
                _log_stats(ctx, log_stats_interval_s, aggregate_engine_logging)
            )
        if ctx.tokenizer is not None:
            ctx.chat_templates().start()  # sandbox workers start meanwhile, if trusted
        try:
            yield
        finally:
            for task in (watcher, stats):
                if task is not None:
                    task.cancel()
            if ctx.tokenizer is not None:
                await ctx.chat_templates().close()
            ctx.engine.shutdown()

    from pagedlm import __version__

    docs = {} if http.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagedlm", version=__version__, lifespan=lifespan, **docs)
    app.state.ctx = ctx
    app.state.server_load = ServerLoad(MODEL_ROUTES)
    app.state.body_models = []
    app.state.body_routes = {}

    async def http_error(request: Request, error: Exception) -> Response:
        # Unknown paths and wrong methods, in the API's error shape rather than FastAPI's.
        assert isinstance(error, HTTPException)
        anthropic = is_anthropic_path(request.url.path)
        return error_response(str(error.detail), error.status_code, anthropic=anthropic)

    app.add_exception_handler(HTTPException, http_error)
    _add_generation_routes(app, ctx)
    _add_responses_routes(app, ctx)
    _add_embedding_routes(app, ctx)
    _add_info_routes(app, ctx)
    _add_lora_routes(app, ctx)
    _add_invocations_route(app, ctx)
    install_admin_routes(app, ctx.engine, admin or AdminOptions())
    if http.docs:
        install_openapi(app, app.state.body_models)
    # vLLM's http_* series, measured around the routes, inside every other middleware.
    ctx.metrics.http.instrument(app)
    # ``--middleware``, the first outermost (each add_* wraps what was added before it).
    for extra in reversed(middleware):
        if isinstance(extra, type):
            app.add_middleware(extra)
        else:
            app.middleware("http")(extra)
    outer: Any = BodySizeLimitMiddleware(SleepingModelGuard(app, ctx.engine), max_body_bytes)
    if http.track_server_load:
        outer = ServerLoadMiddleware(outer, app.state.server_load)
    if api_key:
        outer = APIKeyMiddleware(outer, api_key)
    return CancelledRequestMiddleware(http.wrap(outer))
