"""vLLM's HTTP-level server flags: CORS, a proxy's root path, TLS, uvicorn's logging and the
interactive docs.

CORS is on with vLLM's defaults (every origin, method and header; no credentials), so a
browser page may call the API; ``--allowed-origins '["https://app.example"]'`` narrows it.
The preflight (``OPTIONS``) is answered before the API-key check, as browsers send it
without the key.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from pagedlm.logging_config import LOGGING_CONFIG_ENV, read_logging_config

MAX_LOGGED_PROMPT_CHARS = 200
"""``--enable-log-requests`` shows this much of a prompt unless ``--max-log-len`` says."""
H11_MAX_INCOMPLETE_EVENT_SIZE = 4 << 20
"""vLLM's default for ``--h11-max-incomplete-event-size`` (h11's own: 16 KiB)."""
H11_MAX_HEADER_COUNT = 256
"""vLLM's default for ``--h11-max-header-count``."""


def _json_list(value: str) -> list[str]:
    try:
        items = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not JSON; give a list such as '[\"*\"]'."
        ) from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list of strings.")
    return items


def add_http_args(group: argparse._ArgumentGroup) -> None:
    for name, what in (("origins", "origins"), ("methods", "methods"), ("headers", "headers")):
        group.add_argument(
            f"--allowed-{name}",
            type=_json_list,
            default=["*"],
            help=f"CORS: allowed {what}, a JSON list (default: '[\"*\"]', as vLLM).",
        )
    group.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CORS: allow credentials (default: off).",
    )
    group.add_argument(
        "--root-path",
        default="",
        help="The path prefix a proxy serves this server under (uvicorn's root_path).",
    )
    group.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file.")
    group.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file.")
    group.add_argument("--ssl-ca-certs", default=None, help="TLS: CA certificates file.")
    group.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own log level (default: --log-level).",
    )
    group.add_argument(
        "--disable-uvicorn-access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="No line per HTTP request in the log (uvicorn's access log).",
    )
    group.add_argument(
        "--disable-access-log-for-endpoints",
        type=_paths,
        default=frozenset(),
        metavar="PATHS",
        help="Comma-separated paths whose requests get no access-log line, e.g. "
        "'/health,/metrics' for probes and scrapers (vLLM's flag; default: none).",
    )
    group.add_argument(
        "--log-config-file",
        default=os.environ.get(LOGGING_CONFIG_ENV) or None,
        metavar="FILE",
        help="A JSON file in logging.config.dictConfig's schema for every logger, uvicorn's "
        "and the engine processes' included; it replaces --log-level's setup (vLLM's flag; "
        f"default: ${LOGGING_CONFIG_ENV}).",
    )
    group.add_argument(
        "--enable-server-load-tracking",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Count the generation and pooling requests in flight, served at GET /load as "
        '{"server_load": N} (vLLM\'s flag; without it /load answers 0).',
    )
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="TLS: whether clients must present a certificate (the ssl module's "
        "CERT_NONE 0, CERT_OPTIONAL 1, CERT_REQUIRED 2; default: %(default)s).",
    )
    group.add_argument("--ssl-ciphers", default=None, help="TLS: the ciphers allowed.")
    group.add_argument(
        "--h11-max-incomplete-event-size",
        type=_positive_int,
        default=H11_MAX_INCOMPLETE_EVENT_SIZE,
        help="The most bytes of a request's head (line and headers) read before it is "
        "refused with a 400 (vLLM's flag; default: %(default)s).",
    )
    group.add_argument(
        "--h11-max-header-count",
        type=_positive_int,
        default=H11_MAX_HEADER_COUNT,
        help="The most header fields a request may have; more is a 400 naming this flag "
        "(vLLM's flag; default: %(default)s).",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Answer every request with an X-Request-Id header: the client's, or a fresh "
        "id (vLLM's flag). A client's X-Request-Id names its completions either way.",
    )
    group.add_argument(
        "--disable-fastapi-docs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Serve no /docs, /redoc or /openapi.json.",
    )


@dataclass(frozen=True)
class HttpOptions:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    docs: bool = True
    request_id_headers: bool = False
    track_server_load: bool = False
    max_header_count: int = H11_MAX_HEADER_COUNT
    max_header_bytes: int = H11_MAX_INCOMPLETE_EVENT_SIZE

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpOptions:
        return cls(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
            not args.disable_fastapi_docs,
            args.enable_request_id_headers,
            args.enable_server_load_tracking,
            args.h11_max_header_count,
            args.h11_max_incomplete_event_size,
        )

    def wrap(self, app: Any) -> Any:
        """``app`` behind the header-limit, request-id and CORS middleware (CORS outermost,
        so a browser reads the refusals too)."""
        from starlette.middleware.cors import CORSMiddleware

        from pagedlm.entrypoints.openai.header_limits import HeaderLimitMiddleware
        from pagedlm.entrypoints.openai.middleware import RequestIdMiddleware

        limited = HeaderLimitMiddleware(app, self.max_header_count, self.max_header_bytes)
        return CORSMiddleware(
            RequestIdMiddleware(limited, self.request_id_headers),
            allow_origins=list(self.allowed_origins),
            allow_methods=list(self.allowed_methods),
            allow_headers=list(self.allowed_headers),
            allow_credentials=self.allow_credentials,
        )


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number.")
    return number


def _paths(value: str) -> frozenset[str]:
    paths = frozenset(path.strip() for path in value.split(",") if path.strip())
    bad = sorted(path for path in paths if not path.startswith("/"))
    if bad:
        raise argparse.ArgumentTypeError(f"{bad} are not paths; give e.g. '/health,/metrics'.")
    return paths


class AccessLogPathFilter(logging.Filter):
    """Drops uvicorn's access-log lines of the given paths (query strings aside)."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path with query, HTTP version, status).
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in self.paths
        return True


def filter_access_log(args: argparse.Namespace) -> None:
    """``--disable-access-log-for-endpoints`` on uvicorn's access logger (after uvicorn
    has configured its loggers)."""
    if args.disable_access_log_for_endpoints:
        access = logging.getLogger("uvicorn.access")
        access.addFilter(AccessLogPathFilter(args.disable_access_log_for_endpoints))


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """``uvicorn.Config`` keywords of the flags above. ``--log-config-file`` (checked at
    start-up) configures uvicorn's loggers too, their levels included unless
    ``--uvicorn-log-level`` says otherwise."""
    path = args.log_config_file
    options: dict[str, Any] = {
        "root_path": args.root_path,
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
        "ssl_ciphers": args.ssl_ciphers,
        "h11_max_incomplete_event_size": args.h11_max_incomplete_event_size,
        "log_level": args.uvicorn_log_level or (args.log_level if path is None else None),
        "access_log": not args.disable_uvicorn_access_log,
    }
    if path is not None:
        options["log_config"] = read_logging_config(path)
    return options
