"""The outlines backend (outlines-core): JSON schema, any JSON, regex and choice.

outlines compiles a regular expression into an index over the vocabulary, so it cannot
run EBNF grammars, "any JSON object" is a large regex (seconds to index, then cached), and its schema-to-regex conversion ignores numeric bounds. Rather
than silently emit out-of-range numbers, integer ranges of at most
``MAX_INTEGER_ENUM`` values become enums, and other bounds are rejected with a pointer
to xgrammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import outlines_core
from outlines_core.json_schema import build_regex_from_schema

from pagedlm.structured_output.backend import GrammarMatcher, GrammarSpec, StructuredOutputBackend
from pagedlm.structured_output.params import InvalidStructuredOutputs, backend_error
from pagedlm.structured_output.token_bytes import token_bytes

MAX_INTEGER_ENUM = 1000
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_REGEX_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~])")
_COMPACT_WHITESPACE = ""
_ANY_WHITESPACE = None
"""outlines' default between JSON tokens (an optional space): bounded, so a small model
cannot loop on whitespace, and cheap to index (a newline in it doubles the index time)."""


def _rewrite_bounds(node: Any) -> Any:
    """Replace small integer ranges by enums; reject bounds outlines would ignore."""
    if isinstance(node, list):
        return [_rewrite_bounds(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _rewrite_bounds(value) for key, value in node.items()}
    bounds = [key for key in _BOUND_KEYS if key in node]
    if not bounds:
        return node
    low, high = node.get("minimum"), node.get("maximum")
    if (
        node.get("type") == "integer"
        and bounds in (["minimum", "maximum"],)
        and isinstance(low, int)
        and isinstance(high, int)
        and 0 <= high - low < MAX_INTEGER_ENUM
    ):
        rest = {k: v for k, v in node.items() if k not in ("type", "minimum", "maximum")}
        return {**rest, "enum": list(range(low, high + 1))}
    raise ValueError(
        f"The outlines backend cannot enforce {', '.join(bounds)} here (only integer "
        f"ranges with minimum and maximum, at most {MAX_INTEGER_ENUM} values); use "
        "structured_outputs_backend='xgrammar'."
    )


def _escape(literal: str) -> str:
    return _REGEX_META.sub(r"\\\1", literal)


def _regex(spec: GrammarSpec) -> str:
    whitespace = _COMPACT_WHITESPACE if spec.compact else _ANY_WHITESPACE
    if spec.kind == "json":
        schema = _rewrite_bounds(json.loads(spec.spec))
        return build_regex_from_schema(json.dumps(schema), whitespace)
    if spec.kind == "json_object":
        return build_regex_from_schema('{"type": "object"}', whitespace)
    if spec.kind == "regex":
        return spec.spec
    if spec.kind == "choice":
        return "(" + "|".join(_escape(c) for c in json.loads(spec.spec)) + ")"
    if spec.kind == "grammar":
        raise ValueError(
            "The outlines backend cannot run EBNF grammars; use "
            "structured_outputs_backend='xgrammar' or express the grammar as a regex."
        )
    if spec.kind == "structural_tag":
        raise ValueError(
            "The outlines backend cannot run structural tags; use "
            "structured_outputs_backend='xgrammar'."
        )
    raise ValueError(f"Unknown structured output kind {spec.kind!r}.")


def _index(regex: str, vocabulary: Any) -> Any:
    """outlines-core's index of ``regex`` over ``vocabulary``, anchored at the end.

    outlines-core (0.2.14) drops every token that leads from a point where the regex may
    end to one where it may not (its DFA reports a match one byte late, and such a
    state looks like a match already left behind): "(ab)+" never went past "ab",
    "[0-9]+(\\.[0-9]+)?" never took a decimal point, a choice never went past another
    it begins with. Anchored at the end ("$"), the regex matches nowhere but the end and
    no such point exists. outlines-core refuses to anchor a regex that matches the empty
    string; that one is indexed as given, and keeps the flaw.
    """
    try:
        return outlines_core.Index(f"(?:{regex})$", vocabulary)
    except ValueError:
        return outlines_core.Index(regex, vocabulary)


_PROBE_VOCABULARY: Any = None


def _probe_vocabulary() -> Any:
    """Every byte as a single-byte token, the way a byte-level tokenizer can spell any
    text: enough to compile (and so check) a regex. (Printable ASCII alone refused valid
    regexes, choices and schemas with a tab or any non-ASCII character.)"""
    global _PROBE_VOCABULARY
    if _PROBE_VOCABULARY is None:
        tokens = {bytes([b]): [b] for b in range(256)}
        _PROBE_VOCABULARY = outlines_core.Vocabulary(256, tokens)
    return _PROBE_VOCABULARY


_MAX_ROLLBACK = 32
"""Tokens a matcher can take back (speculative decoding verifies at most 31 drafts)."""


class OutlinesMatcher(GrammarMatcher):
    def __init__(self, index: Any, eos_token_id: int) -> None:
        self._guide = outlines_core.Guide(index, max_rollback=_MAX_ROLLBACK)
        self._eos_token_id = eos_token_id
        self._finished = False
        self._advanced: list[bool] = []
        """Per accepted token (the last ``_MAX_ROLLBACK``): whether it moved the guide (EOS
        does not), so ``rollback`` knows how far to take the guide back."""

    def accept_token(self, token_id: int) -> bool:
        if self._finished:
            return False
        if token_id == self._eos_token_id:
            # The guide has no transition on EOS: it is allowed exactly in accepting states
            # (Guide.is_finished), and accepting it is what ends the grammar.
            self._finished = self._guide.is_finished()
            if self._finished:
                self._remember(False)
            return self._finished
        if not self._guide.accepts_tokens([token_id]):
            return False
        self._guide.advance(token_id, return_tokens=False)
        self._remember(True)
        return True

    def _remember(self, advanced: bool) -> None:
        self._advanced.append(advanced)
        if len(self._advanced) > _MAX_ROLLBACK:
            del self._advanced[0]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._advanced):
            raise ValueError(f"cannot roll back {num_tokens} tokens (at most {_MAX_ROLLBACK})")
        undone = self._advanced[len(self._advanced) - num_tokens :]
        del self._advanced[len(self._advanced) - num_tokens :]
        if undone and not undone[-1]:
            self._finished = False  # the EOS that ended the grammar is undone
        steps = sum(undone)
        if steps:
            self._guide.rollback_state(steps)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        target = bitmask[row]
        self._guide.write_mask_into(target.ctypes.data, target.size, target.itemsize)

    def is_terminated(self) -> bool:
        return self._finished


class OutlinesBackend(StructuredOutputBackend):
    name = "outlines"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in token_bytes(tokenizer, vocab_size).items():
            if token_id not in stop_token_ids and data:
                by_bytes.setdefault(data, []).append(token_id)
        # outlines-core knows one end-of-sequence token; the first stop token plays it.
        self._vocabulary = outlines_core.Vocabulary(stop_token_ids[0], by_bytes)

    @staticmethod
    def validate(spec: GrammarSpec) -> None:
        try:
            _index(_regex(spec), _probe_vocabulary())
        except ValueError as exc:
            message = backend_error(exc)
            if "outlines backend" not in message:
                message = f"the outlines backend cannot compile it: {message}"
            raise InvalidStructuredOutputs(spec.kind, message) from None

    def compile(self, spec: GrammarSpec) -> Any:
        return _index(_regex(spec), self._vocabulary)

    def make_matcher(self, compiled: Any) -> GrammarMatcher:
        return OutlinesMatcher(compiled, self.stop_token_ids[0])
