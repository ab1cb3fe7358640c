"""``pagedlm serve``: server flags, engine start-up, uvicorn, and draining on SIGTERM.

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
import json
import logging
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pagedlm.chat_content import CONTENT_FORMAT_OPTIONS
from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.engine.core_launch import CoreLaunch
from pagedlm.entrypoints.openai.admin import AdminOptions, add_admin_args
from pagedlm.entrypoints.openai.http_options import (
    MAX_LOGGED_PROMPT_CHARS,
    HttpOptions,
    add_http_args,
    filter_access_log,
    uvicorn_options,
)
from pagedlm.entrypoints.openai.limits import add_limit_args, limits_from_args
from pagedlm.entrypoints.openai.serving_lora import add_lora_args, registry_from_args
from pagedlm.logging_config import LOG_LEVEL_ENV, LOGGING_CONFIG_ENV, configure_logging
from pagedlm.metrics.log_line import DEFAULT_INTERVAL_S

if TYPE_CHECKING:
    from pagedlm.entrypoints.openai.limits import RequestLimits
    from pagedlm.entrypoints.openai.serving_engine import ServingContext

logger = logging.getLogger("pagedlm.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
API_KEY_ENV = "PAGEDLM_API_KEY"
SHUTDOWN_GRACE_S = 3.0
"""After --shutdown-timeout, how long cut requests have to send their error answers."""
ENGINE_DEATH_EXIT_STATUS = 1
ALL_INTERFACES = "0.0.0.0"
"""What ``--host`` binds by default, as vLLM does (its default, None, binds every IPv4
interface)."""


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``pagedlm serve``'s flags: how requests are served (``add_serving_args``), then the
    listener's, the process's and the HTTP layer's."""
    add_serving_args(parser)
    group = parser.add_argument_group("server arguments")
    group.add_argument(
        "--host",
        default=None,
        help="Address to bind (default: every IPv4 interface, as vLLM; 127.0.0.1 for this "
        "machine only).",
    )
    group.add_argument("--port", type=int, default=8000, help="Port (default: %(default)s).")
    group.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="Listen on a Unix domain socket at PATH instead of --host/--port (vLLM's flag).",
    )
    group.add_argument(
        "--middleware",
        action="append",
        default=[],
        metavar="IMPORT_PATH",
        help="Add an ASGI middleware ('package.module:Name'; repeatable, the first "
        "outermost): a class taking the app, or an async function (request, call_next) "
        "(vLLM's flag).",
    )
    group.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="Require one of these keys as 'Authorization: Bearer <key>' or 'x-api-key' "
        f"(default: ${API_KEY_ENV} if set). /health, /ready and /metrics stay open.",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=10 << 20,
        help="Larger request bodies get 413 (default: %(default)s).",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="Seconds in-flight requests may take to finish after SIGTERM; then they end "
        "with an error (default: %(default)s).",
    )
    group.add_argument(
        "--engine-death-grace-period",
        type=float,
        default=2.0,
        help="Seconds the server keeps answering 503 after the engine core died, before "
        f"it exits with status {ENGINE_DEATH_EXIT_STATUS} (default: %(default)s).",
    )
    group.add_argument(
        "--keep-alive-on-engine-death",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Stay up (answering 503) after the engine core died instead of exiting "
        "(vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH).",
    )
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="Send one OpenTelemetry span per request to this OTLP/HTTP traces URL (e.g. "
        "http://localhost:4318/v1/traces); a W3C traceparent header is its parent. Needs "
        "pip install 'pagedlm[tracing]' (default: off).",
    )
    group.add_argument(
        "--disable-log-stats",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="No periodic line of throughput, running and waiting requests and cache usage "
        "(every 10 s while the engine is busy).",
    )
    add_admin_args(group)
    add_http_args(group)
    return parser


def add_serving_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """How the routes answer: model names, chat template, request limits, tools, LoRA,
    request logging. ``serve`` and ``run-batch`` take these (``serving_context`` reads
    them); the listener's flags are ``serve``'s alone."""
    group = parser.add_argument_group("serving arguments")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Name(s) clients use in 'model'; the first is reported (default: the model argument).",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template: a file path or the template itself (default: the tokenizer's).",
    )
    group.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="Keyword arguments for the chat template of every request, a JSON object such "
        "as '{\"enable_thinking\": false}'; a request's chat_template_kwargs override them "
        "key by key (vLLM's flag; default: none).",
    )
    group.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=CONTENT_FORMAT_OPTIONS,
        help="How message content reaches the chat template: 'string' (text parts joined "
        'with newlines), \'openai\' (a list of {"type": "text", "text": ...} parts) or '
        "'auto', the one the template reads (a template that loops over a message's "
        "content gets 'openai') (vLLM's flag; default: %(default)s).",
    )
    group.add_argument(
        "--enable-tokenizer-info-endpoint",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Serve GET /tokenizer_info: the tokenizer's configuration and the chat template "
        "(vLLM's flag; off: they may be private to the deployment).",
    )
    group.add_argument(
        "--response-role",
        default="assistant",
        help="The role chat completions answer with (default: %(default)s).",
    )
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_limit_args(group)
    group.add_argument(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Accept a chat_template in requests (vLLM's flag; refused with 400 otherwise). "
        "Trusted request templates render in a sandboxed worker process with a time and "
        "size limit.",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Report usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix "
        "cache served) on completions and chat (vLLM's flag; default: off).",
    )
    group.add_argument(
        "--enable-force-include-usage",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="End every stream with the usage chunk, as stream_options.include_usage asks "
        "(vLLM's flag; default: off).",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Write logprobs' tokens as 'token_id:<id>' for requests that do not say "
        "(their return_tokens_as_token_ids field; default: off).",
    )
    group.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Log each request's id, prompt (its first characters) and parameters.",
    )
    group.add_argument(
        "--max-log-len",
        type=int,
        default=MAX_LOGGED_PROMPT_CHARS,
        help="With --enable-log-requests, the most characters of a prompt logged "
        "(default: %(default)s).",
    )
    group.add_argument(
        "--enable-log-outputs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="With --enable-log-requests, log each request's generated text and token ids "
        "when it finishes (vLLM's flag).",
    )
    group.add_argument(
        "--enable-log-deltas",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --enable-log-outputs, log each streamed piece as it goes out too "
        "(vLLM's flag; default: on).",
    )
    group.add_argument(
        "--log-error-stack",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Log the traceback of every exception a request's error answer came from "
        "(vLLM's flag; unexpected errors are always logged with theirs).",
    )
    group.add_argument(
        "--disable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Do not log requests: the default (vLLM's older spelling, kept for its command "
        "lines).",
    )
    _add_tool_args(group)
    add_lora_args(group)
    return parser


def check_serving_args(args: argparse.Namespace) -> RequestLimits:
    """``add_serving_args``'s flags checked before the model loads (a bad one exits,
    naming it); the request limits they set."""
    from pagedlm.entrypoints.openai.parser_plugins import check_parser_args

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("error: --enable-auto-tool-choice needs --tool-call-parser (e.g. hermes).")
    check_parser_args(args)
    read_template_kwargs(args.default_chat_template_kwargs)
    if args.enable_log_outputs and not args.enable_log_requests:
        logger.warning("--enable-log-outputs logs nothing without --enable-log-requests; add it.")
    try:
        return limits_from_args(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def _parser_names(names: list[str], aliases: dict[str, str]) -> str:
    """``names`` for a help text, each alias in parentheses after the name it stands for."""
    listed = []
    for name in sorted(set(names) - set(aliases)):
        others = sorted(alias for alias, target in aliases.items() if target == name)
        listed.append(f"{name} ({', '.join(others)})" if others else name)
    return ", ".join(listed)


def _add_tool_args(group: argparse._ArgumentGroup) -> None:
    from pagedlm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from pagedlm.entrypoints.openai.tool_parsers import TOOL_PARSER_ALIASES, TOOL_PARSERS

    group.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="How tool calls are read from the model's text for tool_choice='auto', by "
        f"vLLM's names: {_parser_names(list(TOOL_PARSERS), TOOL_PARSER_ALIASES)}, or one a "
        "--tool-parser-plugin registers. The model families of each are in the README's "
        "tool-calling section.",
    )
    group.add_argument(
        "--tool-parser-plugin",
        default=None,
        metavar="FILE",
        help="A .py file (or module name) that registers tool parsers of its own with "
        "pagedlm.entrypoints.openai.tool_parsers.register_tool_parser.",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Allow tool_choice='auto' (needs --tool-call-parser); it is then the default "
        "when a request has tools. 'required' and named tools work without it.",
    )
    group.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Leave a request's tools out of its prompt when its tool_choice is 'none' "
        "(vLLM's flag; by default the template sees them, and the model is not asked to "
        "call one).",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="Return the model's thought (<think>...</think> and kin) as reasoning_content "
        f"in chat responses, by vLLM's names: {_parser_names(list(REASONING_PARSERS), {})}. "
        "deepseek_r1: the output starts inside the thought; qwen3: only after <think>.",
    )
    group.add_argument(
        "--reasoning-parser-plugin",
        default=None,
        metavar="FILE",
        help="A .py file (or module name) that registers reasoning parsers of its own with "
        "pagedlm.entrypoints.openai.reasoning_parsers.register_reasoning_parser.",
    )


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's contents, or the template given inline."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if "{" not in value:
        raise SystemExit(
            f"error: --chat-template {value!r} is neither a file nor a Jinja template."
        )
    return value


def read_template_kwargs(value: Any) -> dict[str, Any]:
    """``--default-chat-template-kwargs``: a JSON object (a mapping from a ``--config``
    file) of keys the server does not set itself; a bad one exits naming the flag."""
    from pagedlm.entrypoints.openai.protocol import RESERVED_TEMPLATE_KWARGS

    flag = "--default-chat-template-kwargs"
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise SystemExit(f"error: {flag} is not JSON ({error}): {value!r}.") from None
    if not isinstance(value, dict):
        raise SystemExit(
            f"error: {flag} takes a JSON object such as '{{\"enable_thinking\": false}}', "
            f"not {value!r}."
        )
    reserved = sorted(set(value) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise SystemExit(
            f"error: {flag} may not set {reserved}: the server sets these itself from each "
            "request (its tools, add_generation_prompt, ...)."
        )
    return value


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
        metrics=PrometheusMetrics(names[0]),
        chat_template=chat_template,
        default_chat_template_kwargs=read_template_kwargs(args.default_chat_template_kwargs),
        chat_template_content_format=args.chat_template_content_format,
        tokenizer=engine.get_tokenizer(),
        max_model_len=engine.config.model.max_model_len,
        tool_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        limits=limits,
        trust_request_chat_template=args.trust_request_chat_template,
        loras=loras,
        structured_outputs_backend=engine.config.structured_outputs_backend,
        runner=engine.config.model.runner,
        sampling_defaults=engine.config.model.sampling_defaults,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        response_role=args.response_role,
        force_include_usage=args.enable_force_include_usage,
        log_requests=args.enable_log_requests and not args.disable_log_requests,
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
    tracer_provider = _tracer_provider(args.otlp_traces_endpoint)
    middleware = load_middleware(args.middleware)
    # A busy port fails before the model loads.
    listener = bind_listener(args.host, args.port, args.uds)
    # The engine-core process logs its loading progress at the server's level.
    os.environ.setdefault(LOG_LEVEL_ENV, args.log_level.upper())
    started = time.monotonic()
    engine_args = engine_args_from_cli(args)
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
