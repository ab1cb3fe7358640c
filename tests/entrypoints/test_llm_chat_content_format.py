"""``LLM.chat(chat_template_content_format=...)`` (vLLM's): message content handed to the
template as a string, as OpenAI's parts, or ("auto") as the template reads it."""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams

PARTS_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}P:{{ part['text'] }},{% endfor %}{% endif %};"
    "{% endfor %}"
)
STRING_TEMPLATE = "{% for m in messages %}{{ m['content'] }};{% endfor %}"
MESSAGES = [
    {"role": "user", "content": "hi"},
    {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
]


@pytest.fixture(scope="module")
def llm(chat_checkpoint):
    llm = LLM(str(chat_checkpoint), num_kv_blocks=64, block_size=16, max_model_len=128)
    yield llm
    llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("content_format", "template", "expected"),
    [
        ("auto", STRING_TEMPLATE, "hi;x\ny;"),
        ("auto", PARTS_TEMPLATE, "P:hi,;P:x,P:y,;"),
        ("string", PARTS_TEMPLATE, "S:hi;S:x\ny;"),
        ("openai", PARTS_TEMPLATE, "P:hi,;P:x,P:y,;"),
    ],
)
def test_chat_content_format(llm, content_format, template, expected):
    (out,) = llm.chat(
        MESSAGES,
        SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False,
        chat_template=template,
        add_generation_prompt=False,
        chat_template_content_format=content_format,
    )
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected


def test_an_unknown_content_format_is_refused(llm):
    with pytest.raises(ValueError, match="chat_template_content_format='list' is not one of"):
        llm.chat(MESSAGES, use_tqdm=False, chat_template_content_format="list")


@pytest.mark.parametrize(
    ("messages", "kwargs", "match"),
    [
        ("hi", {}, "messages must be a conversation"),
        (["hi", "there"], {}, r"messages\[0\] must be a list of message dicts"),
        ([{"content": "hi"}], {}, "message 0 of conversation 0 must be a dict with a 'role'"),
        ([{"role": "user", "content": 5}], {}, "content must be a string or a list"),
        ([[{"role": "user", "content": "a"}], [5]], {}, "message 0 of conversation 1"),
        (MESSAGES[:1], {"chat_template_kwargs": "x"}, "chat_template_kwargs must be a dict"),
    ],
)
def test_malformed_chats_name_the_message(llm, messages, kwargs, match):
    with pytest.raises(TypeError, match=match):
        llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)
    (out,) = llm.chat(MESSAGES[:1], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_text_kinds_and_parts_without_a_type(llm, content_format):
    """vLLM's text kinds are text in either format ("string" refused them as parts that
    cannot be joined); a part without "type" whose keys imply none, or a part that is not
    a string or a dict, is refused naming it, as vLLM refuses it ("openai" handed it to
    the template as it was)."""
    messages = [
        {"role": "user", "content": ["a", {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "c"}]},
    ]
    params = SamplingParams(temperature=0, max_tokens=1)
    kwargs = {
        "chat_template": PARTS_TEMPLATE,
        "add_generation_prompt": False,
        "chat_template_content_format": content_format,
        "use_tqdm": False,
    }
    (out,) = llm.chat(messages, params, **kwargs)
    expected = "S:a\nb;S:c;" if content_format == "string" else "P:a,P:b,;P:c,;"
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    for part, match in (
        ({"text": "hi"}, r'^messages\.0\.content\.1: the part has no "type"'),
        (None, r"^messages\.0\.content\.1: a content part is a string or a dict"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.chat([{"role": "user", "content": ["a", part]}], params, **kwargs)


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_null_text_parts_are_skipped_and_tool_references_kept(llm, content_format):
    """vLLM skips a "text"/"refusal" part whose text is null ("string" refused it as a
    part that cannot be joined, "openai" handed it on with its null) and hands a
    tool_reference part on ("string": its name among the text)."""
    template = (
        "{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}P:{{ p['text'] }}{{ p['name'] }},{% endfor %}"
        "{% endif %};{% endfor %}"
    )
    content = [
        {"type": "text", "text": None},
        "a",
        {"type": "refusal"},
        {"type": "tool_reference", "name": "get_weather"},
    ]
    (out,) = llm.chat(
        [{"role": "user", "content": content}],
        SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False,
        chat_template=template,
        add_generation_prompt=False,
        chat_template_content_format=content_format,
    )
    expected = "S:a\nget_weather;" if content_format == "string" else "P:a,P:get_weather,;"
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    with pytest.raises(ValueError, match=r'content\.0: a "tool_reference" part needs "name"'):
        llm.chat(
            [{"role": "user", "content": [{"type": "tool_reference"}]}],
            use_tqdm=False,
            chat_template_content_format=content_format,
        )


def test_continuing_a_last_message_without_text_names_the_fix(llm):
    """transformers' "could not find any text to continue" named no fix; "string" content
    continues the empty string, as in vLLM."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}]
    kwargs = {"add_generation_prompt": False, "continue_final_message": True, "use_tqdm": False}
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match=r"^messages\.1\.content: continue_final_message"):
        llm.chat(messages, params, chat_template=PARTS_TEMPLATE, **kwargs)
    (out,) = llm.chat(
        messages,
        params,
        chat_template=STRING_TEMPLATE,
        chat_template_content_format="string",
        **kwargs,
    )
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "hi;"
