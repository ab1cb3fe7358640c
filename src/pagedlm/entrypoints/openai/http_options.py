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
from dataclasses import dataclass
from typing import Any

MAX_LOGGED_PROMPT_CHARS = 200
"""``--enable-log-requests`` shows this much of a prompt unless ``--max-log-len`` says."""


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
        "--allow-credentials", action="store_true", help="CORS: allow credentials (default: off)."
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
        action="store_true",
        help="No line per HTTP request in the log (uvicorn's access log).",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="Answer every request with an X-Request-Id header: the client's, or a fresh "
        "id (vLLM's flag). A client's X-Request-Id names its completions either way.",
    )
    group.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpOptions:
        return cls(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
            not args.disable_fastapi_docs,
            args.enable_request_id_headers,
        )

    def wrap(self, app: Any) -> Any:
        """``app`` behind the request-id and CORS middleware."""
        from starlette.middleware.cors import CORSMiddleware

        from pagedlm.entrypoints.openai.middleware import RequestIdMiddleware

        return CORSMiddleware(
            RequestIdMiddleware(app, self.request_id_headers),
            allow_origins=list(self.allowed_origins),
            allow_methods=list(self.allowed_methods),
            allow_headers=list(self.allowed_headers),
            allow_credentials=self.allow_credentials,
        )


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """``uvicorn.Config`` keywords of the flags above."""
    return {
        "root_path": args.root_path,
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "log_level": args.uvicorn_log_level or args.log_level,
        "access_log": not args.disable_uvicorn_access_log,
    }
