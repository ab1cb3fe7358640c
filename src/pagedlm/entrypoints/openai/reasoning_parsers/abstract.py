"""The reasoning-parser interface: model text in, reasoning and answer text out.

Like tool parsers, a reasoning parser is fed text delta by delta and then finished; any
split of the same text gives the same concatenated reasoning and content, and it never
raises on model output. Its content is what a tool parser (if any) reads next.

Where the output starts may depend on the request: a chat template can open the thought
itself (its generation prompt ends with ``<think>``), and the model then writes only its
end. ``reasoning_parser_factory`` asks the parser class once per request whether the
rendered prompt did so (``ReasoningParser.prompt_opens_reasoning``, on the prompt's last
tokens as text) and hands the answer to each choice's parser whose constructor takes
``prompt_opens_reasoning``; a parser whose constructor does not (a plugin written before)
is built as before.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
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

    @classmethod
    def prompt_opens_reasoning(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending with ``prompt_tail`` (its last tokens as text, special
        tokens kept; "" when unknown) leaves the model inside a thought: the chat template
        wrote the start marker. The default: never."""
        return False

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of model text; return what became certain."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The text ended: release everything held back."""


def reasoning_parser_factory(
    parser_class: type[ReasoningParser], prompt_tail: str
) -> Callable[[], ReasoningParser]:
    """Makes ``parser_class`` parsers (one per choice) for a request whose rendered prompt
    ends with ``prompt_tail``: ``prompt_opens_reasoning`` is decided once, here, and given
    to constructors that take it."""
    if "prompt_opens_reasoning" in inspect.signature(parser_class).parameters:
        opens = parser_class.prompt_opens_reasoning(prompt_tail)
        return functools.partial(parser_class, prompt_opens_reasoning=opens)
    return parser_class


def split_reasoning(parser: ReasoningParser, text: str) -> ReasoningDelta:
    """(reasoning, content) of a whole output."""
    first, last = parser.feed(text), parser.finish()
    return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)
