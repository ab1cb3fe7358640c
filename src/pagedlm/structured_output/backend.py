"""The grammar backend interface and the registry that imports backends lazily.

A backend turns a :class:`GrammarSpec` into a compiled grammar (expensive, done once per
spec and cached by :mod:`pagedlm.structured_output.compiler`), and a compiled grammar into
per-request :class:`GrammarMatcher` objects (cheap). Backend libraries (xgrammar,
outlines-core) are imported only when a backend is first built, so ``import pagedlm``
never loads them.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

BACKENDS: dict[str, str] = {
    "xgrammar": "pagedlm.structured_output.xgrammar_backend:XgrammarBackend",
    "outlines": "pagedlm.structured_output.outlines_backend:OutlinesBackend",
}
"""Backend name -> ``"module:Class"``, imported on first use."""


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint in canonical form; equal specs share one compiled grammar.

    ``kind`` is "json", "json_object", "regex", "choice", "grammar" or "structural_tag".
    ``spec`` is the schema as a JSON string, the regex, the EBNF text, the choices as a JSON
    list, or the structural tag's JSON (empty for json_object). ``compact`` asks JSON kinds
    for no free whitespace.
    """

    kind: str
    spec: str
    compact: bool = False


class GrammarMatcher(ABC):
    """The state of one request inside its grammar.

    Invariant: the matcher has accepted exactly the request's output tokens so far, so
    ``fill_bitmask`` describes the tokens allowed next. Preemption does not touch it: the
    recomputed tokens are the same tokens.
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``.

        ``bitmask``: ``[num_rows, ceil(vocab_size / 32)]`` int32; bit ``j`` of word ``w``
        allows token ``32 * w + j``.
        """

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (its stop token was accepted): the request must finish."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most 32): speculative decoding
        checks its drafts by accepting them, then rolls them back. A matcher that cannot
        serves constrained requests without drafts only."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back accepted tokens")


class StructuredOutputBackend(ABC):
    """Compiles grammars for one tokenizer and vocabulary size (the logits' width)."""

    name: str

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids

    @staticmethod
    @abstractmethod
    def validate(spec: GrammarSpec) -> None:
        """Raise ``params.InvalidStructuredOutputs`` (its reason without the field, which
        the caller names) if ``spec`` cannot be compiled; another ``ValueError`` is wrapped
        into one.

        Cheap and tokenizer-free: it runs in the input processor for every request.
        """

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar for ``spec`` (thread-safe; may take seconds)."""

    @abstractmethod
    def make_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


def backend_class(name: str) -> type[StructuredOutputBackend]:
    """Import and return the backend class registered as ``name``."""
    target = BACKENDS.get(name)
    if target is None:
        raise ValueError(
            f"Unknown structured_outputs_backend {name!r}; choose one of {sorted(BACKENDS)}."
        )
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        package = "outlines-core" if name == "outlines" else name
        raise ValueError(
            f"structured_outputs_backend={name!r} needs the {package} package "
            f"({exc}); install it with pip install 'pagedlm[structured]', or choose "
            "another backend."
        ) from exc
    return getattr(module, class_name)


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words per bitmask row."""
    return (vocab_size + 31) // 32
