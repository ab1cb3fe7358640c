"""``pagedlm serve``: engine start-up, uvicorn, and draining on SIGTERM (its flags:
``server_args.py``).

On SIGINT/SIGTERM uvicorn stops accepting connections and the serving context gives
in-flight requests ``--shutdown-timeout`` seconds; then it aborts those still generating,
which end with an error (an error event and ``[DONE]`` in a stream, a JSON 503
otherwise). uvicorn waits ``SHUTDOWN_GRACE_S`` more for those answers to be sent, cancels
whatever is left, and runs the app's shutdown, which stops the engine-core process.

If the engine core dies, the server answers 503 for ``--engine-death-grace-period``
seconds (so clients and probes see why) and then exits with ``ENGINE_DEATH_EXIT_STATUS``
for its supervisor to restart it, unless ``--keep-alive-on-engine-death``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.engine.core_launch import CoreLaunch
from pagedlm.engine.vllm_aliases import resolve_vllm_args
from pagedlm.entrypoints.openai.admin import AdminOptions
from pagedlm.entrypoints.openai.http_options import (
    HttpOptions,
    filter_access_log,
    uvicorn_options,
)
from pagedlm.entrypoints.openai.server_args import (
    API_KEY_ENV,
    ENGINE_DEATH_EXIT_STATUS,
    check_serving_args,
    read_chat_template,
    read_template_kwargs,
)
from pagedlm.entrypoints.openai.serving_lora import registry_from_args
from pagedlm.entrypoints.openai.vllm_server_args import check_vllm_server_args
from pagedlm.logging_config import LOG_LEVEL_ENV, LOGGING_CONFIG_ENV, configure_logging
from pagedlm.metrics.log_line import DEFAULT_INTERVAL_S

if TYPE_CHECKING:
    from pagedlm.entrypoints.openai.limits import RequestLimits
    from pagedlm.entrypoints.openai.serving_engine import ServingContext

logger = logging.getLogger("pagedlm.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SHUTDOWN_GRACE_S = 3.0
"""After --shutdown-timeout, how long cut requests have to send their error answers."""
ALL_INTERFACES = "0.0.0.0"
"""What ``--host`` binds by default, as vLLM does (its default, None, binds every IPv4
interface)."""


def _uvicorn_server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown, killing the process
        before the engine's own shutdown has run; here the signal only starts the drain,
        and ``pagedlm serve`` exits 0. ``on_shutdown`` runs as the drain starts."""

        on_shutdown: Callable[[], None] | None = None

        async def shutdown(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            if self.on_shutdown is not None:
                self.on_shutdown()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            signals = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


class _EngineDeathExit:
    """Stops uvicorn ``grace_s`` after the engine died (unless ``keep_alive``); ``died``
    tells ``run_server`` to exit non-zero."""

    def __init__(self, grace_s: float, keep_alive: bool) -> None:
        self.grace_s = grace_s
        self.keep_alive = keep_alive
        self.server: Any = None
        self.died = False

    def __call__(self, error: BaseException) -> None:
        self.died = True
        if self.keep_alive:
            logger.error("Staying up after the engine's death (--keep-alive-on-engine-death).")
            return
        logger.error(
            "Exiting with status %d in %.1f s so that a supervisor restarts the server "
            "(--keep-alive-on-engine-death to stay up).",
            ENGINE_DEATH_EXIT_STATUS,
            self.grace_s,
        )
        asyncio.get_running_loop().call_later(self.grace_s, self._stop)

    def _stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


def load_middleware(paths: list[str]) -> list[Any]:
    """The ``--middleware`` objects, imported before the model loads (a bad path exits)."""
    from pagedlm.qualified_names import import_object

    loaded = []
    for path in paths:
        try:
            found = import_object(path, "middleware")
        except ValueError as error:
            raise SystemExit(f"error: --middleware: {error}") from None
        if not (isinstance(found, type) or inspect.iscoroutinefunction(found)):
            raise SystemExit(
                f"error: --middleware {path} is {found!r}; give an ASGI middleware class or "
                "an async function (request, call_next)."
            )
        loaded.append(found)
    return loaded


def bind_listener(host: str | None, port: int, uds: str | None = None) -> socket.socket:
    """The server's listening socket, bound now so that a busy or forbidden address stops
    ``pagedlm serve`` at once, with the fix, instead of after the model has loaded; on
    every IPv4 interface when ``host`` is None. With ``uds``, a Unix domain socket at that
    path (``host`` and ``port`` unused)."""
    if uds is not None:
        return _bind_unix(uds)
    host = host or ALL_INTERFACES
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        listener.bind((host, port))
        listener.listen(2048)
    except OSError as error:
        listener.close()
        reason = error.strerror or str(error)
        raise SystemExit(
            f"error: cannot listen on {host}:{port} ({reason}); choose another --port "
            "(or --host), or stop the process that uses it."
        ) from None
    return listener


def _bind_unix(path: str) -> socket.socket:
    """A Unix socket at ``path``; a socket file left there by a server that is gone is
    replaced, one a server still answers on is an error, as is any other file."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise SystemExit(f"error: --uds {path} exists and is not a socket; choose another.")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a stale socket
        else:
            raise SystemExit(f"error: a server already listens on --uds {path}; stop it first.")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(2048)
    except OSError as error:
        listener.close()
        raise SystemExit(f"error: cannot listen on --uds {path} ({error.strerror}).") from None
    return listener


def _tracer_provider(endpoint: str | None) -> Any:
    """OpenTelemetry's provider for ``--otlp-traces-endpoint`` (None: tracing is off and
    nothing of it is imported), checked before the model loads."""
    if endpoint is None:
        return None
    from pagedlm.entrypoints.openai.tracing import make_tracer_provider

    try:
        return make_tracer_provider(endpoint)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def _import_server_modules() -> None:
    import uvicorn  # noqa: F401

    import pagedlm.entrypoints.openai.app
    import pagedlm.entrypoints.openai.serving_engine
    import pagedlm.metrics.prometheus  # noqa: F401


def _configure_logging(args: argparse.Namespace) -> None:
    """The server's logging (``--log-level``, or ``--log-config-file`` for this process
    and, through the environment, the engine core and its workers); a bad file exits."""
    try:
        configure_logging(args.log_level, args.log_config_file)
    except ValueError as error:
        raise SystemExit(f"error: --log-config-file: {error}") from None
    if args.log_config_file is not None:
        os.environ[LOGGING_CONFIG_ENV] = args.log_config_file


def serving_context(
    args: argparse.Namespace,
    engine: Any,
    names: list[str],
    limits: RequestLimits,
    chat_template: str | None,
) -> ServingContext:
    """The routes' context for ``engine`` from the server flags (also ``run-batch``'s);
    a bad ``--lora-modules`` entry exits naming it."""
    from pagedlm.entrypoints.openai.serving_engine import ServingContext
    from pagedlm.metrics.prometheus import PrometheusMetrics

    try:
        loras = asyncio.run(registry_from_args(args, engine, names[0]))
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return ServingContext(
        engine=engine,
        model_names=list(names),
        metrics=PrometheusMetrics(names[0], getattr(args, "metric_name_prefix", "pagedlm")),
        chat_template=chat_template,
        default_chat_template_kwargs=read_template_kwargs(args.default_chat_template_kwargs),
        chat_template_content_format=args.chat_template_content_format,
        tokenizer=engine.get_tokenizer(),
        max_model_len=engine.config.model.max_model_len,
        tool_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser or None,
        structured_outputs_after_reasoning=engine.config.structured_outputs_reasoning is not None,
        limits=limits,
        trust_request_chat_template=args.trust_request_chat_template,
        loras=loras,
        structured_outputs_backend=engine.config.structured_outputs_backend,
        structured_outputs_max_spec_chars=args.structured_outputs_max_spec_chars,
        runner=engine.config.model.runner,
        sampling_defaults=engine.config.model.sampling_defaults,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        response_role=args.response_role,
        force_include_usage=args.enable_force_include_usage,
        log_requests=args.enable_log_requests,
        log_outputs=args.enable_log_outputs,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        log_error_stack=args.log_error_stack,
        tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        log_deltas=args.enable_log_deltas,
        max_log_len=args.max_log_len,
    )


def run_server(args: argparse.Namespace, core_launch: CoreLaunch | None = None) -> None:
    """Start the engine (in ``core_launch``'s process, started before the server's imports,
    if given; the caller abandons it if the engine never starts), then serve until
    SIGINT/SIGTERM (or the engine's death)."""
    from pagedlm.engine.async_llm import AsyncLLM

    limits = check_serving_args(args)
    if not args.engine_death_grace_period >= 0:
        raise SystemExit("error: --engine-death-grace-period must be >= 0 seconds.")
    _configure_logging(args)
    check_vllm_server_args(args)
    engine_args = engine_args_from_cli(args)
    try:  # vLLM's flags that pagedlm refuses fail before the port is taken
        resolve_vllm_args(engine_args, warn=False)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    tracer_provider = _tracer_provider(args.otlp_traces_endpoint)
    middleware = load_middleware(args.middleware)
    # A busy port fails before the model loads.
    listener = bind_listener(args.host, args.port, args.uds)
    # The engine-core process logs its loading progress at the server's level.
    os.environ.setdefault(LOG_LEVEL_ENV, args.log_level.upper())
    started = time.monotonic()
    chat_template = read_chat_template(args.chat_template)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not all(api_key):
        raise SystemExit("error: --api-key takes non-empty keys.")
    names = args.served_model_name or [engine_args.model or DEFAULT_MODEL_NAME]
    try:
        # The server's own modules (FastAPI, uvicorn: ~0.5 s) import while the core loads.
        engine = AsyncLLM.from_engine_args(engine_args, core_launch, _import_server_modules)
    except BaseException:
        listener.close()
        raise
    import uvicorn

    from pagedlm.entrypoints.openai.app import build_app

    try:
        ctx = serving_context(args, engine, names, limits, chat_template)
        if tracer_provider is not None:
            from pagedlm.entrypoints.openai.tracing import RequestTracer

            ctx.tracer = RequestTracer(tracer_provider, names[0])
        on_death = _EngineDeathExit(args.engine_death_grace_period, args.keep_alive_on_engine_death)
        app = build_app(
            ctx,
            api_key=api_key,
            max_body_bytes=args.max_request_body_bytes,
            on_engine_death=on_death,
            admin=AdminOptions.from_args(args),
            http=HttpOptions.from_args(args),
            log_stats_interval_s=None if args.disable_log_stats else DEFAULT_INTERVAL_S,
            aggregate_engine_logging=args.aggregate_engine_logging,
            middleware=middleware,
        )
        if ctx.tracer is not None:
            from pagedlm.entrypoints.openai.tracing import TraceContextMiddleware

            app = TraceContextMiddleware(app)
        scheme = "https" if args.ssl_certfile else "http"
        host = args.host or ALL_INTERFACES
        where = f"unix:{args.uds}" if args.uds else f"{scheme}://{host}:{args.port}"
        logger.info(
            "Engine ready in %.1f s; serving %s on %s%s%s",
            time.monotonic() - started,
            names,
            where,
            args.root_path,
            " (API key required)" if api_key else "",
        )
        config = uvicorn.Config(
            app,
            host=host,
            port=args.port,
            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE_S,
            lifespan="on",
            **uvicorn_options(args),
        )
        filter_access_log(args)  # uvicorn.Config has configured its loggers
        server = on_death.server = _uvicorn_server_class()(config)
        server.on_shutdown = lambda: ctx.begin_shutdown(args.shutdown_timeout)
        server.run(sockets=[listener])
    finally:
        listener.close()
        if args.uds is not None:
            with contextlib.suppress(OSError):
                os.unlink(args.uds)  # the socket file goes with the server
        engine.shutdown()
        if tracer_provider is not None:
            tracer_provider.shutdown()  # export the spans still queued
    if on_death.died and not on_death.keep_alive:
        # Everything is shut down; skip the interpreter's teardown (seconds, mostly torch
        # unloading) so that the supervisor restarts the server sooner.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(ENGINE_DEATH_EXIT_STATUS)
