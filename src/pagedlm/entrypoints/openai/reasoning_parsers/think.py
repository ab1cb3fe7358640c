"""Reasoning between a start and an end marker (``<think>...</think>`` and kin), split from
the answer as text streams in.

Two conventions exist:

- ``starts_in_reasoning`` (``deepseek_r1``): the chat template already opened the thought,
  so the output starts inside the reasoning (a leading start marker is skipped if the model
  writes it anyway); everything up to the end marker is reasoning, and an output that never
  closes it is all reasoning (a thought cut off by max_tokens).
- otherwise (``qwen3``): reasoning only when the output opens with the start marker
  (after any whitespace, as vLLM's parsers); otherwise it is all content (Qwen3 with
  thinking disabled).

The rendered prompt decides first: the last marker of its current turn (the text after its
last special token that is no marker) says where the output starts. A start marker
(``prompt_opens_reasoning``): inside the thought, as with ``starts_in_reasoning``, and an
output cut off before the end marker is all reasoning. Qwen3-*-Thinking-2507, Qwen3.5 and
QwQ templates end their generation prompt with ``<think>`` and a newline, and the model
writes ``thought</think>answer``; a prefill that opens a thought and goes on inside it is
the same. An end marker (``prompt_closes_reasoning``): after the thought, so the output is
content unless it opens a thought itself, for ``deepseek_r1`` too. Qwen3's
``enable_thinking=False`` renders ``<think>``, blank lines, ``</think>``; a prefill may end
the thought before the answer. A turn without a marker keeps the family's rule.

A family may spell a marker several ways (``start_tags``/``end_tags``); the first end marker
of any spelling closes the thought. Whitespace between the end marker and the answer is
dropped. Parsers hold back text that may be the start of a marker, so any split of the same
text yields the same result.
"""

from __future__ import annotations

import enum
from typing import ClassVar

from pagedlm.entrypoints.openai.reasoning_parsers.abstract import ReasoningDelta, ReasoningParser
from pagedlm.entrypoints.openai.tool_parsers.abstract import held_tag_prefix

OPEN = "<think>"
CLOSE = "</think>"


class _State(enum.Enum):
    START = 0
    REASONING = 1
    ANSWER_START = 2
    ANSWER = 3


def _earliest(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """(index, tag) of the first complete occurrence of any of ``tags`` in ``text``, or
    (-1, "")."""
    found = [(index, tag) for tag in tags if (index := text.find(tag)) != -1]
    return min(found, default=(-1, ""))


def _last_marker(text: str, start_tags: tuple[str, ...], end_tags: tuple[str, ...]) -> str:
    """Which kind of marker occurs last in ``text``: "start", "end", or "" (none)."""
    last_start = max((text.rfind(tag) for tag in start_tags), default=-1)
    last_end = max((text.rfind(tag) for tag in end_tags), default=-1)
    if last_start == last_end == -1:
        return ""
    return "start" if last_start > last_end else "end"


class ThinkReasoningParser(ReasoningParser):
    start_tags: ClassVar[tuple[str, ...]] = (OPEN,)
    end_tags: ClassVar[tuple[str, ...]] = (CLOSE,)
    starts_in_reasoning = True
    """Without a leading start marker: reasoning (True) or content (False), unless the
    prompt decided (``prompt_opens_reasoning``: reasoning; ``prompt_closes_reasoning``:
    content)."""

    def __init__(
        self, prompt_opens_reasoning: bool = False, prompt_closes_reasoning: bool = False
    ) -> None:
        self._buffer = ""
        self._pos = 0
        self._state = _State.START
        # where an output that does not open with a start marker starts
        self._in_reasoning = prompt_opens_reasoning or (
            self.starts_in_reasoning and not prompt_closes_reasoning
        )

    @classmethod
    def prompt_opens_reasoning(cls, prompt_tail: str) -> bool:
        return _last_marker(prompt_tail, cls.start_tags, cls.end_tags) == "start"

    @classmethod
    def prompt_closes_reasoning(cls, prompt_tail: str) -> bool:
        return _last_marker(prompt_tail, cls.start_tags, cls.end_tags) == "end"

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        reasoning, content = "", ""
        if self._state is _State.START:
            head = self._buffer.lstrip()
            opener = next((tag for tag in self.start_tags if head.startswith(tag)), None)
            if opener is not None:
                self._pos = len(self._buffer) - len(head) + len(opener)
                self._state = _State.REASONING
            elif not final and any(tag.startswith(head) for tag in self.start_tags):
                return ReasoningDelta()
            else:
                self._state = _State.REASONING if self._in_reasoning else _State.ANSWER
        if self._state is _State.REASONING:
            rest = self._buffer[self._pos :]
            close, tag = _earliest(rest, self.end_tags)
            if close == -1:
                held = max(held_tag_prefix(rest, tag) for tag in self.end_tags)
                cut = len(rest) if final else len(rest) - held
                reasoning = rest[:cut]
                self._pos += cut
            else:
                reasoning = rest[:close]
                self._pos += close + len(tag)
                self._state = _State.ANSWER_START
        if self._state is _State.ANSWER_START:
            rest = self._buffer[self._pos :]
            stripped = rest.lstrip()
            self._pos += len(rest) - len(stripped)
            if stripped:
                self._state = _State.ANSWER
        if self._state is _State.ANSWER:
            content = self._buffer[self._pos :]
            self._pos = len(self._buffer)
        return ReasoningDelta(reasoning, content)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    starts_in_reasoning = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3 (its template leaves ``<think>`` to the model, or renders an empty closed
    thought with ``enable_thinking=False``) and Qwen3-*-Thinking-2507, Qwen3.5 and QwQ
    (their templates open the thought: ``prompt_opens_reasoning``)."""

    starts_in_reasoning = False
