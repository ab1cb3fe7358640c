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


R1_THINKING_OFF = "<｜User｜>What is 2+2?<｜Assistant｜><think>\n\n</think>\n\n"
"""A DeepSeek-R1-style generation prompt with thinking disabled: an empty, closed thought."""
PREFILL_CLOSED = "<|im_start|>assistant\n<think>\nEasy.\n</think>\n\nThe answer is"
"""A prefill (``continue_final_message``) that ended the thought and began the answer."""
PREFILL_OPEN = "<|im_start|>assistant\n<think>\nLet me see: 2+2"
"""A prefill that opened the thought and goes on inside it."""


@pytest.mark.parametrize(
    "name, prompt_tail, decided",
    [
        ("qwen3", QWEN3_OPENED, "opens"),
        ("qwen3", "<think>", "opens"),
        ("qwen3", "<think> \n\t", "opens"),
        ("qwen3", PREFILL_OPEN, "opens"),
        ("qwen3", QWEN3_THINKING_OFF, "closes"),
        ("qwen3", PREFILL_CLOSED, "closes"),
        ("qwen3", "<think>x</think>\n<think>\n", "opens"),
        ("qwen3", "<|im_start|>assistant\n", None),
        ("qwen3", "", None),
        ("deepseek_r1", R1_THINKING_OFF, "closes"),
        ("deepseek_r1", "<｜Assistant｜><think>\n", "opens"),
        ("deepseek_r1", "<｜Assistant｜>", None),
        ("ernie45", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "closes"),
        ("ernie45", "<|im_start|>assistant\n<think>\n", "opens"),
        ("glm45", "<|assistant|><think>", "opens"),
        ("glm45", "<|assistant|>\n<think></think>", "closes"),
        (
            "granite",
            "<|start_of_role|>assistant<|end_of_role|>Here is my thought process:",
            "opens",
        ),
        ("granite", "Here is my thought process: ok. Here's my response:", "closes"),
        ("mistral", "[INST]hi[/INST][THINK]", "opens"),
        ("mistral", "[INST]hi[/INST][THINK][/THINK]", "closes"),
        ("mistral", "[INST]hi[/INST]", None),
        ("seed_oss", "<seed:bos>assistant\n<seed:think>", "opens"),
        ("seed_oss", "<seed:bos>assistant\n<seed:think></seed:think>", "closes"),
        ("openai_gptoss", "<|start|>assistant<think>", None),
        ("openai_gptoss", "<|start|>assistant<think></think>", None),
    ],
)
def test_the_last_marker_of_the_prompts_turn_decides(name, prompt_tail, decided):
    """The last start or end marker of the prompt's current turn: a start marker opened the
    thought, an end marker closed it; none leaves the family's rule."""
    parser_class = REASONING_PARSERS[name]
    assert parser_class.prompt_opens_reasoning(prompt_tail) is (decided == "opens")
    assert parser_class.prompt_closes_reasoning(prompt_tail) is (decided == "closes")


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


THINK_FAMILIES = ["deepseek_r1", "ernie45", "glm45", "granite", "mistral", "qwen3", "seed_oss"]


def _markers(name: str) -> tuple[str, str]:
    parser_class = REASONING_PARSERS[name]
    marked = getattr(parser_class, "start_tags", None) and parser_class
    marked = marked or DeepSeekR1ReasoningParser  # ernie45 wraps deepseek_r1's markers
    return marked.start_tags[0], marked.end_tags[0]


@pytest.mark.parametrize("name", THINK_FAMILIES)
def test_a_prompt_that_closed_the_thought_leaves_the_answer(name):
    """Thinking disabled by the template (an empty thought, closed) or a prefill that ended
    the thought: the output is the answer, streamed at any split or whole, ``deepseek_r1``'s
    family (starting inside a thought otherwise) included."""
    start, end = _markers(name)
    for prompt in (f"assistant\n{start}\n\n{end}\n\n", f"{start}ok{end}\n\nThe answer:"):
        new_parser = reasoning_parser_factory(REASONING_PARSERS[name], prompt)
        for text in ("The answer is 4.", " 4, since 2+2 is 4."):
            expected = ReasoningDelta("", text)
            assert split_reasoning(new_parser(), text) == expected
            assert_every_split_gives(new_parser, text, expected, _joined)
        # a model that opens a thought anyway has one
        text = f"{start}hmm{end}The answer is 4."
        assert split_reasoning(new_parser(), text) == ReasoningDelta("hmm", "The answer is 4.")


@pytest.mark.parametrize("name", THINK_FAMILIES)
def test_a_grammar_makes_the_output_the_answer_whatever_the_prompt(name):
    """The engine applies a request's grammar from its first token, so the output starts
    after any thought, even where the prompt opened one."""
    start, _ = _markers(name)
    new_parser = reasoning_parser_factory(REASONING_PARSERS[name], f"{start}\n", closed=True)
    assert split_reasoning(new_parser(), '{"a": 1}') == ReasoningDelta("", '{"a": 1}')


def test_the_prompts_current_turn_is_after_its_last_special_token(chat_checkpoint):
    """Markers in earlier messages (a kept thought, a user quoting one) are not the
    template's: only the text after the last role header or end of turn counts."""
    from transformers import AutoTokenizer

    from pagedlm.entrypoints.openai.chat_output import current_turn, reasoning_factory

    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)

    def turn(prompt: str, parser_class=Qwen3ReasoningParser) -> str:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        return current_turn(parser_class, tokenizer, ids)

    history = "<|im_start|>assistant\n<think>\nx\n</think>\n\nParis<|im_end|>\n"
    assert turn(f"{history}<|im_start|>user\nAnd Spain?<|im_end|>\n<|im_start|>assistant\n") == (
        "assistant\n"
    )
    assert turn("<|im_start|>user\nSay <think><|im_end|>\n<|im_start|>assistant\n") == (
        "assistant\n"
    )
    assert turn(PREFILL_CLOSED) == PREFILL_CLOSED.removeprefix("<|im_start|>")
    assert turn("no special token <think>\n") == "no special token <think>\n"
    # a marker that is a special token is no boundary
    tokenizer.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    mistral = REASONING_PARSERS["mistral"]
    assert turn("<|im_start|>assistant\n[THINK]ok", mistral) == "assistant\n[THINK]ok"

    def reasoning_of(prompt: str, text: str, parser_class, constrained=False) -> str:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        new_parser = reasoning_factory(parser_class, tokenizer, ids, constrained)
        assert new_parser is not None
        return split_reasoning(new_parser(), text).reasoning

    r1 = DeepSeekR1ReasoningParser
    kept = f"{history}<|im_start|>user\nAnd Spain?<|im_end|>\n<|im_start|>assistant\n"
    assert reasoning_of(kept, "hmm</think>Madrid", r1) == "hmm"
    assert reasoning_of(R1_THINKING_OFF, "Madrid", r1) == ""
    assert reasoning_of(QWEN3_OPENED, "hmm</think>4", Qwen3ReasoningParser) == "hmm"
    assert reasoning_of(QWEN3_OPENED, "{}", Qwen3ReasoningParser, constrained=True) == ""


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


R1_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>{{ m['content'] }}"
    "{% else %}<|im_end|>{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_end|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
"""DeepSeek-R1's shape on the tiny tokenizer: the thought is left to the model (which starts
inside it) unless thinking is off, when the template renders it empty and closed."""


def _r1_chat(chat_checkpoint, script: str, body: dict) -> tuple[tuple, tuple]:
    from fake_engine import scripted_chat

    fields = {"reasoning_parser": "deepseek_r1", "chat_template": R1_TEMPLATE}
    message, stream = scripted_chat(chat_checkpoint, script, body, **fields)
    return (message["reasoning_content"], message["content"]), _streamed(stream)


def test_deepseek_r1_chat_after_a_prompt_that_closed_the_thought(chat_checkpoint):
    """Thinking disabled (an empty closed thought ends the prompt) and a prefill that ended
    the thought: all of the output is the answer, streamed or not; it was all reasoning."""
    expected = ((None, "The answer is 4."), ("", "The answer is 4."))
    off = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    assert _r1_chat(chat_checkpoint, "The answer is 4.", off) == expected

    prefill = [*CHAT["messages"], {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n"}]
    body = {**CHAT, "messages": prefill, "add_generation_prompt": False,
            "continue_final_message": True}  # fmt: skip
    assert _r1_chat(chat_checkpoint, "The answer is 4.", body) == expected

    # thinking on: the output starts inside the thought, as before
    thought = ("2+2 is 4.", "The answer is 4.")
    assert _r1_chat(chat_checkpoint, "2+2 is 4.</think>The answer is 4.", CHAT) == (
        thought,
        thought,
    )


@pytest.mark.parametrize("reasoning_parser", ["deepseek_r1", "qwen3"])
def test_a_grammar_constrained_chat_is_the_answer(chat_checkpoint, reasoning_parser):
    """response_format constrains the output from its first token (the engine applies the
    grammar to all of it), so no thought can come first: the JSON is the content. With
    deepseek_r1, or a template that opened the thought, it was returned as reasoning."""
    from fake_engine import scripted_chat

    body = {**CHAT, "response_format": {"type": "json_object"}}
    fields = {"reasoning_parser": reasoning_parser, "chat_template": QWEN35_TEMPLATE}
    message, stream = scripted_chat(chat_checkpoint, '{"answer": 4}', body, **fields)
    assert (message["reasoning_content"], message["content"]) == (None, '{"answer": 4}')
    assert _streamed(stream) == ("", '{"answer": 4}')

    # a structural tag constrains only what follows its triggers: a thought may come first
    tag = {"type": "structural_tag", "triggers": ["<f>"],
           "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]}  # fmt: skip
    body = {**CHAT, "response_format": tag}
    message, stream = scripted_chat(chat_checkpoint, "hmm</think>ok", body, **fields)
    assert (message["reasoning_content"], message["content"]) == ("hmm", "ok")
