"""Reasoning parsers on recorded model-like outputs, split at every position."""

from __future__ import annotations

import pytest
from stream_splits import assert_every_split_gives

from pagedlm.entrypoints.openai.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    get_reasoning_parser,
    split_reasoning,
)

THOUGHT = "The user asks 2+2. That is 4 < 5."

R1_CASES = [
    # (model text, reasoning, content)
    (f"{THOUGHT}</think>\n\nThe answer is 4.", THOUGHT, "The answer is 4."),
    (f"<think>\n{THOUGHT}</think>The answer is 4.", f"\n{THOUGHT}", "The answer is 4."),
    (f"{THOUGHT} still thinking", f"{THOUGHT} still thinking", ""),  # cut off by max_tokens
    (f"{THOUGHT}</thi", f"{THOUGHT}</thi", ""),
    ("</think>Answer only.", "", "Answer only."),
    (f"{THOUGHT}</think>  \n", THOUGHT, ""),
    (f"{THOUGHT}</think>A </think> B", THOUGHT, "A </think> B"),
    ("<thinking>x</think>y", "<thinking>x", "y"),
    ("", "", ""),
]

QWEN3_CASES = [
    (f"<think>\n{THOUGHT}\n</think>\n\nThe answer is 4.", f"\n{THOUGHT}\n", "The answer is 4."),
    ("The answer is 4.", "", "The answer is 4."),
    ("  <think>x</think>y", "x", "y"),
    ("<thin", "", "<thin"),
    (f"<think>{THOUGHT}", THOUGHT, ""),
    ("<b>bold</b>", "", "<b>bold</b>"),
    ("", "", ""),
]


def _joined(deltas: list[ReasoningDelta]) -> ReasoningDelta:
    return ReasoningDelta("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))


def _check(parser_class, text, reasoning, content):
    expected = ReasoningDelta(reasoning, content)
    assert split_reasoning(parser_class(), text) == expected
    assert_every_split_gives(parser_class, text, expected, _joined)


@pytest.mark.parametrize("text, reasoning, content", R1_CASES)
def test_deepseek_r1(text, reasoning, content):
    _check(DeepSeekR1ReasoningParser, text, reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", QWEN3_CASES)
def test_qwen3(text, reasoning, content):
    _check(Qwen3ReasoningParser, text, reasoning, content)


def test_reasoning_streams_before_the_close_tag():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("Let me think").reasoning == "Let me think"
    assert parser.feed(" more</th") == ReasoningDelta(" more", "")
    assert parser.feed("ink>\nDone") == ReasoningDelta("", "Done")


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
