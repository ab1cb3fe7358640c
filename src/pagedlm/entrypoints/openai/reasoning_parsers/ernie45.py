"""Baidu ERNIE-4.5 thinking models: ``thought</think>`` then the answer, optionally wrapped
as ``<response>answer</response>``.

The chat template opens the thought, so the output starts inside it (``deepseek_r1``'s
convention, the prompt's own markers deciding first). The ``<response>`` wrapper is removed from the content, with the whitespace
just inside it and anything blank after ``</response>``; content that does not open with
``<response>`` is passed through as it is.
"""

from __future__ import annotations

import enum

from pagedlm.entrypoints.openai.reasoning_parsers.abstract import ReasoningDelta, ReasoningParser
from pagedlm.entrypoints.openai.reasoning_parsers.think import DeepSeekR1ReasoningParser
from pagedlm.entrypoints.openai.tool_parsers.abstract import held_tag_prefix

RESPONSE_OPEN = "<response>"
RESPONSE_CLOSE = "</response>"


class _State(enum.Enum):
    HEAD = 0
    """Nothing decided yet: the content may be opening ``<response>``."""
    RESPONSE_START = 1
    RESPONSE = 2
    AFTER_RESPONSE = 3
    PLAIN = 4


class _ResponseUnwrapper:
    """Content text in, the same text without its ``<response>`` wrapper out."""

    def __init__(self) -> None:
        self._buffer = ""
        self._pos = 0
        self._state = _State.HEAD

    def advance(self, text: str, final: bool) -> str:
        self._buffer += text
        out: list[str] = []
        if self._state is _State.HEAD:
            if self._buffer.startswith(RESPONSE_OPEN):
                self._pos = len(RESPONSE_OPEN)
                self._state = _State.RESPONSE_START
            elif not final and RESPONSE_OPEN.startswith(self._buffer):
                return ""
            else:
                self._state = _State.PLAIN
        if self._state is _State.RESPONSE_START:
            rest = self._buffer[self._pos :]
            self._pos += len(rest) - len(rest.lstrip())
            if self._pos < len(self._buffer) or final:
                self._state = _State.RESPONSE
        if self._state is _State.RESPONSE:
            rest = self._buffer[self._pos :]
            close = rest.find(RESPONSE_CLOSE)
            if close != -1:
                out.append(rest[:close].rstrip())
                self._pos += close + len(RESPONSE_CLOSE)
                self._state = _State.AFTER_RESPONSE
            else:
                # A close tag may be arriving; whitespace may turn out to precede it.
                cut = (
                    len(rest)
                    if final
                    else len(rest[: len(rest) - held_tag_prefix(rest, RESPONSE_CLOSE)].rstrip())
                )
                out.append(rest[:cut])
                self._pos += cut
        if self._state is _State.AFTER_RESPONSE:
            rest = self._buffer[self._pos :]
            if rest.strip():
                self._state = _State.PLAIN
            elif final:
                self._pos = len(self._buffer)
        if self._state is _State.PLAIN:
            out.append(self._buffer[self._pos :])
            self._pos = len(self._buffer)
        return "".join(out)


class Ernie45ReasoningParser(ReasoningParser):
    start_tags = DeepSeekR1ReasoningParser.start_tags
    end_tags = DeepSeekR1ReasoningParser.end_tags
    starts_in_reasoning = DeepSeekR1ReasoningParser.starts_in_reasoning

    def __init__(
        self, prompt_opens_reasoning: bool = False, prompt_closes_reasoning: bool = False
    ) -> None:
        self._think = DeepSeekR1ReasoningParser(prompt_opens_reasoning, prompt_closes_reasoning)
        self._response = _ResponseUnwrapper()

    @classmethod
    def prompt_opens_reasoning(cls, prompt_tail: str) -> bool:
        return DeepSeekR1ReasoningParser.prompt_opens_reasoning(prompt_tail)

    @classmethod
    def prompt_closes_reasoning(cls, prompt_tail: str) -> bool:
        return DeepSeekR1ReasoningParser.prompt_closes_reasoning(prompt_tail)

    def feed(self, text: str) -> ReasoningDelta:
        piece = self._think.feed(text)
        return ReasoningDelta(piece.reasoning, self._response.advance(piece.content, False))

    def finish(self) -> ReasoningDelta:
        piece = self._think.finish()
        return ReasoningDelta(piece.reasoning, self._response.advance(piece.content, True))
