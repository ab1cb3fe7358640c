"""The xgrammar backend (the default): JSON schema, any JSON, regex, choice, EBNF and
structural tags."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from pagedlm.structured_output.backend import GrammarMatcher, GrammarSpec, StructuredOutputBackend
from pagedlm.structured_output.params import InvalidStructuredOutputs, backend_error


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes are also valid EBNF string-literal escapes in xgrammar.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _grammar(spec: GrammarSpec) -> xgr.Grammar:
    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=not spec.compact)
    if spec.kind == "json_object":
        # An object, as the outlines backend and vLLM give (xgrammar's builtin JSON
        # grammar takes any value, an array or a bare number too, with free whitespace).
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not spec.compact)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.spec)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(json.loads(spec.spec)))
    if spec.kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.spec)
    if spec.kind == "structural_tag":
        return _structural_tag(json.loads(spec.spec))
    raise ValueError(f"Unknown structured output kind {spec.kind!r}.")


def _structural_tag(tag: dict[str, Any]) -> xgr.Grammar:
    """vLLM's form (``structures`` of begin/schema/end, ``triggers``) or xgrammar's own."""
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(json.dumps(tag))
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise ValueError("a structural tag needs a list of structures and a list of triggers.")
    items = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or not {"begin", "end"} <= set(item):
            raise ValueError(f"structures[{i}] needs begin, schema and end.")
        schema = item.get("schema", {})
        items.append(
            xgr.StructuralTagItem(begin=item["begin"], schema=json.dumps(schema), end=item["end"])
        )
    return xgr.Grammar.from_structural_tag(items, triggers)


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        from pagedlm.tokenizer import as_transformers

        info = xgr.TokenizerInfo.from_huggingface(
            as_transformers(tokenizer), vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # Our own compiler caches by spec; xgrammar's cache would hold a second copy.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @staticmethod
    def validate(spec: GrammarSpec) -> None:
        try:
            _grammar(spec)
        except (RuntimeError, ValueError) as exc:
            raise InvalidStructuredOutputs(spec.kind, backend_error(exc)) from None

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(_grammar(spec))

    def make_matcher(self, compiled: xgr.CompiledGrammar) -> GrammarMatcher:
        return XgrammarMatcher(xgr.GrammarMatcher(compiled))
