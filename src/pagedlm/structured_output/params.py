"""From user-facing :class:`StructuredOutputsParams` to a canonical :class:`GrammarSpec`.

The spec is the cache key of compiled grammars, so two requests with the same schema
(dict or string) share one compilation. Property order is kept, not sorted: backends
emit object properties in schema order.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output.backend import GrammarSpec, backend_class

DEFAULT_MAX_SPEC_CHARS = 65536
"""About 650 JSON-schema properties: a few seconds of xgrammar compile on a slow CPU.
Compile time grows faster than the schema (2,000 properties: 11 s; 5,000: minutes)."""
DEFAULT_COMPILE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GrammarLimits:
    """What a server spends on one request's grammar (vLLM-style flags; 0 turns one off).

    ``max_spec_chars`` is checked in the front end (the request gets 400 before it enters
    the engine); ``compile_timeout_s`` in the engine core, which fails the request (also
    400) when its compile has run that long.
    """

    max_spec_chars: int = DEFAULT_MAX_SPEC_CHARS
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S

    @classmethod
    def of(cls, args: Any) -> GrammarLimits:
        """The limits an ``EngineArgs`` asks for."""
        return cls(
            args.structured_outputs_max_spec_chars, args.structured_outputs_compile_timeout_s
        )


class InvalidStructuredOutputs(ValueError):
    """A spec that cannot be served: too long, an invalid schema, regex or grammar, or a
    kind the backend cannot enforce. ``reason`` says what is wrong without naming a field;
    the message names ``structured_outputs.<kind>`` and ``for_field`` names another (the
    server's request field that carried the spec, such as ``response_format``'s)."""

    def __init__(self, kind: str, reason: str) -> None:
        self.kind = kind
        self.reason = reason
        super().__init__(self.for_field(f"structured_outputs.{kind}"))

    def for_field(self, field: str) -> str:
        return f"Invalid {field}: {self.reason}"


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The canonical spec of ``params`` (already checked to hold exactly one kind)."""
    kind = params.kind
    compact = params.disable_any_whitespace
    if kind == "json":
        schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
        return GrammarSpec("json", json.dumps(schema, ensure_ascii=False), compact)
    if kind == "json_object":
        return GrammarSpec("json_object", "", compact)
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(params.choice, ensure_ascii=False))
    if kind == "structural_tag":
        assert params.structural_tag is not None
        tag = json.loads(params.structural_tag)
        return GrammarSpec("structural_tag", json.dumps(tag, ensure_ascii=False))
    text = params.regex if kind == "regex" else params.grammar
    assert text is not None
    return GrammarSpec(kind, text)


def validate_structured_outputs(
    params: StructuredOutputsParams,
    backend: str,
    max_spec_chars: int = DEFAULT_MAX_SPEC_CHARS,
) -> GrammarSpec:
    """Check ``params`` against ``backend`` before the request enters the engine.

    Raises ``InvalidStructuredOutputs`` that names the problem (a spec longer than
    ``max_spec_chars`` (0: no limit), an invalid schema, regex or grammar, or a kind the
    backend cannot enforce); ``ValueError`` for a backend that is unknown or not installed.
    Returns the spec for convenience.
    """
    spec = grammar_spec(params)
    if max_spec_chars and len(spec.spec) > max_spec_chars:
        raise InvalidStructuredOutputs(
            spec.kind,
            f"it is {len(spec.spec)} characters long, more than the {max_spec_chars} this "
            "server compiles (--structured-outputs-max-spec-chars); send a smaller schema or "
            "grammar, or raise the limit.",
        )
    _validate_spec(spec, backend)
    return spec


@functools.lru_cache(maxsize=256)
def _validate_spec(spec: GrammarSpec, backend: str) -> None:
    """Cached: a large schema takes 0.2 s (xgrammar) to 2 s (outlines) to check, and
    clients tend to send the same schema again. Failures raise and are not cached."""
    backend_type = backend_class(backend)
    if spec.kind == "json":
        _check_json_schema(spec.spec)
    try:
        backend_type.validate(spec)
    except InvalidStructuredOutputs:
        raise
    except ValueError as exc:  # a third-party backend's own wording
        raise InvalidStructuredOutputs(spec.kind, str(exc)) from None


def _check_json_schema(schema_text: str) -> None:
    """Meta-validate with ``jsonschema`` when it is installed (catches e.g. a misspelt type)."""
    try:
        import jsonschema
    except ImportError:
        return  # the backend's own conversion still rejects what it cannot compile
    schema = json.loads(schema_text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InvalidStructuredOutputs(
            "json", f"not a valid JSON schema at {path}: {exc.message}"
        ) from None


def backend_error(exc: Exception) -> str:
    """A backend exception's message without the C++ file/line prefix xgrammar adds."""
    text = str(exc).strip()
    # xgrammar: "[03:39:19] /project/cpp/x.cc:94: message"
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text.splitlines()[0] if text else type(exc).__name__
