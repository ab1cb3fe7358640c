"""gpt-oss's harmony output (``--tool-call-parser openai``, vLLM's name), and the message
scanner the ``openai_gptoss`` reasoning parser shares.

gpt-oss writes a sequence of messages, each a header and a body::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

The generation prompt ends with ``<|start|>assistant``, so the first message's header starts
at the output's start: at ``<|channel|>``, or at a recipient written before the channel
(`` to=functions.x<|channel|>commentary``; later messages:
``<|start|>assistant to=functions.x<|channel|>commentary``). ``<|call|>`` and ``<|return|>``
are gpt-oss's stop tokens, so the server usually strips the last message's terminator: the
text simply ends.

What this parser makes of each message:

- addressed ``to=functions.NAME`` (any channel, normally ``commentary``): a call of ``NAME``.
  Its body is the arguments: valid JSON is re-serialized; a body that is not JSON is kept
  as the model wrote it (stripped) when the message was terminated (``<|call|>``, ``<|end|>``
  or a next message), as vLLM does; an empty body is ``{}``. A call whose text ends before
  its terminator (the stop token was stripped, or max_tokens cut it) is a call when its body
  is valid JSON, and otherwise its body becomes content (an unfinished call). A call is
  emitted whole once its message ends, so any split of the text gives the same calls.
- addressed to anything else (gpt-oss's built-in ``browser.*``/``python`` tools): dropped.
- ``analysis`` (no recipient): the reasoning; dropped here, as vLLM's ``openai`` parser does
  (the ``openai_gptoss`` reasoning parser returns it as ``reasoning_content``).
- ``final``, ``commentary`` without a recipient (a preamble), any other channel: content.
- text outside any message (an output with no harmony framing at all, or what the reasoning
  parser already turned into content): content.

No framing token ever reaches the content. The markers are special tokens of gpt-oss's
tokenizer, so the server detokenizes with ``skip_special_tokens=False`` for this parser.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    arguments_json,
    held_tag_prefix,
)

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_TERMINATORS = (END, RETURN, CALL)
_HEADER_MARKERS = (START, MESSAGE, *_TERMINATORS)
FUNCTIONS = "functions."

_CONSTRAIN_TYPE = re.compile(re.escape(CONSTRAIN) + r"[^\s<]*")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
_ROLE_RECIPIENT = re.compile(r"\s*to=[^\s<]+\s*")
"""The first message's role section after the prompt's ``<|start|>assistant``: a recipient."""
_ROLE_RECIPIENT_START = re.compile(r"\s*(?:t|to|to=[^\s<]*|to=[^\s<]+\s+)?")
"""Text that may still become ``_ROLE_RECIPIENT``."""


@dataclass(frozen=True)
class Header:
    """A message's channel and recipient ("" when absent)."""

    channel: str
    recipient: str


@dataclass(frozen=True)
class Text:
    """Text outside any message."""

    text: str


@dataclass(frozen=True)
class Open:
    """A message's header ended (``<|message|>``): its body follows."""

    header: Header


@dataclass(frozen=True)
class Body:
    """A piece of the open message's body."""

    text: str


@dataclass(frozen=True)
class Close:
    """The open message ended: ``terminated`` when the model ended it (a terminator or a next
    message), False when the text ran out inside it."""

    terminated: bool


Event = Text | Open | Body | Close


class _Where(enum.Enum):
    LEAD = 0
    """The output's first text: a recipient of the first message, or text outside any."""
    OUTSIDE = 1
    HEADER = 2
    BODY = 3


def parse_header(text: str) -> Header:
    """The channel and recipient of a header's text (between ``<|start|>``, or the leading
    ``<|channel|>``, and ``<|message|>``)."""
    text = _CONSTRAIN_TYPE.sub(" ", text)
    channel = _CHANNEL_NAME.search(text)
    recipient = _RECIPIENT.search(text)
    return Header(channel.group(1) if channel else "", recipient.group(1) if recipient else "")


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    found = [(index, marker) for marker in markers if (index := text.find(marker)) != -1]
    return min(found, default=(-1, ""))


class HarmonyScanner:
    """Harmony text in, message events out, as it streams.

    Text that may be the start of a marker is held back, so any split of the same text gives
    the same events (bodies and outside text possibly in other pieces). Framing tokens never
    appear in ``Text`` or ``Body``; stray ones (a ``<|message|>`` outside a header, say) are
    dropped, and a header that never reaches ``<|message|>`` is dropped with it.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._pos = 0
        self._where = _Where.LEAD
        self._header_start = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._where is _Where.LEAD and not self._lead(final):
                break
            rest = self._buffer[self._pos :]
            if self._where is _Where.HEADER:
                index, marker = _earliest(rest, _HEADER_MARKERS)
                if index == -1:
                    if final:  # a header cut off: nothing of it to show
                        self._pos = len(self._buffer)
                        self._where = _Where.OUTSIDE
                    break
                self._pos += index + len(marker)
                if marker == START:
                    self._header_start = self._pos
                elif marker == MESSAGE:
                    header = self._buffer[self._header_start : self._pos - len(MESSAGE)]
                    events.append(Open(parse_header(header)))
                    self._where = _Where.BODY
                else:
                    self._where = _Where.OUTSIDE
                continue
            in_body = self._where is _Where.BODY
            index, marker = _earliest(rest, MARKERS)
            if index == -1:
                held = 0 if final else max(held_tag_prefix(rest, m) for m in MARKERS)
                if len(rest) > held:
                    piece = rest[: len(rest) - held]
                    events.append(Body(piece) if in_body else Text(piece))
                    self._pos += len(piece)
                if final and in_body:
                    events.append(Close(terminated=False))
                    self._where = _Where.OUTSIDE
                break
            if index:
                events.append(Body(rest[:index]) if in_body else Text(rest[:index]))
            self._pos += index + len(marker)
            if marker in (START, CHANNEL) or marker in _TERMINATORS:
                if in_body:
                    events.append(Close(terminated=True))
                self._where = _Where.OUTSIDE
            if marker in (START, CHANNEL):
                self._where = _Where.HEADER
                self._header_start = self._pos - (len(CHANNEL) if marker == CHANNEL else 0)
        return events

    def _lead(self, final: bool) -> bool:
        """Decide whether the output opens inside the first message's header (its role
        section names the recipient: `` to=functions.x<|channel|>...``); False: not yet."""
        index, marker = _earliest(self._buffer, MARKERS)
        if index != -1:
            header_follows = marker in (CHANNEL, CONSTRAIN, MESSAGE)
            if header_follows and _ROLE_RECIPIENT.fullmatch(self._buffer[:index]):
                self._where = _Where.HEADER
                return True
        elif not final:
            held = max(held_tag_prefix(self._buffer, m) for m in MARKERS)
            if _ROLE_RECIPIENT_START.fullmatch(self._buffer[: len(self._buffer) - held]):
                return False
        self._where = _Where.OUTSIDE
        return True


def call_arguments(body: str) -> str | None:
    """A call body's arguments: valid JSON re-serialized, ``{}`` for an empty body, else
    None."""
    text = body.strip()
    if not text:
        return "{}"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    try:
        return arguments_json(value)
    except (ValueError, RecursionError):
        return None


class _Route(enum.Enum):
    CONTENT = 0
    CALL = 1
    DROP = 2


class OpenAIToolParser(ToolParser):
    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._scanner = HarmonyScanner()
        self._route = _Route.CONTENT
        self._name = ""
        self._body: list[str] = []

    def feed(self, text: str) -> ParsedDelta:
        return self._take(self._scanner.feed(text))

    def finish(self) -> ParsedDelta:
        return self._take(self._scanner.finish())

    def _take(self, events: list[Event]) -> ParsedDelta:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for event in events:
            if isinstance(event, Text):
                content.append(event.text)
            elif isinstance(event, Open):
                self._route = self._route_of(event.header)
            elif isinstance(event, Body):
                if self._route is _Route.CONTENT:
                    content.append(event.text)
                elif self._route is _Route.CALL:
                    self._body.append(event.text)
            else:
                if self._route is _Route.CALL:
                    body = "".join(self._body)
                    arguments = call_arguments(body)
                    if arguments is None and event.terminated:
                        arguments = body.strip()
                    if arguments is None:  # an unfinished call: its text is all there is
                        content.append(body)
                    else:
                        calls.append(self._new_call(self._name, arguments))
                self._route = _Route.CONTENT
                self._body = []
        return ParsedDelta("".join(content), tuple(calls))

    def _route_of(self, header: Header) -> _Route:
        if header.recipient:
            name = header.recipient[len(FUNCTIONS) :]
            if header.recipient.startswith(FUNCTIONS) and name:
                self._name = name
                return _Route.CALL
            return _Route.DROP
        return _Route.DROP if header.channel == "analysis" else _Route.CONTENT
