"""Property-based fuzzing of the tool-call and reasoning parsers, as the server streams them.

Hypothesis writes model outputs in each parser's format (calls with random names and JSON
arguments: unicode, escapes, nested objects, empty ones, several calls, content around them,
unclosed blocks), knowing what they must parse to, and cuts them at random places (inside
tags, escapes and characters' JSON spellings included). Checked for every parser:

- the whole text parses to what the generator wrote;
- any split gives the same content and calls, call indexes counting up from 0, a name on
  (only) the first piece of each call;
- truncated, spliced and garbled outputs never raise, and any split still agrees;
- through ``ChatOutputParser`` (reasoning parser, then tool parser), the streamed deltas
  joined are the non-streaming message.

Then one deterministic case per bug the fuzzing found. Examples are few and derandomized, so
the module takes seconds; raise ``FUZZ_EXAMPLES`` to hunt.
"""

from __future__ import annotations

import json
import keyword
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlm.entrypoints.openai.chat_output import ChatOutputParser
from pagedlm.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    OpenAIGptOssReasoningParser,
    ReasoningParser,
    reasoning_parser_factory,
    split_reasoning,
)
from pagedlm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    OpenAIToolParser,
    ParsedDelta,
    ParsedOutput,
    RequiredToolCallsParser,
    ToolCall,
    ToolCallAccumulator,
    ToolParser,
    parse_all,
)
from pagedlm.entrypoints.openai.tool_parsers.deepseek_v3 import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
)
from pagedlm.entrypoints.openai.tool_parsers.internlm import ACTION_END, ACTION_START
from pagedlm.entrypoints.openai.tool_parsers.openai_harmony import MARKERS as HARMONY_MARKERS
from server.stream_splits import feed_in_pieces

FUZZ_EXAMPLES = 15
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# -- model text ---------------------------------------------------------------------------

_SPICY = list("ab xyz\n\t\"\\'{}[]<>|/:=,;()`é東☕🦜\u200b0.-")
_CHAR = st.sampled_from(_SPICY) | st.characters(codec="utf-8", exclude_categories=("Cs",))


def _text(max_size: int) -> st.SearchStrategy[str]:
    return st.text(_CHAR, max_size=max_size)


_SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text(8)
)
JSON_VALUES = st.recursive(
    _SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text(5), inner, max_size=3),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(_text(6), JSON_VALUES, max_size=4)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)
IDENTIFIERS = NAMES.filter(lambda name: not keyword.iskeyword(name))
BLANKS = st.sampled_from(["", "\n", " ", "\n\n", " \n"])


@st.composite
def json_text(draw, value: Any) -> str:
    """``value`` as a model may write it: ASCII-escaped or not, compact or indented."""
    ensure_ascii = draw(st.booleans())
    spacing = draw(st.sampled_from([None, (",", ":"), "indent"]))
    if spacing == "indent":
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=2)
    return json.dumps(value, ensure_ascii=ensure_ascii, separators=spacing)


def _arguments(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)


def content_without(*tags: str) -> st.SearchStrategy[str]:
    return _text(15).filter(lambda text: not any(tag in text for tag in tags))


Case = tuple[str, str, tuple[ToolCall, ...]]
"""(model text, content, calls)."""


def tagged_case(segments: list[tuple[str, tuple[ToolCall, ...] | None]]) -> Case:
    """Content and call blocks glued; blanks next to a call are not content."""
    content = []
    for i, (text, calls) in enumerate(segments):
        if calls is None:
            if i > 0 and segments[i - 1][1] is not None:
                text = text.lstrip()
            if i + 1 < len(segments) and segments[i + 1][1] is not None:
                text = text.rstrip()
            content.append(text)
    all_calls = tuple(call for _, calls in segments if calls for call in calls)
    return "".join(text for text, _ in segments), "".join(content), all_calls


def tagged_format(start: str, end: str, block, *forbidden: str) -> st.SearchStrategy[Case]:
    """Content, then blocks ``start body end`` with content between; the last may stay open."""

    @st.composite
    def cases(draw) -> Case:
        segments: list[tuple[str, tuple[ToolCall, ...] | None]] = [
            (draw(content_without(*forbidden)), None)
        ]
        num_blocks = draw(st.integers(0, 3))
        for i in range(num_blocks):
            body, calls = draw(block())
            closed = i < num_blocks - 1 or draw(st.booleans())
            segments.append((draw(BLANKS) + start + body + (end if closed else ""), calls))
            if closed:
                segments.append((draw(content_without(*forbidden)), None))
        return tagged_case(segments)

    return cases()


@st.composite
def json_call_block(draw, keys=("arguments", "parameters")) -> tuple[str, tuple[ToolCall, ...]]:
    name, arguments = draw(NAMES), draw(ARGUMENTS)
    body = draw(json_text({"name": name, draw(st.sampled_from(keys)): arguments}))
    return draw(BLANKS) + body + draw(BLANKS), (ToolCall(name, _arguments(arguments)),)


@st.composite
def deepseek_block(draw, v31: bool = False) -> tuple[str, tuple[ToolCall, ...]]:
    pieces, calls = [], []
    for _ in range(draw(st.integers(1, 3))):
        name, arguments = draw(NAMES), draw(ARGUMENTS)
        body = draw(json_text(arguments))
        if v31:
            pieces.append(f"{CALL_BEGIN}{name}{SEP}{body}{CALL_END}")
        else:
            pieces.append(f"{CALL_BEGIN}function{SEP}{name}\n```json\n{body}\n```{CALL_END}")
        calls.append(ToolCall(name, _arguments(arguments)))
    return draw(BLANKS) + "".join(pieces) + draw(BLANKS), tuple(calls)


QWEN3_TAGS = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
              "</parameter>")  # fmt: skip


@st.composite
def qwen3_coder_block(draw) -> tuple[str, tuple[ToolCall, ...]]:
    """Values are typed by their look (no tools given): text that is not JSON stays text."""
    name, parameters, arguments = draw(NAMES), "", {}
    for key in draw(st.lists(NAMES, max_size=3, unique=True)):
        if draw(st.booleans()):
            value = draw(JSON_VALUES.filter(lambda v: not isinstance(v, str)))
            raw = json.dumps(value, ensure_ascii=draw(st.booleans()))
        else:
            raw = value = "w" + draw(content_without(*QWEN3_TAGS))
        if any(tag in raw for tag in QWEN3_TAGS):
            continue
        arguments[key] = value
        parameters += f"<parameter={key}>\n{raw}\n</parameter>\n"
    body = f"\n<function={name}>\n{parameters}</function>\n"
    return body, (ToolCall(name, _arguments(arguments)),)


@st.composite
def mistral_case(draw) -> Case:
    """Both forms: ``[TOOL_CALLS][{...}, ...]`` and v11's ``[TOOL_CALLS]f[CALL_ID]id[ARGS]{}``."""
    segments: list[tuple[str, tuple[ToolCall, ...] | None]] = [
        (draw(content_without("[TOOL_CALLS]")), None)
    ]
    num_markers = draw(st.integers(0, 3))
    for i in range(num_markers):
        if draw(st.booleans()):
            items, calls = [], []
            for _ in range(draw(st.integers(1, 3))):
                name, arguments = draw(NAMES), draw(ARGUMENTS)
                items.append(draw(json_text({"name": name, "arguments": arguments})))
                calls.append(ToolCall(name, _arguments(arguments)))
            closed = i < num_markers - 1 or draw(st.booleans())
            separator = draw(st.sampled_from([", ", ",", ",\n"]))
            text = f"[TOOL_CALLS]{draw(BLANKS)}[{separator.join(items)}{']' if closed else ''}"
        else:
            name, arguments = draw(NAMES), draw(ARGUMENTS)
            calls = [ToolCall(name, _arguments(arguments))]
            call_id = draw(st.sampled_from(["", "[CALL_ID]a1B2c3D4e"]))
            args_marker = "[ARGS]" if call_id or draw(st.booleans()) else ""
            text = f"[TOOL_CALLS]{name}{call_id}{args_marker}{draw(json_text(arguments))}"
        segments.append((draw(BLANKS) + text, tuple(calls)))
        segments.append((draw(content_without("[TOOL_CALLS]")), None))
    return tagged_case(segments)


@st.composite
def pythonic_case(draw) -> Case:
    items, calls = [], []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(IDENTIFIERS)
        arguments = draw(st.dictionaries(IDENTIFIERS, JSON_VALUES, max_size=3))
        items.append(f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})")
        calls.append(ToolCall(name, _arguments(arguments)))
    tagged = draw(st.booleans())
    after = draw(_text(10))
    text = "[" + draw(st.sampled_from([", ", ","])).join(items) + "]"
    if tagged:
        text = f"<|python_start|>{text}<|python_end|>"
    return draw(BLANKS) + text + after, after.lstrip(), tuple(calls)


def json_calls_case(open_: list[str], key: str, separators: list[str], close: list[str]):
    """Call objects after an opener (a marker, ``[``), joined by a separator."""

    @st.composite
    def cases(draw) -> Case:
        items, calls = [], []
        for _ in range(draw(st.integers(1, 3))):
            name, arguments = draw(NAMES), draw(ARGUMENTS)
            items.append(draw(json_text({"name": name, key: arguments})))
            calls.append(ToolCall(name, _arguments(arguments)))
        text = draw(st.sampled_from(open_)) + draw(st.sampled_from(separators)).join(items)
        return draw(BLANKS) + text + draw(st.sampled_from(close)), "", tuple(calls)

    return cases()


HARMONY_BODY = _text(12).filter(
    lambda text: not any(text.endswith(m[:k]) or m in text
                         for m in HARMONY_MARKERS for k in range(1, len(m)))
)  # fmt: skip


@st.composite
def harmony_case(draw) -> tuple[str, str, str, tuple[ToolCall, ...]]:
    """(text, reasoning, content, calls) of gpt-oss messages; the prompt ended with
    ``<|start|>assistant``, and the stop token of the last message may be cut."""
    text, reasoning, content, calls = "", "", "", []
    num_messages = draw(st.integers(1, 4))
    for i in range(num_messages):
        kind = draw(st.sampled_from(["analysis", "call", "call_role", "final", "preamble", "tool"]))
        start = "" if i == 0 else "<|start|>assistant"
        end = draw(st.sampled_from(["<|end|>", "<|call|>", "<|return|>"]))
        if i == num_messages - 1 and draw(st.booleans()):
            end = ""
        if kind in ("call", "call_role"):
            name, arguments = draw(NAMES), draw(ARGUMENTS)
            header = (
                f"<|channel|>commentary to=functions.{name} <|constrain|>json"
                if kind == "call"
                else f" to=functions.{name}<|channel|>commentary <|constrain|>json"
            )
            text += f"{start}{header}<|message|>{draw(json_text(arguments))}{end}"
            calls.append(ToolCall(name, _arguments(arguments)))
        elif kind == "tool":  # gpt-oss's built-in tools are no function calls
            body = draw(json_text(draw(ARGUMENTS)))
            text += f"{start}<|channel|>analysis to=browser.search<|message|>{body}{end}"
        else:
            body = draw(HARMONY_BODY)
            channel = {"analysis": "analysis", "final": "final", "preamble": "commentary"}[kind]
            text += f"{start}<|channel|>{channel}<|message|>{body}{end}"
            if kind == "analysis":
                reasoning += body
            else:
                content += body
    return text, reasoning, content, tuple(calls)


@st.composite
def _harmony_tool_case(draw) -> Case:
    text, _, content, calls = draw(harmony_case())
    return text, content, calls


TOOL_FORMATS: dict[str, tuple[Callable[[], ToolParser], st.SearchStrategy[Case]]] = {
    "hermes": (
        TOOL_PARSERS["hermes"],
        tagged_format("<tool_call>", "</tool_call>", json_call_block, "<tool_call>"),
    ),
    "internlm": (
        TOOL_PARSERS["internlm"],
        tagged_format(ACTION_START, ACTION_END, json_call_block, ACTION_START),
    ),
    "deepseek_v3": (
        TOOL_PARSERS["deepseek_v3"],
        tagged_format(CALLS_BEGIN, CALLS_END, deepseek_block, CALLS_BEGIN),
    ),
    "deepseek_v31": (
        TOOL_PARSERS["deepseek_v31"],
        tagged_format(CALLS_BEGIN, CALLS_END, lambda: deepseek_block(True), CALLS_BEGIN),
    ),
    "qwen3_coder": (
        TOOL_PARSERS["qwen3_coder"],
        tagged_format(
            "<tool_call>", "</tool_call>", qwen3_coder_block, "<tool_call>", "<function="
        ),
    ),
    "mistral": (TOOL_PARSERS["mistral"], mistral_case()),
    "pythonic": (TOOL_PARSERS["pythonic"], pythonic_case()),
    "llama3_json": (
        TOOL_PARSERS["llama3_json"],
        json_calls_case(["", "<|python_tag|>"], "parameters", ["; ", ";", "\n;\n"], ["", "\n"]),
    ),
    "granite": (
        TOOL_PARSERS["granite"],
        json_calls_case(
            ["[", "<|tool_call|>[", "<tool_call> ["], "arguments", [", "], ["]", "]\n", ""]
        ),
    ),
    "openai": (TOOL_PARSERS["openai"], _harmony_tool_case()),
    "required": (
        RequiredToolCallsParser,
        json_calls_case(["["], "parameters", [", ", ","], ["]", "]\n"]),
    ),
}


# -- checks -------------------------------------------------------------------------------


def _random_cuts(text: str, rng: random.Random) -> list[list[int]]:
    cuts = [list(range(1, len(text)))]  # one character at a time
    for _ in range(3):
        size = min(len(text) + 1, rng.randrange(1, 8))
        cuts.append(sorted(rng.sample(range(len(text) + 1), size)))
    return cuts


def _check_indexes(deltas: list[ParsedDelta]) -> None:
    """A call's first piece has its name and the next index; later pieces none."""
    num_calls = 0
    for delta in deltas:
        for call in delta.calls:
            if call.name is not None:
                assert call.index == num_calls, deltas
                num_calls += 1
            else:
                assert 0 <= call.index < num_calls, deltas


def _accumulated(deltas: list[ParsedDelta]) -> ParsedOutput:
    accumulator = ToolCallAccumulator()
    for delta in deltas:
        accumulator.add(delta)
    return accumulator.result()


def check_any_split_agrees(
    new_parser: Callable[[], ToolParser], text: str, rng: random.Random
) -> ParsedOutput:
    whole = parse_all(new_parser(), text)
    for call in whole.calls:  # a response carries them as UTF-8
        call.name.encode()
        call.arguments.encode()
    for cuts in _random_cuts(text, rng):
        deltas = feed_in_pieces(new_parser(), text, cuts)
        _check_indexes(deltas)
        assert _accumulated(deltas) == whole, (text, cuts)
    return whole


@pytest.mark.parametrize("name", list(TOOL_FORMATS))
def test_tool_parser_reads_its_format_whatever_the_split(name):
    new_parser, cases = TOOL_FORMATS[name]

    @FUZZ
    @given(cases, st.randoms(use_true_random=False))
    def check(case: Case, rng: random.Random) -> None:
        text, content, calls = case
        assert check_any_split_agrees(new_parser, text, rng) == ParsedOutput(content, calls)

    check()


GARBLE = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
          "<|python_start|>", "<|tool_call|>", "<function=f>", "</parameter>", CALLS_BEGIN,
          CALL_BEGIN, CALL_END, SEP, ACTION_START, *HARMONY_MARKERS, " to=functions.f", "{",
          "}", "[", "]", '"', "\\", ",", ";", " ", "\n", "\\ud83d", "é", "(", ")", "'", '"""',
          "```"]  # fmt: skip


@st.composite
def garbled(draw, cases: st.SearchStrategy[Case]) -> str:
    """A well-formed output cut short, with pieces spliced in or dropped."""
    text = draw(cases)[0]
    for _ in range(draw(st.integers(0, 3))):
        op, at = draw(st.integers(0, 2)), draw(st.integers(0, len(text)))
        if op == 0:
            text = text[:at]
        elif op == 1:
            text = text[:at] + draw(st.sampled_from(GARBLE)) + text[at:]
        else:
            text = text[:at] + text[at + 1 :]
    return text


@pytest.mark.parametrize("name", list(TOOL_FORMATS))
def test_garbled_output_never_raises_and_any_split_agrees(name):
    new_parser, cases = TOOL_FORMATS[name]

    @FUZZ
    @given(garbled(cases), st.randoms(use_true_random=False))
    def check(text: str, rng: random.Random) -> None:
        check_any_split_agrees(new_parser, text, rng)

    check()


# -- reasoning ----------------------------------------------------------------------------


@st.composite
def think_case(draw, parser_class, prompt_opened: bool = False) -> tuple[str, str, str]:
    """(text, reasoning, content): an optional start marker, a thought, maybe its end;
    ``prompt_opened``: after a prompt that ended with a start marker."""
    starts, ends = parser_class.start_tags, parser_class.end_tags
    lead, thought = draw(BLANKS), draw(content_without(*starts, *ends))
    opened, closed = draw(st.booleans()), draw(st.booleans())
    text = lead + (draw(st.sampled_from(starts)) if opened else "") + thought
    answer = draw(_text(15))
    if closed:
        text += draw(st.sampled_from(ends)) + draw(BLANKS) + answer
    if not opened and not (parser_class.starts_in_reasoning or prompt_opened):
        return text, "", text  # no thought: all of it is the answer
    return text, thought if opened else lead + thought, answer.lstrip() if closed else ""


THINK_PARSERS = {name: parser for name, parser in REASONING_PARSERS.items()
                 if parser.end_tags}  # fmt: skip


def _joined(parser: ReasoningParser, text: str, cuts: list[int]) -> tuple[str, str]:
    deltas = feed_in_pieces(parser, text, cuts)
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("name", list(THINK_PARSERS))
def test_reasoning_parser_splits_thought_from_answer_whatever_the_split(name):
    parser_class = THINK_PARSERS[name]

    @FUZZ
    @given(think_case(parser_class), st.randoms(use_true_random=False))
    def check(case: tuple[str, str, str], rng: random.Random) -> None:
        text, reasoning, content = case
        for cuts in [[], *_random_cuts(text, rng)]:
            assert _joined(parser_class(), text, cuts) == (reasoning, content), (text, cuts)

    check()


WAITING_PARSERS = [name for name, parser in THINK_PARSERS.items()
                   if not parser.starts_in_reasoning]  # fmt: skip
"""The families whose output has a thought only when it opens one, unless the prompt did."""


def _opened_by_the_prompt(parser_class) -> Callable[[], ReasoningParser]:
    tail = f"<|im_start|>assistant\n{parser_class.start_tags[0]}\n"
    return reasoning_parser_factory(parser_class, tail)


@pytest.mark.parametrize("name", WAITING_PARSERS)
def test_reasoning_parser_inside_a_thought_the_prompt_opened_whatever_the_split(name):
    """The chat template ended the prompt with the start marker: the output is thought up
    to the end marker (all of it when cut off), whether or not it writes the marker."""
    parser_class = THINK_PARSERS[name]
    new_parser = _opened_by_the_prompt(parser_class)

    @FUZZ
    @given(think_case(parser_class, prompt_opened=True), st.randoms(use_true_random=False))
    def check(case: tuple[str, str, str], rng: random.Random) -> None:
        text, reasoning, content = case
        for cuts in [[], *_random_cuts(text, rng)]:
            assert _joined(new_parser(), text, cuts) == (reasoning, content), (text, cuts)

    check()


REASONING_GARBLE = ["<think>", "</think>", "[THINK]", "[/THINK]", "<seed:think>",
                    "</seed:think>", "Here is my thought process:", "Here's my response:",
                    "<response>", "</response>", *HARMONY_MARKERS, " to=functions.f",
                    "analysis", "final", "<", "/", "Here", " ", "\n", "é"]  # fmt: skip


REASONING_TEXTS = st.lists(st.sampled_from(REASONING_GARBLE) | _text(4), max_size=10).map("".join)


@pytest.mark.parametrize("name", list(REASONING_PARSERS))
def test_any_reasoning_parser_on_any_text_agrees_whatever_the_split(name):
    parser_class = REASONING_PARSERS[name]

    @FUZZ
    @given(REASONING_TEXTS, st.randoms(use_true_random=False))
    def check(text: str, rng: random.Random) -> None:
        whole = _joined(parser_class(), text, [])
        for cuts in _random_cuts(text, rng):
            assert _joined(parser_class(), text, cuts) == whole, (text, cuts)

    check()


@pytest.mark.parametrize("name", WAITING_PARSERS)
def test_after_a_prompt_that_opened_the_thought_any_text_agrees_whatever_the_split(name):
    """Any text after such a prompt: no content before an end marker, and any split
    agrees."""
    parser_class = REASONING_PARSERS[name]
    new_parser = _opened_by_the_prompt(parser_class)

    @FUZZ
    @given(REASONING_TEXTS, st.randoms(use_true_random=False))
    def check(text: str, rng: random.Random) -> None:
        whole = _joined(new_parser(), text, [])
        if not any(tag in text for tag in parser_class.end_tags):
            assert whole[1] == "", text
        for cuts in _random_cuts(text, rng):
            assert _joined(new_parser(), text, cuts) == whole, (text, cuts)

    check()


# -- the server's chain -------------------------------------------------------------------


def _stream(parser: ChatOutputParser, text: str, cuts: list[int]) -> list[dict]:
    deltas, previous = [], 0
    for cut in [*cuts, len(text)]:
        deltas.append(parser.feed(text[previous:cut]))
        previous = cut
    deltas.append(parser.finish())
    return deltas


def _message_from_stream(deltas: list[dict]) -> dict:
    """What a client builds from the chunks: content joined, calls by index."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: list[dict] = []
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] == len(calls) and piece["function"]["name"]
                calls.append({"id": piece["id"], "name": piece["function"]["name"], "args": ""})
            else:
                assert "name" not in piece["function"]
            calls[piece["index"]]["args"] += piece["function"]["arguments"]
    return {"content": content, "reasoning": reasoning, "calls": calls}


def _message_as_stream(message: dict) -> dict:
    calls = [
        {"id": c["id"], "name": c["function"]["name"], "args": c["function"]["arguments"]}
        for c in message.get("tool_calls", [])
    ]
    return {
        "content": message["content"] or "",
        "reasoning": message.get("reasoning_content") or "",
        "calls": calls,
    }


@FUZZ
@given(harmony_case(), st.randoms(use_true_random=False))
def test_gpt_oss_chain_streams_what_it_answers(case, rng):
    """openai_gptoss then openai, as the server chains them: the stream joined is the
    message, the message is what the model wrote, and the tool parser alone agrees."""
    text, reasoning, content, calls = case
    ids = iter(range(10**6))
    whole = ChatOutputParser.build(OpenAIGptOssReasoningParser, OpenAIToolParser, lambda: "id")
    _stream(whole, text, [])
    message = whole.message()
    assert _message_as_stream(message) == {
        "content": content,
        "reasoning": reasoning,
        "calls": [{"id": "id", "name": c.name, "args": c.arguments} for c in calls],
    }
    assert parse_all(OpenAIToolParser(), text) == ParsedOutput(content, calls)
    for cuts in _random_cuts(text, rng):
        parser = ChatOutputParser.build(
            OpenAIGptOssReasoningParser, OpenAIToolParser, lambda: f"call_{next(ids)}"
        )
        streamed = _message_from_stream(_stream(parser, text, cuts))
        assert streamed == _message_as_stream(parser.message())
        assert streamed["calls"] == [
            {"id": call["id"], "name": c.name, "args": c.arguments}
            for call, c in zip(streamed["calls"], calls, strict=True)
        ]


@st.composite
def think_then_calls(draw) -> tuple[str, str, Case]:
    name = draw(st.sampled_from(["hermes", "qwen3_coder", "pythonic"]))
    thought = draw(content_without("</think>"))
    case = draw(TOOL_FORMATS[name][1])
    return name, f"<think>{thought}</think>{draw(BLANKS)}", case


@FUZZ
@given(think_then_calls(), st.randoms(use_true_random=False))
def test_reasoning_then_tool_parser_stream_what_they_answer(case, rng):
    name, thought, (text, content, calls) = case
    text = thought + text
    for cuts in [[], *_random_cuts(text, rng)]:
        parser = ChatOutputParser.build(REASONING_PARSERS["qwen3"], TOOL_PARSERS[name])
        streamed = _message_from_stream(_stream(parser, text, cuts))
        assert streamed == _message_as_stream(parser.message())
        assert streamed["content"] == content.lstrip()  # the blanks after </think> go
        assert [(c["name"], c["args"]) for c in streamed["calls"]] == [
            (c.name, c.arguments) for c in calls
        ]


@FUZZ
@given(think_then_calls(), st.randoms(use_true_random=False))
def test_a_thought_the_prompt_opened_then_tool_calls_stream_what_they_answer(case, rng):
    """Qwen3.5's way: the template wrote ``<think>``, the model writes the rest."""
    name, thought, (text, content, calls) = case
    text = thought.removeprefix("<think>") + text
    new_reasoning_parser = _opened_by_the_prompt(REASONING_PARSERS["qwen3"])
    for cuts in [[], *_random_cuts(text, rng)]:
        parser = ChatOutputParser.build(new_reasoning_parser, TOOL_PARSERS[name])
        streamed = _message_from_stream(_stream(parser, text, cuts))
        assert streamed == _message_as_stream(parser.message())
        assert streamed["reasoning"] == thought.removeprefix("<think>").rstrip().removesuffix(
            "</think>"
        )
        assert streamed["content"] == content.lstrip()
        assert [(c["name"], c["args"]) for c in streamed["calls"]] == [
            (c.name, c.arguments) for c in calls
        ]


# -- the bugs the fuzzing found -----------------------------------------------------------


def test_gpt_oss_first_message_may_name_its_recipient_before_the_channel():
    """The prompt ends with ``<|start|>assistant``, so a recipient in the first message's
    role section comes first in the output. It was read as content (the recipient text and
    the arguments both), and the call was lost."""
    text = ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}'
    weather = ToolCall("get_weather", '{"city": "Paris"}')
    for output in (text, text + "<|call|>"):
        for cuts in [[], list(range(1, len(output)))]:
            assert _accumulated(feed_in_pieces(OpenAIToolParser(), output, cuts)) == (
                ParsedOutput("", (weather,))
            )
        chained = ChatOutputParser.build(OpenAIGptOssReasoningParser, OpenAIToolParser)
        _stream(chained, output, [3, 4, 17])
        message = chained.message()
        assert message["content"] is None and message["reasoning_content"] is None
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    # text that only starts like a recipient is still content
    for plain in ("to be or not", " to=x and more", "t", "to="):
        assert parse_all(OpenAIToolParser(), plain) == ParsedOutput(plain, ())
        assert split_reasoning(OpenAIGptOssReasoningParser(), plain).content == plain


LONE_SURROGATE_OUTPUTS = {
    "hermes": '<tool_call>{"name": "echo", "arguments": {"text": "\\ud83d"}}</tool_call>',
    "internlm": f'{ACTION_START}{{"name": "echo", "parameters": {{"text": "\\ud83d"}}}}{ACTION_END}',
    "llama3_json": '{"name": "echo", "parameters": {"text": "\\ud83d"}}',
    "granite": '<|tool_call|>[{"name": "echo", "arguments": {"text": "\\ud83d"}}]',
    "mistral": '[TOOL_CALLS]echo[ARGS]{"text": "\\ud83d"}',
    "deepseek_v31": f'{CALLS_BEGIN}{CALL_BEGIN}echo{SEP}{{"text": "\\ud83d"}}{CALL_END}{CALLS_END}',
    "pythonic": "[echo(text='\\ud83d')]",
    "qwen3_coder": "<tool_call>\n<function=echo>\n<parameter=text>\n"
    '{"\\ud83d": 1}\n</parameter>\n</function>\n</tool_call>',
    "openai": '<|channel|>commentary to=functions.echo<|message|>{"text": "\\ud83d"}<|call|>',
}


@pytest.mark.parametrize("name", list(LONE_SURROGATE_OUTPUTS))
def test_arguments_with_half_a_surrogate_pair_stay_encodable(name):
    """A model's JSON (or Python) may escape half of a surrogate pair. The arguments were
    re-serialized with the lone surrogate as a character, which UTF-8 cannot encode: a
    non-streaming response with such a call failed with a 500. It stays escaped now."""
    output = LONE_SURROGATE_OUTPUTS[name]
    (call,) = parse_all(TOOL_PARSERS[name](), output).calls
    assert call.name == "echo"
    assert "\\ud83d" in call.arguments
    lone = {"\ud83d": 1} if name == "qwen3_coder" else "\ud83d"
    assert json.loads(call.arguments.encode()) == {"text": lone}
    # a whole surrogate pair, escaped, is the character it spells
    pair = output.replace("\\ud83d", "\\ud83d\\ude00")
    assert "😀" in parse_all(TOOL_PARSERS[name](), pair).calls[0].arguments


def test_a_name_with_half_a_surrogate_pair_is_no_call():
    output = '<tool_call>{"name": "echo\\udc00", "arguments": {}}</tool_call>'
    assert parse_all(TOOL_PARSERS["hermes"](), output) == ParsedOutput(output, ())


def test_a_lone_surrogate_in_a_call_does_not_fail_the_response(chat_checkpoint):
    from server.fake_engine import scripted_chat

    tool = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Echo."}],
            "tools": [tool], "max_tokens": 400}  # fmt: skip
    message, stream = scripted_chat(
        chat_checkpoint,
        LONE_SURROGATE_OUTPUTS["hermes"],
        body,
        tool_parser="hermes",
        enable_auto_tool_choice=True,
    )
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"text": "\ud83d"}
    assert "\\\\ud83d" in stream
