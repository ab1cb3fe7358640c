"""The reasoning-parser interface: model text in, reasoning and answer text out.

Like tool parsers, a reasoning parser is fed text delta by delta and then finished; any
split of the same text gives the same concatenated reasoning and content, and it never
raises on model output. Its content is what a tool parser (if any) reads next.

Where the output starts may depend on the request: a chat template can open the thought
itself (its generation prompt ends with ``<think>``), and the model then writes only its
end; or close it (thinking disabled renders an empty ``<think></think>``, a prefill may end
the thought), and the model writes only the answer. ``reasoning_parser_factory`` asks the
parser class once per request whether the rendered prompt did either
(``ReasoningParser.prompt_opens_reasoning`` / ``prompt_closes_reasoning``, on the text of
the prompt's current turn) and hands each answer to each choice's parser whose constructor
takes an argument of that name; a parser whose constructor takes neither (a plugin written
before) is built as before.
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
    start_tags: ClassVar[tuple[str, ...]] = ()
    """The spellings of the marker that opens a thought (``<think>``); none: the parser
    has no such marker."""
    end_tags: ClassVar[tuple[str, ...]] = ()
    """The spellings of the marker that ends a thought (``</think>``). The engine applies
    a request's grammar only after it (``structured_outputs_config.reasoning_parser``)
    where each spelling that is one token of the tokenizer is that token; none: the
    engine applies grammars from the first output token."""
    starts_in_reasoning: ClassVar[bool] = False
    """Where the output starts when the prompt's current turn has no marker: inside a
    thought (True: ``deepseek_r1``), or as the answer unless it opens with a start marker,
    leading whitespace skipped (False: ``qwen3``; the engine's grammars follow the same
    rule, ``structured_output/reasoning.py``)."""

    @classmethod
    def prompt_opens_reasoning(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending with ``prompt_tail`` (the text of its current turn,
        special tokens kept; "" when unknown) leaves the model inside a thought: the chat
        template (or a prefill) wrote the start marker and no end marker after it. The
        default: never."""
        return False

    @classmethod
    def prompt_closes_reasoning(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending with ``prompt_tail`` has closed the thought: its last
        marker is an end marker (a template with thinking disabled, a prefill that ended
        the thought), so the model writes the answer. The default: never."""
        return False

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of model text; return what became certain."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The text ended: release everything held back."""


def reasoning_parser_factory(
    parser_class: type[ReasoningParser], prompt_tail: str, closed: bool = False
) -> Callable[[], ReasoningParser]:
    """Makes ``parser_class`` parsers (one per choice) for a request whose rendered prompt
    ends with ``prompt_tail``: ``prompt_opens_reasoning`` and ``prompt_closes_reasoning``
    are decided once, here, and given to constructors that take them. ``closed``: the
    output is known to start after any thought (a grammar constrains it from its first
    token), whatever the prompt says."""
    decisions = {
        "prompt_opens_reasoning": not closed and parser_class.prompt_opens_reasoning(prompt_tail),
        "prompt_closes_reasoning": closed or parser_class.prompt_closes_reasoning(prompt_tail),
    }
    taken = inspect.signature(parser_class).parameters
    given = {name: value for name, value in decisions.items() if name in taken}
    return functools.partial(parser_class, **given) if given else parser_class


def reasoning_ended_by_prompt(parser_class: type[ReasoningParser], prompt_tail: str) -> bool | None:
    """Where the output of a prompt ending with ``prompt_tail`` starts, as the engine needs
    it for a grammar that applies after the thought: True, after it (the prompt closed
    the thought); False, inside one (the prompt opened it, or the family starts there:
    ``starts_in_reasoning``); None, the output decides (a thought only if it opens with a
    start marker). The same decisions ``reasoning_parser_factory`` gives its parsers."""
    if parser_class.prompt_closes_reasoning(prompt_tail):
        return True
    if parser_class.prompt_opens_reasoning(prompt_tail):
        return False
    return False if parser_class.starts_in_reasoning else None


def split_reasoning(parser: ReasoningParser, text: str) -> ReasoningDelta:
    """(reasoning, content) of a whole output."""
    first, last = parser.feed(text), parser.finish()
    return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)
