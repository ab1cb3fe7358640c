"""``<think>...</think>`` reasoning, split from the answer as text streams in.

Two conventions exist:

- ``deepseek_r1``: the chat template already opened ``<think>``, so the output starts
  inside the reasoning (a leading ``<think>`` is skipped if the model writes it anyway);
  everything up to ``</think>`` is reasoning, and an output that never closes it is all
  reasoning (a thought cut off by max_tokens).
- ``qwen3``: reasoning only when the output opens with ``<think>``; otherwise it is all
  content (Qwen3 with thinking disabled).

Whitespace between ``</think>`` and the answer is dropped. Parsers hold back text that
may be the start of a tag, so any split of the same text yields the same result.
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


class ThinkReasoningParser(ReasoningParser):
    starts_in_reasoning = True
    """Without a leading ``<think>``: reasoning (True) or content (False)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._pos = 0
        self._state = _State.START

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        reasoning, content = "", ""
        if self._state is _State.START:
            head = self._buffer.lstrip()
            if head.startswith(OPEN):
                self._pos = len(self._buffer) - len(head) + len(OPEN)
                self._state = _State.REASONING
            elif not final and OPEN.startswith(head):
                return ReasoningDelta()
            else:
                self._state = _State.REASONING if self.starts_in_reasoning else _State.ANSWER
        if self._state is _State.REASONING:
            rest = self._buffer[self._pos :]
            close = rest.find(CLOSE)
            if close == -1:
                cut = len(rest) if final else len(rest) - held_tag_prefix(rest, CLOSE)
                reasoning = rest[:cut]
                self._pos += cut
            else:
                reasoning = rest[:close]
                self._pos += close + len(CLOSE)
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
    starts_in_reasoning = False
