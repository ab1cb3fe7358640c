"""The flags of ``pagedlm serve`` (``add_server_args``) and the serving flags ``run-batch``
shares (``add_serving_args``), with the checks made on them before the model loads."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from pagedlm.chat_content import CONTENT_FORMAT_OPTIONS
from pagedlm.entrypoints.openai.admin import add_admin_args
from pagedlm.entrypoints.openai.http_options import MAX_LOGGED_PROMPT_CHARS, add_http_args
from pagedlm.entrypoints.openai.limits import add_limit_args, limits_from_args
from pagedlm.entrypoints.openai.serving_lora import add_lora_args
from pagedlm.entrypoints.openai.vllm_server_args import add_vllm_server_args

if TYPE_CHECKING:
    from pagedlm.entrypoints.openai.limits import RequestLimits

logger = logging.getLogger("pagedlm.server")

API_KEY_ENV = "PAGEDLM_API_KEY"
ENGINE_DEATH_EXIT_STATUS = 1


def port(text: str) -> int:
    """A TCP port, as ``--port`` takes it (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; give 0-65535 (0: any free one)")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def seconds(text: str) -> float:
    """A duration of zero or more seconds (not NaN or infinite)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


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
    group.add_argument("--port", type=port, default=8000, help="Port (default: %(default)s).")
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
        type=positive_int,
        default=10 << 20,
        help="Larger request bodies get 413 (default: %(default)s).",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=30.0,
        help="Seconds in-flight requests may take to finish after SIGTERM; then they end "
        "with an error (default: %(default)s).",
    )
    group.add_argument(
        "--engine-death-grace-period",
        type=seconds,
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
        "--metric-name-prefix",
        choices=("pagedlm", "vllm"),
        default="pagedlm",
        help="The prefix of every engine metric on /metrics: pagedlm:num_requests_running, "
        "... (default), or vllm: for vLLM's own names, so dashboards, alerts, autoscalers "
        "and routers written for vLLM read them unchanged.",
    )
    add_admin_args(group)
    add_http_args(group)
    add_vllm_server_args(group)
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
        default=True,
        help="[DEPRECATED] vLLM's older switch, replaced by --enable-log-requests: requests "
        "are not logged unless that is given; --no-disable-log-requests is only warned about, "
        "as in vLLM.",
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
    _check_lora_modules(args)
    read_template_kwargs(args.default_chat_template_kwargs)
    if args.enable_log_outputs and not args.enable_log_requests:
        logger.warning("--enable-log-outputs logs nothing without --enable-log-requests; add it.")
    if args.disable_log_requests is not True:
        logger.warning(
            "argument 'disable_log_requests' is deprecated: vLLM replaced "
            "--disable-log-requests with --enable-log-requests; use that to log requests."
        )
    try:
        return limits_from_args(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def _check_lora_modules(args: argparse.Namespace) -> None:
    """``--lora-modules`` entries parse and have ``--enable-lora`` to run on; whether each
    adapter fits the model is checked once it loads."""
    from pagedlm.entrypoints.openai.serving_lora import parse_lora_module

    modules = getattr(args, "lora_modules", None) or ()
    if modules and not getattr(args, "enable_lora", False):
        raise SystemExit("error: --lora-modules needs --enable-lora.")
    for text in modules:
        try:
            parse_lora_module(text)
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


def engine_help_texts() -> dict[str, str]:
    """``serve``'s help for engine arguments the server reads too: ``--reasoning-parser``
    (an ``EngineArgs`` field, as in vLLM, so ``LLM(reasoning_parser=...)`` takes it) with
    the names registered here."""
    from pagedlm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    return {
        "reasoning_parser": "Return the model's thought (<think>...</think> and kin) as "
        "reasoning_content in chat responses, and apply grammars after it (vLLM's "
        "structured_outputs_config.reasoning_parser), by vLLM's names: "
        f"{_parser_names(list(REASONING_PARSERS), {})}. deepseek_r1: the output starts "
        "inside the thought; qwen3: only after <think>.",
    }


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
