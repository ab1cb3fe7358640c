"""gpt-oss's harmony output: the ``openai_gptoss`` reasoning parser and the ``openai`` tool
parser (vLLM's names) on realistic outputs, cut off anywhere, split at every position, alone
and chained as the server chains them (reasoning parser's content -> tool parser); garbage
never raises."""

from __future__ import annotations

import json
import random

import pytest

from pagedlm.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    OpenAIGptOssReasoningParser,
    ReasoningDelta,
    split_reasoning,
)
from pagedlm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    OpenAIToolParser,
    ParsedOutput,
    ToolCall,
    ToolCallAccumulator,
    parse_all,
)
from pagedlm.entrypoints.openai.tool_parsers.openai_harmony import MARKERS
from server.stream_splits import assert_every_split_gives, feed_in_pieces

THOUGHT = "User wants weather; 2 < 3 → call « tool » 東京."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>"
WEATHER_BODY = '{"city":"Paris", "unit": "celsius"}'
WEATHER_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    f"<|message|>{WEATHER_BODY}<|call|>"
)
TIME_CALL = (
    "<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json"
    '<|message|>{"tz": "Europe/Paris"}<|call|>'
)


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


WEATHER = _call("get_weather", city="Paris", unit="celsius")
TIME = _call("get_time", tz="Europe/Paris")

# (model text, content, calls) for the tool parser alone
TOOL_CASES = [
    (ANALYSIS + FINAL, "The answer is 4.", []),
    (ANALYSIS + FINAL.removesuffix("<|return|>"), "The answer is 4.", []),  # stop token cut
    (ANALYSIS + WEATHER_CALL, "", [WEATHER]),
    (ANALYSIS + WEATHER_CALL.removesuffix("<|call|>"), "", [WEATHER]),  # stop token cut
    (ANALYSIS + WEATHER_CALL + TIME_CALL, "", [WEATHER, TIME]),
    (WEATHER_CALL.replace("<|call|>", "<|end|>") + TIME_CALL[:-8], "", [WEATHER, TIME]),
    (ANALYSIS + TIME_CALL, "", [TIME]),  # recipient before the channel
    (WEATHER_CALL.removeprefix("<|start|>assistant"), "", [WEATHER]),  # the output's start
    (
        ANALYSIS
        + "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
        + WEATHER_CALL,
        "Let me check.",
        [WEATHER],
    ),  # a preamble is content
    (
        "<|channel|>commentary to=functions.ping<|message|><|call|>",
        "",
        [ToolCall("ping", "{}")],
    ),
    (
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|> not json <|call|>",
        "",
        [ToolCall("f", "not json")],
    ),  # ended by the model: arguments as given (vLLM)
    (
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city": "Pa',
        '{"city": "Pa',
        [],
    ),  # cut off inside the arguments: an unfinished call is content
    ("<|channel|>commentary to=functions.get_weather <|constrain|>js", "", []),
    (
        ANALYSIS + "<|start|>assistant<|channel|>analysis to=browser.search<|message|>"
        '{"query": "x"}<|call|>',
        "",
        [],
    ),  # a built-in tool: not a function call
    (ANALYSIS, "", []),
    (f"<|channel|>analysis<|message|>{THOUGHT}", "", []),  # cut off in the thought
    ("The answer is 4.", "The answer is 4.", []),  # no harmony framing at all
    ("<|channel|>final<|message|>a <|channel is not|> b", "a <|channel is not|> b", []),
    ("", "", []),
]

# (model text, reasoning, content) for the reasoning parser alone
REASONING_CASES = [
    (ANALYSIS + FINAL, THOUGHT, "The answer is 4."),
    (ANALYSIS + FINAL.removesuffix("<|return|>"), THOUGHT, "The answer is 4."),
    (
        ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|> More.<|end|>" + FINAL,
        THOUGHT + " More.",
        "The answer is 4.",
    ),
    (f"<|channel|>analysis<|message|>{THOUGHT}", THOUGHT, ""),  # cut off in the thought
    ("<|channel|>analysis<|mess", "", ""),  # cut off in the header
    ("<|channel|>final<|message|>The answer is 4.", "", "The answer is 4."),
    (
        "<|channel|>commentary<|message|>Checking.<|end|>" + FINAL,
        "",
        "Checking.The answer is 4.",
    ),
    (
        ANALYSIS + WEATHER_CALL,
        THOUGHT,
        "<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>"
        f"{WEATHER_BODY}<|call|>",
    ),  # passed on for the tool parser
    (
        ANALYSIS + TIME_CALL[:-8],
        THOUGHT,
        "<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>"
        '{"tz": "Europe/Paris"}',
    ),
    ("The answer is 4.", "", "The answer is 4."),
    ("", "", ""),
]


def _accumulated(deltas: list) -> ParsedOutput:
    accumulator = ToolCallAccumulator()
    for delta in deltas:
        accumulator.add(delta)
    return accumulator.result()


def _joined(deltas: list[ReasoningDelta]) -> ReasoningDelta:
    return ReasoningDelta("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))


def test_registered_under_vllm_names():
    assert TOOL_PARSERS["openai"] is OpenAIToolParser
    assert REASONING_PARSERS["openai_gptoss"] is OpenAIGptOssReasoningParser
    assert OpenAIToolParser.needs_special_tokens
    assert OpenAIGptOssReasoningParser.needs_special_tokens
    assert OpenAIToolParser.new_call_id().startswith("call_")


@pytest.mark.parametrize(("text", "content", "calls"), TOOL_CASES)
def test_tool_parser_every_split(text, content, calls):
    expected = ParsedOutput(content, tuple(calls))
    assert parse_all(OpenAIToolParser(), text) == expected
    assert_every_split_gives(OpenAIToolParser, text, expected, _accumulated)


@pytest.mark.parametrize(("text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_parser_every_split(text, reasoning, content):
    expected = ReasoningDelta(reasoning, content)
    assert split_reasoning(OpenAIGptOssReasoningParser(), text) == expected
    assert_every_split_gives(OpenAIGptOssReasoningParser, text, expected, _joined)


def _chained(text: str, cuts: list[int]) -> tuple[str, ParsedOutput]:
    """The server's chain: each piece through the reasoning parser, its content through the
    tool parser."""
    reasoning_parser, tool_parser = OpenAIGptOssReasoningParser(), OpenAIToolParser()
    reasoning: list[str] = []
    accumulator = ToolCallAccumulator()
    for delta in feed_in_pieces(reasoning_parser, text, cuts):  # its finish() included
        reasoning.append(delta.reasoning)
        accumulator.add(tool_parser.feed(delta.content))
    accumulator.add(tool_parser.finish())
    return "".join(reasoning), accumulator.result()


@pytest.mark.parametrize(("text", "content", "calls"), TOOL_CASES)
def test_chained_like_the_server(text, content, calls):
    """Reasoning parser then tool parser: the tool parser's content and calls are those it
    finds alone, and the reasoning is the analysis text."""
    whole = split_reasoning(OpenAIGptOssReasoningParser(), text)
    expected = (whole.reasoning, ParsedOutput(content, tuple(calls)))
    assert _chained(text, []) == expected
    for cut in range(len(text) + 1):
        assert _chained(text, [cut]) == expected, cut
    assert _chained(text, list(range(1, len(text)))) == expected


def test_garbage_never_raises_and_is_split_invariant():
    rng = random.Random(0)
    pieces = [
        *MARKERS,
        "assistant",
        " to=functions.f",
        " to=",
        "analysis",
        "final",
        "commentary",
        '{"a": [1, {"b": 2}]}',
        "{",
        "}",
        "<|",
        "|>",
        " ",
        "x",
        "[" * 50,
    ]
    for _ in range(150):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        whole_tools = parse_all(OpenAIToolParser(), text)
        whole_reasoning = split_reasoning(OpenAIGptOssReasoningParser(), text)
        assert not any(m in whole_reasoning.reasoning for m in MARKERS), text
        for cuts in (
            [rng.randint(0, len(text))],
            sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1))),
            list(range(1, len(text))),
        ):
            assert _accumulated(feed_in_pieces(OpenAIToolParser(), text, cuts)) == whole_tools
            assert _joined(feed_in_pieces(OpenAIGptOssReasoningParser(), text, cuts)) == (
                whole_reasoning
            )
    deep = "<|channel|>commentary to=functions.f<|message|>" + "[" * 100_000 + "<|call|>"
    assert parse_all(OpenAIToolParser(), deep).calls[0].name == "f"


def test_reasoning_and_tool_call_through_the_app(chat_checkpoint):
    """A gpt-oss-like output (the stop token stripped): the thought, a preamble, a call;
    both parsers chained per choice, whole and streamed."""
    from server.fake_engine import scripted_chat

    output = (
        "<|channel|>analysis<|message|>Paris weather: call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        + WEATHER_CALL.removesuffix("<|call|>")
    )

    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [tool], "max_tokens": 400}  # fmt: skip
    message, stream = scripted_chat(
        chat_checkpoint,
        output,
        body,
        tool_parser="openai",
        reasoning_parser="openai_gptoss",
        enable_auto_tool_choice=True,
    )
    assert message["reasoning_content"] == "Paris weather: call the tool."
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "get_weather",
        {"city": "Paris", "unit": "celsius"},
    )
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == [
        "get_weather"
    ]
