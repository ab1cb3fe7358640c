"""``structured_outputs_backend`` and vLLM's ``structured_outputs_config`` -> the engine's
grammar backend and its whitespace rule.

vLLM's JSON keys: ``backend`` ("auto", "xgrammar", "outlines"; "auto", the default, is
xgrammar, or outlines where only outlines is installed: xgrammar compiles every kind
outlines does, and grammars and structural tags besides), ``disable_any_whitespace`` (every
JSON-constrained request gets compact JSON, as if it set the field itself),
``disable_fallback`` (pagedlm never moves a request to another backend, which is what True
asks), ``disable_additional_properties`` (vLLM reads it only in its guidance backend, so it
changes nothing here, as in vLLM with xgrammar), ``reasoning_parser``,
``reasoning_parser_plugin`` and ``enable_in_reasoning`` (grammars after the model's thought:
``reasoning_args.py``; the server's ``--reasoning-parser`` sets the parser). Every error
names the key and the fix.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from pagedlm.engine.reasoning_args import REASONING_KEYS, check_reasoning_keys
from pagedlm.structured_output.backend import BACKENDS

AUTO = "auto"
_FLAGS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")
_KEYS = ("backend", *_FLAGS, *REASONING_KEYS)


def resolve_structured_outputs(backend: str, config: dict[str, Any] | None) -> tuple[str, bool]:
    """(the backend's name, whether JSON is compact for every request)."""
    config = dict(config or {})
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"structured_outputs_config has unknown key(s) {unknown}; the keys are {list(_KEYS)}."
        )
    for name in _FLAGS:
        if not isinstance(config.get(name, False), bool):
            raise ValueError(
                f"structured_outputs_config.{name} must be true or false, got {config[name]!r}."
            )
    check_reasoning_keys(config)
    asked = config.get("backend", AUTO)
    if asked != AUTO and backend not in (AUTO, asked):
        raise ValueError(
            f"The grammar backend is given twice: structured_outputs_backend={backend!r} and "
            f"structured_outputs_config.backend={asked!r}; pass one."
        )
    name = backend if asked == AUTO else asked
    if name == AUTO:
        name = _installed_backend()
    if name not in BACKENDS:
        raise ValueError(
            f"Grammar backend {name!r} is unknown; use one of {[AUTO, *sorted(BACKENDS)]} "
            "(structured_outputs_backend, or structured_outputs_config's backend)."
        )
    return name, config.get("disable_any_whitespace", False)


def _installed_backend() -> str:
    """xgrammar, unless only outlines' core is installed."""
    if importlib.util.find_spec("xgrammar") is None and importlib.util.find_spec("outlines_core"):
        return "outlines"
    return "xgrammar"
