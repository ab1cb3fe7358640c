"""gpt-oss's reasoning in its harmony output (``--reasoning-parser openai_gptoss``, vLLM's
name): the bodies of ``analysis`` messages are the reasoning.

- ``analysis`` (no recipient): reasoning, the body only.
- ``final``, ``commentary`` without a recipient (a preamble), any other channel, and text
  outside any message: content, the body only.
- a message with a recipient (``to=functions.NAME``: a tool call, any channel) is passed on
  in the content in harmony form, ``<|start|>assistant<|channel|>CHANNEL to=RECIPIENT
  <|message|>BODY<|call|>`` (``<|call|>`` once the model ended the message), for the tool
  parser that reads the content next (``openai``), which turns it into a call or drops it.
  Without a tool parser, such a message would stay in the content as that text.

No framing token reaches the reasoning, nor the content outside those passed-on calls. The
markers are special tokens of gpt-oss's tokenizer, so the server detokenizes with
``skip_special_tokens=False`` for this parser. See ``tool_parsers/openai_harmony.py`` for
the format and the shared scanner (any split of the text gives the same result).
"""

from __future__ import annotations

import enum

from pagedlm.entrypoints.openai.reasoning_parsers.abstract import ReasoningDelta, ReasoningParser
from pagedlm.entrypoints.openai.tool_parsers.openai_harmony import (
    CALL,
    CHANNEL,
    MESSAGE,
    START,
    Body,
    Event,
    HarmonyScanner,
    Header,
    Open,
    Text,
)


class _Route(enum.Enum):
    CONTENT = 0
    REASONING = 1
    PASS_ON = 2


def call_frame(header: Header) -> str:
    """The harmony header the tool parser reads a passed-on message by."""
    channel = f"{CHANNEL}{header.channel}" if header.channel else ""
    return f"{START}assistant{channel} to={header.recipient}{MESSAGE}"


class OpenAIGptOssReasoningParser(ReasoningParser):
    needs_special_tokens = True

    def __init__(self) -> None:
        self._scanner = HarmonyScanner()
        self._route = _Route.CONTENT

    def feed(self, text: str) -> ReasoningDelta:
        return self._take(self._scanner.feed(text))

    def finish(self) -> ReasoningDelta:
        return self._take(self._scanner.finish())

    def _take(self, events: list[Event]) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        for event in events:
            if isinstance(event, Text):
                content.append(event.text)
            elif isinstance(event, Open):
                header = event.header
                if header.recipient:
                    self._route = _Route.PASS_ON
                    content.append(call_frame(header))
                elif header.channel == "analysis":
                    self._route = _Route.REASONING
                else:
                    self._route = _Route.CONTENT
            elif isinstance(event, Body):
                (reasoning if self._route is _Route.REASONING else content).append(event.text)
            else:
                if self._route is _Route.PASS_ON and event.terminated:
                    content.append(CALL)
                self._route = _Route.CONTENT
        return ReasoningDelta("".join(reasoning), "".join(content))
