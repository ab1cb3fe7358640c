"""Caps on the list sizes of a request, each one a ``pagedlm serve`` flag.

A body within ``--max-request-body-bytes`` can still hold 10k stop strings or 100k
messages, each of which costs the server work per token or per render; these caps refuse
such requests up front with a 400 that names the flag. Defaults follow vLLM's where it has
one (4 stop strings, 1,024 prompts per completion request) and OpenAI's API otherwise
(128 tools).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedlm.entrypoints.openai.errors import APIError


@dataclass(frozen=True)
class RequestLimits:
    """The most items a request may send in each capped field (all at least 1)."""

    max_stop_strings: int = 4
    """``stop`` (OpenAI) / ``stop_sequences`` (Anthropic) entries."""
    max_logit_bias_tokens: int = 1024
    """``logit_bias`` entries."""
    max_tools: int = 128
    """``tools`` entries."""
    max_messages: int = 4096
    """``messages`` entries (chat, Anthropic and /tokenize)."""
    max_completion_prompts: int = 1024
    """Prompts in one /v1/completions request (a list of strings or of token-id lists)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                flag = "--" + field.name.replace("_", "-")
                raise ValueError(f"{flag} must be at least 1, got {getattr(self, field.name)}.")

    def check(self, body: Any) -> None:
        """``APIError`` 400 naming the field and the flag when ``body`` exceeds a cap."""
        for field_name, count, limit_name in (
            ("stop", _num_stop_strings(getattr(body, "stop", None)), "max_stop_strings"),
            ("stop_sequences", _length(body, "stop_sequences"), "max_stop_strings"),
            ("logit_bias", _length(body, "logit_bias"), "max_logit_bias_tokens"),
            ("tools", _length(body, "tools"), "max_tools"),
            ("messages", _length(body, "messages"), "max_messages"),
            ("prompt", _num_prompts(getattr(body, "prompt", None)), "max_completion_prompts"),
            (
                "prompt_embeds",
                _num_embeds(getattr(body, "prompt_embeds", None)),
                "max_completion_prompts",
            ),
        ):
            limit = getattr(self, limit_name)
            if count > limit:
                flag = "--" + limit_name.replace("_", "-")
                raise APIError(
                    f"{field_name} has {count} entries; this server accepts at most {limit} "
                    f"(its {flag} flag). Send fewer, or restart the server with a larger {flag}.",
                    param=field_name,
                )


def _length(body: Any, name: str) -> int:
    value = getattr(body, name, None)
    return 0 if value is None else len(value)


def _num_stop_strings(stop: Any) -> int:
    if stop is None:
        return 0
    return 1 if isinstance(stop, str) else len(stop)


def _num_embeds(prompt_embeds: Any) -> int:
    # One base64 string, or a list of them.
    if prompt_embeds is None:
        return 0
    return len(prompt_embeds) if isinstance(prompt_embeds, list) else 1


def _num_prompts(prompt: Any) -> int:
    # One string or one list of token ids is one prompt; lists of either are batches.
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return 1 if prompt is not None else 0
    return len(prompt)


_FLAG_HELP = {
    "max_stop_strings": "Most stop strings (stop / stop_sequences) per request",
    "max_logit_bias_tokens": "Most logit_bias entries per request",
    "max_tools": "Most tools per request",
    "max_messages": "Most messages per chat or Anthropic request",
    "max_completion_prompts": "Most prompts per /v1/completions request",
}


def add_limit_args(group: argparse._ArgumentGroup) -> None:
    """One ``--max-...`` flag per ``RequestLimits`` field."""
    for field in dataclasses.fields(RequestLimits):
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=int,
            default=field.default,
            help=f"{_FLAG_HELP[field.name]}; larger requests get 400 (default: %(default)s).",
        )


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits)}
    )
