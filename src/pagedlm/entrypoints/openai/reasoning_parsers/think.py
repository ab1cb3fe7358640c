"""Reasoning between a start and an end marker (``<think>...</think>`` and kin), split from
the answer as text streams in.

Two conventions exist:

- ``starts_in_reasoning`` (``deepseek_r1``): the chat template already opened the thought,
  so the output starts inside the reasoning (a leading start marker is skipped if the model
  writes it anyway); everything up to the end marker is reasoning, and an output that never
  closes it is all reasoning (a thought cut off by max_tokens).
- otherwise (``qwen3``): reasoning only when the output opens with the start marker;
  otherwise it is all content (Qwen3 with thinking disabled).

The rendered prompt decides too (``prompt_opens_reasoning``): a prompt that ends with a
start marker, then nothing but whitespace, has opened the thought, so that request's output
starts inside it as with ``starts_in_reasoning``, and one cut off before the end marker is
all reasoning. Qwen3-*-Thinking-2507, Qwen3.5 and QwQ templates end their generation prompt
with ``<think>`` and a newline, and the model writes ``thought</think>answer``. A prompt
that closes an empty thought (Qwen3's ``enable_thinking=False`` renders ``<think>``, blank
lines, ``</think>``) keeps the family's rule.

A family may spell a marker several ways (``start_tags``/``end_tags``); the first end marker
of any spelling closes the thought. Whitespace between the end marker and the answer is
dropped. Parsers hold back text that may be the start of a marker, so any split of the same
text yields the same result.
"""

from __future__ import annotations

import enum

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


class ThinkReasoningParser(ReasoningParser):
    start_tags: tuple[str, ...] = (OPEN,)
    end_tags: tuple[str, ...] = (CLOSE,)
    starts_in_reasoning = True
    """Without a leading start marker: reasoning (True) or content (False), unless the
    prompt opened the thought (``prompt_opens_reasoning``: then always reasoning)."""

    def __init__(self, prompt_opens_reasoning: bool = False) -> None:
        self._buffer = ""
        self._pos = 0
        self._state = _State.START
        # where an output that does not open with a start marker starts
        self._in_reasoning = self.starts_in_reasoning or prompt_opens_reasoning

    @classmethod
    def prompt_opens_reasoning(cls, prompt_tail: str) -> bool:
        tail = prompt_tail.rstrip()
        return any(tail.endswith(tag) for tag in cls.start_tags)

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
