"""vLLM's ``serve`` flags that pagedlm takes so that a vLLM command line runs unchanged,
although nothing of pagedlm's stands behind them: vLLM's default (and what means the same
here) passes silently, a value that changes nothing here is logged as having no effect,
and one that selects a feature pagedlm does not have is refused before the model loads,
naming the fix (as ``pagedlm.engine.vllm_compat_args`` does for the engine's)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from pagedlm.engine.vllm_compat_args import IGNORED, UNSUPPORTED, VllmOnly

logger = logging.getLogger("pagedlm.server")

FRONTEND = "Frontend"

_FLAGS: dict[str, tuple[dict[str, Any], VllmOnly]] = {
    "headless": (
        {"action": argparse.BooleanOptionalAction, "default": False},
        VllmOnly(
            UNSUPPORTED, FRONTEND, "pagedlm has no headless data-parallel nodes",
            "serve every replica from one node with --data-parallel-size",
        ),
    ),
    "api_server_count": (
        {"type": int, "default": None, "short": "-asc"},
        VllmOnly(
            UNSUPPORTED, FRONTEND, "one API server process serves the engine",
            "drop it, or start several servers behind a load balancer", ok=(1,),
        ),
    ),
    "disable_frontend_multiprocessing": (
        {"action": argparse.BooleanOptionalAction, "default": False},
        VllmOnly(IGNORED, FRONTEND, "the engine core always runs in its own process"),
    ),
    "enable_ssl_refresh": (
        {"action": argparse.BooleanOptionalAction, "default": False},
        VllmOnly(
            UNSUPPORTED, FRONTEND, "TLS files are read once, at start",
            "restart the server after renewing the certificate",
        ),
    ),
    "tool_server": (
        {"default": None},
        VllmOnly(
            UNSUPPORTED, FRONTEND, "pagedlm runs no built-in tool servers (MCP, demo)",
            "have the client run the tools it passes in each request",
        ),
    ),
    "tokens_only": (
        {"action": argparse.BooleanOptionalAction, "default": False},
        VllmOnly(
            UNSUPPORTED, FRONTEND, "there is no tokens-only serving mode",
            "send token ids as prompts to /v1/completions",
        ),
    ),
    "enable_offline_docs": (
        {"action": argparse.BooleanOptionalAction, "default": False},
        VllmOnly(
            UNSUPPORTED, FRONTEND, "/docs loads its assets from the web",
            "read /openapi.json, or --disable-fastapi-docs",
        ),
    ),
}  # fmt: skip


def add_vllm_server_args(group: argparse._ArgumentGroup) -> None:
    for name, (options, spec) in _FLAGS.items():
        options = dict(options)
        flags = ["--" + name.replace("_", "-"), *filter(None, [options.pop("short", None)])]
        if spec.kind == IGNORED:
            text = f"vLLM's flag, accepted without effect: {spec.why}."
        else:
            text = f"vLLM's flag; only its default is accepted: {spec.why} ({spec.fix})."
        group.add_argument(*flags, help=text, **options)


def check_vllm_server_args(args: argparse.Namespace) -> None:
    """Exit, naming the fix, on an unsupported value of these flags; log the ignored ones
    that are not vLLM's defaults."""
    for name, (options, spec) in _FLAGS.items():
        value = getattr(args, name)
        if value is None or value == options["default"] or value in spec.ok:
            continue
        flag = "--" + name.replace("_", "-")
        if spec.kind == IGNORED:
            logger.warning("%s has no effect in pagedlm: %s.", flag, spec.why)
            continue
        given = flag if value is True else f"{flag} {value}"
        raise SystemExit(
            f"error: {given} is vLLM's, and pagedlm does not support it: {spec.why}; {spec.fix}."
        )
