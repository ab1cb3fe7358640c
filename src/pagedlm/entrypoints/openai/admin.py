"""vLLM's admin endpoints: prefix-cache reset, sleep mode and the torch profiler.

- ``POST /reset_prefix_cache``: forget every cached prefix (200); 409 while requests hold
  KV blocks (the cache cannot be reset under them).
- ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``: sleep mode
  (``pagedlm.worker.sleep``), which needs ``--enable-sleep-mode`` as in vLLM (a 400 naming
  the flag otherwise). Sleeping with unfinished requests is refused (409): drain first.
  ``/wake_up?tags=weights`` then ``?tags=kv_cache`` wakes one part at a time (vLLM's tags;
  an unknown tag is a 400, the KV cache before the weights a 409); the model sleeps until
  both are awake.
  While the model sleeps, the routes that need it (completions, chat, messages,
  embeddings, responses, ...) answer 503 naming ``/wake_up``, as vLLM's do; the others
  (models, tokenize, health, metrics) keep working.
- ``POST /update_weights_from_disk`` ``{"model_path": DIR}`` (SGLang's route, for
  reinforcement-learning loops): load a checkpoint of the served model's shape in place of
  its weights; needs ``--enable-weight-updates`` (a 400 naming it otherwise). Refused
  (400, saying why) while requests run, while asleep, or for another shape; answers
  ``{"success": true, "message": ...}``.
- ``POST /pause?mode=abort|wait|keep&clear_cache=true``, ``POST /resume``,
  ``GET /is_paused``: ``AsyncLLM.pause_generation`` and its peers over HTTP (vLLM's routes,
  for a trainer that updates the weights between rollouts). New requests wait while
  paused. They exist with ``--enable-weight-updates`` or vLLM's ``VLLM_SERVER_DEV_MODE=1``
  (``PAGEDLM_SERVER_DEV_MODE=1``), and are absent (404) otherwise, as in vLLM; a bad mode
  is a 400.
- ``POST /start_profile``, ``POST /stop_profile``: a torch profiler in the engine core,
  whose trace lands in ``--profiler-dir``; without that flag the routes do not exist (404),
  as in vLLM without ``VLLM_TORCH_PROFILER_DIR``.

With ``--api-key`` these routes need the key like every ``/v1`` route.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedlm.engine.exceptions import EngineDeadError
from pagedlm.entrypoints.openai.errors import error_bytes, error_response
from pagedlm.worker.sleep import check_tags

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger("pagedlm.server")

MODEL_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/responses",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/invocations",
)
"""Routes that need the model's weights: 503 while it sleeps (``count_tokens`` does not)."""
SLEEPING_MESSAGE = "The model is sleeping (POST /sleep); POST /wake_up first."


DEV_MODE_ENVS = ("PAGEDLM_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")


@dataclass(frozen=True)
class AdminOptions:
    enable_sleep_mode: bool = False
    profiler_dir: str | None = None
    enable_weight_updates: bool = False
    dev_mode: bool = False
    """vLLM's ``VLLM_SERVER_DEV_MODE``: the routes of a training loop without
    ``--enable-weight-updates`` (today: pause and resume)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdminOptions:
        dev_mode = any(os.environ.get(name, "0").lower() in ("1", "true") for name in DEV_MODE_ENVS)
        return cls(args.enable_sleep_mode, args.profiler_dir, args.enable_weight_updates, dev_mode)


def add_admin_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--enable-weight-updates",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='Allow POST /update_weights_from_disk {"model_path": DIR} (SGLang\'s route): '
        "load a checkpoint of the served model's shape from the server's disk in place of "
        "its weights, e.g. a trainer's between rollouts.",
    )
    group.add_argument(
        "--profiler-dir",
        default=None,
        help="Serve POST /start_profile and /stop_profile, writing torch profiler traces of "
        "the engine core here (vLLM's VLLM_TORCH_PROFILER_DIR). Default: off (404).",
    )


class SleepingModelGuard:
    """Answers 503 on ``MODEL_ROUTES`` while the engine sleeps; everything else passes."""

    def __init__(self, app: ASGIApp, engine: Any) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path in MODEL_ROUTES and _sleep_level(self.engine):
            body = error_bytes(SLEEPING_MESSAGE, 503, path)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _sleep_level(engine: Any) -> int:
    return getattr(engine, "sleep_level", 0)


async def _answer(call: Awaitable[Response], refused_status: int = 409) -> Response:
    """The engine's refusals (ValueError) as ``refused_status``, a dead engine as 503."""
    try:
        return await call
    except ValueError as error:
        return error_response(str(error), refused_status)
    except EngineDeadError as error:
        return error_response(f"The engine core is not running ({error}).", 503)


def install_admin_routes(app: FastAPI, engine: Any, options: AdminOptions) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        async def reset() -> Response:
            if not await engine.reset_prefix_cache():
                raise ValueError(
                    "The prefix cache cannot be reset while requests hold KV blocks; "
                    "retry when they have finished."
                )
            return Response(status_code=200)

        return await _answer(reset())

    _install_sleep_routes(app, engine, options)
    _install_weight_routes(app, engine, options)
    if options.enable_weight_updates or options.dev_mode:
        _install_pause_routes(app, engine)
    if options.profiler_dir is not None:
        _install_profiler_routes(app, engine, options.profiler_dir)


def _install_sleep_routes(app: FastAPI, engine: Any, options: AdminOptions) -> None:
    def check_enabled() -> Response | None:
        if options.enable_sleep_mode:
            return None
        return error_response(
            "Sleep mode is off; restart the server with --enable-sleep-mode.", 400
        )

    @app.post("/sleep")
    async def sleep(level: str = "1") -> Response:
        refused = check_enabled()
        if refused is not None:
            return refused
        if level not in ("1", "2"):
            return error_response(f"level={level!r} is not a sleep level; use 1 or 2.", 400)
        return await _answer(_timed("sleep", engine.sleep(int(level))))

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        refused = check_enabled()
        if refused is not None:
            return refused
        tags = request.query_params.getlist("tags")
        if not tags:
            return await _answer(_timed("wake_up", engine.wake_up()))
        try:
            check_tags(tags)
        except ValueError as error:
            return error_response(str(error), 400)
        return await _answer(_timed("wake_up", engine.wake_up(tags)))

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": _sleep_level(engine) > 0})


def _install_weight_routes(app: FastAPI, engine: Any, options: AdminOptions) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        if not options.enable_weight_updates:
            return error_response(
                "Weight updates are off; restart the server with --enable-weight-updates.", 400
            )
        try:
            body = await request.json()
        except ClientDisconnect:  # gone before its body arrived: nobody reads this (as app.py)
            return Response(status_code=499)
        except ValueError:
            body = None
        model_path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(model_path, str) or not model_path:
            return error_response('Send a JSON object {"model_path": "/path/to/checkpoint"}.', 400)

        async def update() -> Response:
            await _timed("update_weights_from_disk", engine.update_weights_from_disk(model_path))
            message = f"Loaded the weights of {model_path}."
            return JSONResponse({"success": True, "message": message})

        return await _answer(update(), refused_status=400)


def _install_pause_routes(app: FastAPI, engine: Any) -> None:
    @app.post("/pause")
    async def pause(
        mode: str = "abort", wait_for_inflight_requests: bool = False, clear_cache: bool = True
    ) -> Response:
        async def pause() -> Response:
            await _timed(
                "pause",
                engine.pause_generation(
                    mode=mode,
                    wait_for_inflight_requests=wait_for_inflight_requests or None,
                    clear_cache=clear_cache,
                ),
            )
            return JSONResponse({"status": "paused"})

        return await _answer(pause(), refused_status=400)

    @app.post("/resume")
    async def resume() -> Response:
        async def resume() -> Response:
            await _timed("resume", engine.resume_generation())
            return JSONResponse({"status": "resumed"})

        return await _answer(resume())

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": await engine.is_paused()})


def _install_profiler_routes(app: FastAPI, engine: Any, directory: str) -> None:
    @app.post("/start_profile")
    async def start_profile() -> Response:
        return await _answer(_timed("start_profile", engine.start_profile(directory)))

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        return await _answer(_timed("stop_profile", engine.stop_profile()))


async def _timed(
    what: str, call: Awaitable[Any], log: Callable[..., None] = logger.info
) -> Response:
    started = time.monotonic()
    await call
    log("%s took %.2f s", what, time.monotonic() - started)
    return Response(status_code=200)
