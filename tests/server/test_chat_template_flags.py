"""vLLM's ``--default-chat-template-kwargs`` and ``--chat-template-content-format``: the
flags of ``serve`` and ``run-batch``, refused at start-up when bad; every route that
renders a chat template (chat, ``/tokenize``, Anthropic messages, a request's own
template) taking the default kwargs under the request's; and message content handed to
the template as a string or OpenAI's parts, "auto" reading which from the template."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine, fake_context
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from pagedlm.chat_content import detect_content_format, format_conversation
from pagedlm.entrypoints.cli.main import build_parser, main, parse_args
from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.server_args import check_serving_args

KWARGS_TEMPLATE = (
    "{{ a | default('-') }} {{ b | default('-') }}|"
    "{% for m in messages %}{{ m['content'] }};{% endfor %}"
)
"""Prints two kwargs (``-`` when unset) and each message's content as it arrives."""
PARTS_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}P:{{ part['text'] }},{% endfor %}{% endif %};"
    "{% endfor %}"
)
"""Loops over a message's content when it is a list: "auto" detects 'openai'."""
STRING_TEMPLATE = "{% for m in messages %}{{ m['content'] }};{% endfor %}"
TWO_PARTS = [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "user", "content": TWO_PARTS}]


def _client(checkpoint, **context) -> tuple[FakeEngine, TestClient]:
    engine = FakeEngine(checkpoint)
    return engine, TestClient(build_app(fake_context(engine, **context)))


def _chat_prompt(engine, client, **body) -> str:
    body = {"model": "tiny", "max_tokens": 1, "return_token_ids": True, **body}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return engine.tokenizer.decode(answer.json()["prompt_token_ids"])


def _tokenized(engine, client, messages) -> str:
    answer = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert answer.status_code == 200, answer.text
    return engine.tokenizer.decode(answer.json()["tokens"])


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (STRING_TEMPLATE, "string"),
        (PARTS_TEMPLATE, "openai"),
        # through a name set from messages (sliced, filtered) and an attribute
        (
            "{% set rest = messages[1:] | list %}{% for m in rest %}{% for p in m.content %}"
            "{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for p in m.content | selectattr('type') %}{% break %}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        # a loop over something else's content, a generation block, a syntax error
        ("{% for p in tools[0].content %}{{ p }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
            "string",
        ),
        ("{% for m in messages %}", "string"),
    ],
)
def test_auto_reads_the_format_from_the_template(template, expected):
    assert detect_content_format(template) == expected


def test_formatting_content_as_a_string_or_parts():
    conversation = [
        {"role": "user", "content": TWO_PARTS},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": TWO_PARTS},
    ]
    as_strings = format_conversation(conversation, "string")
    assert [m["content"] for m in as_strings] == ["x\ny", "", "x\ny"]
    as_parts = format_conversation([{"role": "user", "content": "hi"}, *conversation], "openai")
    assert as_parts[0]["content"] == [{"type": "text", "text": "hi"}]
    assert as_parts[1]["content"] == TWO_PARTS and as_parts[2]["content"] == []
    assert as_parts[3]["content"] == "x\ny"  # tool results stay text, as vLLM's
    assert conversation[0]["content"] is TWO_PARTS  # the caller's messages are untouched
    with pytest.raises(ValueError, match=r"messages\.0\.content\.0: a part of type 'image'"):
        format_conversation([{"role": "user", "content": [{"type": "image"}]}], "string")


def test_default_kwargs_reach_every_route_and_requests_override_them(chat_checkpoint):
    defaults = {"a": "A", "b": "B"}
    engine, client = _client(
        chat_checkpoint, chat_template=KWARGS_TEMPLATE, default_chat_template_kwargs=defaults
    )
    plain = [{"role": "user", "content": "hi"}]
    with client:
        assert _chat_prompt(engine, client, messages=plain) == "A B|hi;"
        overridden = _chat_prompt(
            engine, client, messages=plain, chat_template_kwargs={"b": "mine"}
        )
        assert overridden == "A mine|hi;"  # key by key
        assert _tokenized(engine, client, plain) == "A B|hi;"
        counted = client.post(
            "/v1/messages/count_tokens", json={"model": "tiny", "messages": plain}
        ).json()
        assert counted["input_tokens"] == len("A B|hi;")  # a token per byte
    engine, client = _client(chat_checkpoint, chat_template=KWARGS_TEMPLATE)
    with client:
        assert _chat_prompt(engine, client, messages=plain) == "- -|hi;"


def test_a_request_template_gets_the_defaults_and_its_own_format(chat_checkpoint):
    engine, client = _client(
        chat_checkpoint,
        trust_request_chat_template=True,
        default_chat_template_kwargs={"a": "A"},
    )
    with client:
        rendered = _chat_prompt(engine, client, messages=MESSAGES, chat_template=KWARGS_TEMPLATE)
        assert rendered == "A -|hi;x\ny;"
        parts = _chat_prompt(engine, client, messages=MESSAGES, chat_template=PARTS_TEMPLATE)
        assert parts == "P:hi,;P:x,P:y,;"


@pytest.mark.parametrize(
    ("content_format", "template", "expected"),
    [
        ("auto", STRING_TEMPLATE, "hi;x\ny;"),  # what the server always did
        ("auto", PARTS_TEMPLATE, "P:hi,;P:x,P:y,;"),
        ("string", PARTS_TEMPLATE, "S:hi;S:x\ny;"),
        ("openai", PARTS_TEMPLATE, "P:hi,;P:x,P:y,;"),
    ],
)
def test_content_format_chooses_what_the_template_gets(
    chat_checkpoint, content_format, template, expected
):
    engine, client = _client(
        chat_checkpoint, chat_template=template, chat_template_content_format=content_format
    )
    with client:
        assert _chat_prompt(engine, client, messages=MESSAGES) == expected
        assert _tokenized(engine, client, MESSAGES) == expected


def test_openai_format_hands_a_string_template_the_parts(chat_checkpoint):
    engine, client = _client(
        chat_checkpoint, chat_template=STRING_TEMPLATE, chat_template_content_format="openai"
    )
    with client:
        rendered = _chat_prompt(engine, client, messages=[{"role": "user", "content": "hi"}])
    assert rendered == "[{'type': 'text', 'text': 'hi'}];"


@pytest.mark.parametrize("command", ["serve", "run-batch"])
def test_the_flags_parse_for_serve_and_run_batch(command):
    files = ["-i", "in.jsonl", "-o", "out.jsonl"] if command == "run-batch" else []
    parser = build_parser()
    defaults = parser.parse_args([command, *files])
    assert defaults.default_chat_template_kwargs is None
    assert defaults.chat_template_content_format == "auto"
    args = parser.parse_args(
        [command, *files, "--default-chat-template-kwargs", '{"enable_thinking": false}',
         "--chat-template-content-format", "openai"]
    )  # fmt: skip
    assert args.chat_template_content_format == "openai"
    check_serving_args(args)  # accepted
    with pytest.raises(SystemExit):
        parser.parse_args([command, *files, "--chat-template-content-format", "list"])


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("{enable_thinking: false}", "is not JSON"),
        ('["enable_thinking"]', "takes a JSON object"),
        (
            '{"tools": [], "add_generation_prompt": false, "x": 1}',
            "may not set ['add_generation_prompt', 'tools']",
        ),
    ],
)
def test_bad_default_kwargs_exit_at_start_up_naming_the_flag(value, why, tmp_path):
    args = build_parser().parse_args(["serve", "--default-chat-template-kwargs", value])
    with pytest.raises(SystemExit, match="--default-chat-template-kwargs") as caught:
        check_serving_args(args)
    assert why in str(caught.value)
    # run-batch exits before it reads its input or loads a model
    with pytest.raises(SystemExit, match="--default-chat-template-kwargs"):
        main(["run-batch", "-i", str(tmp_path / "none"), "-o", "-", "x",
              "--default-chat-template-kwargs", value])  # fmt: skip


def test_a_config_file_mapping_is_checked_too(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("default-chat-template-kwargs:\n  documents: []\n")
    args = parse_args(["serve", "--config", str(config)])
    with pytest.raises(SystemExit, match=r"may not set \['documents'\]"):
        check_serving_args(args)


def test_run_batch_renders_with_both_flags(chat_checkpoint, tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    source.write_text(json.dumps(line) + "\n")
    argv = ["run-batch", "-i", str(source), "-o", str(target), str(chat_checkpoint),
            "--served-model-name", "tiny", "--num-kv-blocks", "64", "--max-model-len", "256",
            "--chat-template", KWARGS_TEMPLATE, "--default-chat-template-kwargs", '{"b": "B"}',
            "--chat-template-content-format", "openai"]  # fmt: skip
    assert main(argv) == 0
    (result,) = [json.loads(line) for line in target.read_text().splitlines()]
    assert result["response"]["status_code"] == 200, result
    ids = result["response"]["body"]["prompt_token_ids"]
    rendered = AutoTokenizer.from_pretrained(chat_checkpoint).decode(ids)
    assert rendered.startswith("- B|[{'type': 'text', 'text': 'hi'}];")
