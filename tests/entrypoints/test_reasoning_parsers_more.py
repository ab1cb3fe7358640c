"""The reasoning parsers named like vLLM's (granite, mistral, glm45, seed_oss, ernie45) on
model-like outputs, split at every position; and one chat request through the app with a
reasoning parser and a tool parser together."""

from __future__ import annotations

import json
import random

import pytest

from pagedlm.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    Ernie45ReasoningParser,
    Glm45ReasoningParser,
    GraniteReasoningParser,
    MistralReasoningParser,
    ReasoningDelta,
    SeedOssReasoningParser,
    get_reasoning_parser,
    split_reasoning,
)
from server.stream_splits import assert_every_split_gives, feed_in_pieces

THOUGHT = "The user asks 2+2 → 4 < 5, « unicode » 東京."

GRANITE_CASES = [
    # (model text, reasoning, content)
    (
        f"Here is my thought process:\n{THOUGHT}\n\nHere is my response:\nThe answer is 4.",
        f"\n{THOUGHT}\n\n",
        "The answer is 4.",
    ),
    ("Here's my thought process: x Here's my response: y", " x ", "y"),
    ("Here is my thought process: x Here's my response: y", " x ", "y"),
    (f"  Here is my thought process:{THOUGHT}", THOUGHT, ""),  # cut off inside the thought
    ("Here is my thought process: a Here is my resp", " a Here is my resp", ""),
    ("The answer is 4.", "", "The answer is 4."),
    ("Here is the answer: 4.", "", "Here is the answer: 4."),
    ("Here is my", "", "Here is my"),
    ("", "", ""),
]

MISTRAL_CASES = [
    (f"[THINK]{THOUGHT}[/THINK]The answer is 4.", THOUGHT, "The answer is 4."),
    (f"[THINK]\n{THOUGHT}\n[/THINK]\n\nThe answer is 4.", f"\n{THOUGHT}\n", "The answer is 4."),
    ("The answer is 4.", "", "The answer is 4."),
    (f"[THINK]{THOUGHT}", THOUGHT, ""),
    ("[THI", "", "[THI"),
    ("[THINK]a[/THINK]b [/THINK] c", "a", "b [/THINK] c"),
    ("", "", ""),
]

GLM45_CASES = [
    (f"<think>{THOUGHT}</think>\nThe answer is 4.", THOUGHT, "The answer is 4."),
    (f"\n<think>{THOUGHT}</think>The answer is 4.", THOUGHT, "The answer is 4."),
    ("The answer is 4.", "", "The answer is 4."),  # thinking off: the template closed it
    (f"<think>{THOUGHT}", THOUGHT, ""),
    ("<thi", "", "<thi"),
    ("", "", ""),
]

SEED_OSS_CASES = [
    (f"<seed:think>{THOUGHT}</seed:think>The answer is 4.", THOUGHT, "The answer is 4."),
    (f"{THOUGHT}</seed:think>\n\nThe answer is 4.", THOUGHT, "The answer is 4."),
    (
        "<seed:think>a<seed:cot_budget_reflect>I have used 9 tokens.</seed:cot_budget_reflect>b"
        "</seed:think>c",
        "a<seed:cot_budget_reflect>I have used 9 tokens.</seed:cot_budget_reflect>b",
        "c",
    ),
    (THOUGHT, THOUGHT, ""),
    (f"{THOUGHT}</seed:th", f"{THOUGHT}</seed:th", ""),
    ("", "", ""),
]

ERNIE45_CASES = [
    (f"{THOUGHT}\n</think>\n\n<response>\nThe answer is 4.\n</response>\n", f"{THOUGHT}\n", "The answer is 4."),
    (f"{THOUGHT}\n</think>\nThe answer is 4.", f"{THOUGHT}\n", "The answer is 4."),
    ("<think>abc</think><response>d e</response>", "abc", "d e"),
    (THOUGHT, THOUGHT, ""),
    ("a</think><response>\ncut off  ", "a", "cut off  "),
    ("a</think><resp", "a", "<resp"),
    ("a</think><response>x</response> tail", "a", "x tail"),
    ("a</think>plain <response>x</response>", "a", "plain <response>x</response>"),
    ("a</think><response>x </respo", "a", "x </respo"),
    ("", "", ""),
]  # fmt: skip

CASES = {
    "granite": (GraniteReasoningParser, GRANITE_CASES),
    "mistral": (MistralReasoningParser, MISTRAL_CASES),
    "glm45": (Glm45ReasoningParser, GLM45_CASES),
    "seed_oss": (SeedOssReasoningParser, SEED_OSS_CASES),
    "ernie45": (Ernie45ReasoningParser, ERNIE45_CASES),
}
ALL_CASES = [(name, *case) for name, (_, cases) in CASES.items() for case in cases]


def _joined(deltas: list[ReasoningDelta]) -> ReasoningDelta:
    return ReasoningDelta("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))


@pytest.mark.parametrize("name, text, reasoning, content", ALL_CASES)
def test_every_split_gives_the_whole_text_answer(name, text, reasoning, content):
    parser_class = CASES[name][0]
    expected = ReasoningDelta(reasoning, content)
    assert split_reasoning(parser_class(), text) == expected
    assert_every_split_gives(parser_class, text, expected, _joined)


def test_granite_streams_the_thought_before_the_response_sentence():
    parser = GraniteReasoningParser()
    assert parser.feed("Here is my thought") == ReasoningDelta()
    assert parser.feed(" process: I think") == ReasoningDelta(" I think", "")
    assert parser.feed(" so. Here is my") == ReasoningDelta(" so. ", "")
    assert parser.feed(" response: 4") == ReasoningDelta("", "4")


FRAGMENTS = ["<think>", "</think>", "[THINK]", "[/THINK]", "<seed:think>", "</seed:think>",
             "<response>", "</response>", "Here is my thought process:", "Here's my response:",
             "Here is", " ", "\n", "x", "<", "[", "é☕"]  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_random_text_any_split_agrees(name):
    rng = random.Random(name)
    parser_class, cases = CASES[name]
    pieces = FRAGMENTS + [text for text, _, _ in cases]
    for _ in range(150):
        text = "".join(rng.choices(pieces, k=rng.randrange(1, 10)))
        expected = split_reasoning(parser_class(), text)
        splits = [list(range(1, len(text)))]
        splits += [
            sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4))) for _ in range(4)
        ]
        for cuts in splits:
            assert _joined(feed_in_pieces(parser_class(), text, cuts)) == expected, (text, cuts)


def test_registered_under_vllms_names(capsys):
    from pagedlm.entrypoints.cli.main import build_parser

    for name, (parser_class, _) in CASES.items():
        assert REASONING_PARSERS[name] is parser_class is get_reasoning_parser(name)
        assert (
            build_parser().parse_args(["serve", "--reasoning-parser", name]).reasoning_parser
            == name
        )
    from pagedlm.entrypoints.openai.parser_plugins import check_parser_args

    with pytest.raises(SystemExit) as exit_info:
        check_parser_args(build_parser().parse_args(["serve", "--reasoning-parser", "nope"]))
    error = str(exit_info.value)
    assert all(repr(name) in error for name in CASES), error


def test_reasoning_and_tool_call_through_the_app(chat_checkpoint):
    """Mistral v11 output: a thought, then a call; both parsers chained per choice."""
    from server.fake_engine import scripted_chat

    output = '[THINK]Paris weather: call the tool.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'

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
        tool_parser="mistral",
        reasoning_parser="mistral",
        enable_auto_tool_choice=True,
    )
    assert message["reasoning_content"] == "Paris weather: call the tool."
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "get_weather",
        {"city": "Paris"},
    )
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == [
        "get_weather"
    ]
