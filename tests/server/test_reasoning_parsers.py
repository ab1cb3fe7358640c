"""Reasoning parsers on recorded model-like outputs, split at every position; a prompt whose
chat template opened the thought, through the parser and through the chat route."""

from __future__ import annotations

import json

import pytest
from stream_splits import assert_every_split_gives

from pagedlm.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    get_reasoning_parser,
    reasoning_parser_factory,
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


# -- a chat template that opens the thought -----------------------------------------------

QWEN3_OPENED = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
"""How a Qwen3-*-Thinking-2507 / Qwen3.5 / QwQ template ends the generation prompt."""
QWEN3_THINKING_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
"""How Qwen3's template ends it with ``enable_thinking=False``."""

QWEN3_OPENED_CASES = [
    (f"{THOUGHT}\n</think>\n\nThe answer is 4.", f"{THOUGHT}\n", "The answer is 4."),
    (f"{THOUGHT} still thinking", f"{THOUGHT} still thinking", ""),  # cut off by max_tokens
    (f"{THOUGHT}</thi", f"{THOUGHT}</thi", ""),
    ("</think>The answer is 4.", "", "The answer is 4."),
    (f"{THOUGHT}</think>A </think> B", THOUGHT, "A </think> B"),
]


@pytest.mark.parametrize("text, reasoning, content", QWEN3_OPENED_CASES)
def test_qwen3_after_a_prompt_that_opened_the_thought(text, reasoning, content):
    """The model writes ``thought</think>answer`` with no opening tag: the thought and the
    ``</think>`` tag were the content."""
    new_parser = reasoning_parser_factory(Qwen3ReasoningParser, QWEN3_OPENED)
    expected = ReasoningDelta(reasoning, content)
    assert split_reasoning(new_parser(), text) == expected
    assert_every_split_gives(new_parser, text, expected, _joined)


@pytest.mark.parametrize(
    "name, prompt_tail, opens",
    [
        ("qwen3", QWEN3_OPENED, True),
        ("qwen3", "<think>", True),
        ("qwen3", "<think> \n\t", True),
        ("qwen3", QWEN3_THINKING_OFF, False),
        ("qwen3", "<|im_start|>assistant\n", False),
        ("qwen3", "Say <think> please.<|im_end|>\n<|im_start|>assistant\n", False),
        ("qwen3", "", False),
        ("glm45", "<|assistant|><think>", True),
        ("glm45", "<|assistant|>\n<think></think>", False),
        ("granite", "<|start_of_role|>assistant<|end_of_role|>Here is my thought process:", True),
        ("mistral", "[INST]hi[/INST][THINK]", True),
        ("mistral", "[INST]hi[/INST]", False),
        ("seed_oss", "<seed:bos>assistant\n<seed:think>", True),
        ("openai_gptoss", "<|start|>assistant<think>", False),
    ],
)
def test_the_prompt_opens_the_thought_when_it_ends_with_a_start_marker(name, prompt_tail, opens):
    assert REASONING_PARSERS[name].prompt_opens_reasoning(prompt_tail) is opens


@pytest.mark.parametrize("name", ["qwen3", "glm45", "granite", "mistral"])
def test_families_that_wait_for_the_marker_start_inside_an_opened_thought(name):
    parser_class = REASONING_PARSERS[name]
    start = parser_class.start_tags[0]
    text = f"a thought{parser_class.end_tags[0]}the answer"
    opened = reasoning_parser_factory(parser_class, f"prompt{start}\n")
    assert split_reasoning(opened(), text) == ReasoningDelta("a thought", "the answer")
    assert split_reasoning(opened(), "cut off") == ReasoningDelta("cut off", "")
    # a model that writes the start marker anyway: skipped, as deepseek_r1 does
    assert split_reasoning(opened(), f"{start}{text}") == ReasoningDelta("a thought", "the answer")
    closed = reasoning_parser_factory(parser_class, "prompt")
    assert split_reasoning(closed(), text) == ReasoningDelta("", text)


QWEN35_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
"""Qwen3.5's way: the generation prompt opens the thought unless thinking is off."""
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2+2?"}],
        "max_tokens": 400}  # fmt: skip


def _streamed(stream: str) -> tuple[str, str]:
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    return reasoning, "".join(d.get("content") or "" for d in deltas)


@pytest.mark.parametrize(
    "script, reasoning, content",
    [
        ("2+2 is 4.\n</think>\n\nThe answer is 4.", "2+2 is 4.\n", "The answer is 4."),
        ("2+2 is", "2+2 is", ""),  # cut off inside the thought (max_tokens)
    ],
)
def test_chat_after_a_template_that_opened_the_thought(chat_checkpoint, script, reasoning, content):
    """The prompt ends with ``<think>\\n``, so the model writes no opening tag: its thought
    and the ``</think>`` tag were returned as content. Thinking off renders an empty
    closed thought, and the output stays content."""
    from fake_engine import scripted_chat

    fields = {"reasoning_parser": "qwen3", "chat_template": QWEN35_TEMPLATE}
    message, stream = scripted_chat(chat_checkpoint, script, CHAT, **fields)
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert _streamed(stream) == (reasoning, content)

    off = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    message, stream = scripted_chat(chat_checkpoint, "The answer is 4.", off, **fields)
    assert (message["reasoning_content"], message["content"]) == (None, "The answer is 4.")
    assert _streamed(stream) == ("", "The answer is 4.")
