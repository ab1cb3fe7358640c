"""The reasoning-parser interface: model text in, reasoning and answer text out.

Like tool parsers, a reasoning parser is fed text delta by delta and then finished; any
split of the same text gives the same concatenated reasoning and content, and it never
raises on model output. Its content is what a tool parser (if any) reads next.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    """Stateful, one instance per output (per choice)."""

    needs_special_tokens: ClassVar[bool] = False
    """Its markers are special tokens of the model's tokenizer: a request it parses is
    detokenized with ``skip_special_tokens=False``, or it would never see them."""

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of model text; return what became certain."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The text ended: release everything held back."""


def split_reasoning(parser: ReasoningParser, text: str) -> ReasoningDelta:
    """(reasoning, content) of a whole output."""
    first, last = parser.feed(text), parser.finish()
    return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)
