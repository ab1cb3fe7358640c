"""Chat with a grammar and a ``--reasoning-parser``: the engine applies the grammar after the
model's thought, so the thought is ``reasoning_content`` and the grammar's answer is
``content``, whole and streamed, on /v1/chat/completions, /v1/responses and Anthropic's
/v1/messages. Over a real ``AsyncLLM`` and a tiny llama whose next token is scripted
(``structured_output/thinking_model.py``), and over scripted outputs for the routes alone."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server.server_utils import in_process_app
from structured_output.thinking_model import write_scripted_checkpoint

SCRIPT = {
    # the generation prompt ends with <think>: the model thinks x y, ends the thought,
    # and would answer q; the grammar (an integer) makes it 5 6 7
    "<think>": ["x"],
    "x": ["y"],
    "y": ["</think>"],
    "</think>": ["q", "5"],
    "5": ["q", "6"],
    "6": ["q", "7"],
    "7": ["q", "EOS"],
    "q": ["EOS"],
}
OPENED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n<think>"
)
"""Qwen3.5's generation prompt: the thought is opened for the model."""
INTEGER = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Pick a number."}],
    "max_tokens": 20,
    "temperature": 0,
    "response_format": INTEGER,
}


def _streamed(lines: list[str]) -> tuple[str, str]:
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    return reasoning, "".join(d.get("content") or "" for d in deltas)


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory):
    return write_scripted_checkpoint(tmp_path_factory.mktemp("thinking-chat"), SCRIPT)


@pytest.fixture(scope="module")
def answers(scripted_model):
    engine, app = in_process_app(
        scripted_model,
        num_kv_blocks=32,
        max_model_len=128,
        structured_outputs_config={"reasoning_parser": "qwen3"},
        reasoning_parser="qwen3",
        chat_template=OPENED,
    )

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            chat = (await http.post("/v1/chat/completions", json=CHAT)).json()
            body = {**CHAT, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                stream = [line async for line in response.aiter_lines()]
            responses = await http.post(
                "/v1/responses",
                json={"model": "tiny", "input": "Pick a number.", "max_output_tokens": 20,
                      "temperature": 0,
                      "text": {"format": {"type": "json_schema", "name": "n",
                                          "schema": {"type": "integer"}}}},
            )  # fmt: skip
            return chat, stream, responses.json()

    try:
        yield asyncio.run(main())
    finally:
        engine.shutdown()


@pytest.mark.slow  # an engine-core process: about 10 s to start on a loaded CPU
def test_chat_thinks_then_answers_in_the_grammar(answers):
    chat, stream, _ = answers
    message = chat["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("xy", "567")
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}  # x y
    assert _streamed(stream) == ("xy", "567")


@pytest.mark.slow
def test_responses_thinks_then_answers_in_the_grammar(answers):
    *_, response = answers
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "message"], response
    assert response["output"][0]["content"][0]["text"] == "xy"
    assert response["output"][1]["content"][0]["text"] == "567"


@pytest.mark.parametrize(
    ("flags", "parser"),
    [
        (["--reasoning-parser", "qwen3"], "qwen3"),
        (["--structured-outputs-config.reasoning_parser", "deepseek_r1"], "deepseek_r1"),
        ([], None),
    ],
)
def test_the_servers_reasoning_parser_is_the_engines(scripted_model, flags, parser):
    """``--reasoning-parser`` is vLLM's ``structured_outputs_config.reasoning_parser``: one
    flag sets the chat routes' parser and the engine's markers, and the routes learn that
    grammars wait for the thought."""
    from types import SimpleNamespace

    from pagedlm.engine.cli_args import engine_args_from_cli
    from pagedlm.entrypoints.cli.main import parse_args
    from pagedlm.entrypoints.openai.api_server import serving_context
    from pagedlm.entrypoints.openai.server_args import check_serving_args

    args = parse_args(["serve", str(scripted_model), "--num-kv-blocks", "8", *flags])
    limits = check_serving_args(args)
    assert args.reasoning_parser == (parser or "")  # vLLM's default: ""
    config, _ = engine_args_from_cli(args).create_engine_config()
    markers = config.structured_outputs_reasoning
    assert (markers and markers.reasoning_parser) == parser
    engine = SimpleNamespace(config=config, get_tokenizer=lambda: None)
    ctx = serving_context(args, engine, ["tiny"], limits, None)
    assert (ctx.reasoning_parser, ctx.structured_outputs_after_reasoning) == (parser, bool(parser))

    args = parse_args(["serve", str(scripted_model), "--reasoning-parser", "qwen3",
                       "--structured-outputs-config.reasoning_parser", "deepseek_r1"])  # fmt: skip
    with pytest.raises(SystemExit, match="name two; pass one"):
        check_serving_args(args)


# -- the routes alone, over scripted outputs --------------------------------------------

QWEN35_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("after_thought", [True, False])
@pytest.mark.parametrize("reasoning_parser", ["deepseek_r1", "qwen3"])
def test_a_constrained_chat_splits_as_the_engine_applies_its_grammar(
    chat_checkpoint, reasoning_parser, after_thought
):
    """Where the engine applies grammars after the thought, a constrained output is a
    thought and then the answer; where it applies them from the first token, all of it is
    the answer (709c1db). A forced tool call keeps its reasoning parser likewise."""
    from fake_engine import scripted_chat

    fields = {"reasoning_parser": reasoning_parser, "chat_template": QWEN35_TEMPLATE,
              "structured_outputs_after_reasoning": after_thought}  # fmt: skip
    body = {**CHAT, "response_format": {"type": "json_object"}}
    script = 'hmm</think>{"answer": 4}' if after_thought else '{"answer": 4}'
    message, stream = scripted_chat(chat_checkpoint, script, body, **fields)
    split = ("hmm", '{"answer": 4}') if after_thought else (None, '{"answer": 4}')
    assert (message["reasoning_content"], message["content"]) == split
    assert _streamed(stream.splitlines()) == (split[0] or "", split[1])

    body = {**CHAT, "tools": [TOOL], "tool_choice": "required"}
    body.pop("response_format")
    call = '[{"name": "pick", "parameters": {"n": 4}}]'
    script = f"hmm</think>{call}" if after_thought else call
    message, _ = scripted_chat(chat_checkpoint, script, body, **fields)
    assert message.get("reasoning_content") == ("hmm" if after_thought else None)
    [tool_call] = message["tool_calls"]
    assert tool_call["function"] == {"name": "pick", "arguments": '{"n": 4}'}


@pytest.mark.parametrize("after_thought", [True, False])
def test_a_forced_tool_use_on_messages_splits_as_the_engine_applies_its_grammar(
    chat_checkpoint, after_thought
):
    """Anthropic's ``tool_choice`` "any": a thinking block, then the tool_use block, where the
    engine applies the call's grammar after the thought."""
    from fake_engine import ScriptedEngine, fake_context
    from starlette.testclient import TestClient

    from pagedlm.entrypoints.openai.app import build_app

    call = '[{"name": "pick", "parameters": {"n": 4}}]'
    script = f"hmm</think>{call}" if after_thought else call
    fields = {"reasoning_parser": "qwen3", "chat_template": QWEN35_TEMPLATE,
              "structured_outputs_after_reasoning": after_thought}  # fmt: skip
    ctx = fake_context(ScriptedEngine(chat_checkpoint, script), **fields)
    body = {"model": "tiny", "max_tokens": 60, "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "Pick a number."}],
            "tools": [{"name": "pick", "input_schema": {"type": "object"}}]}  # fmt: skip
    with TestClient(build_app(ctx)) as client:
        content = client.post("/v1/messages", json=body).json()["content"]
    blocks = [(block["type"], block.get("thinking") or block.get("input")) for block in content]
    expected = [("tool_use", {"n": 4})]
    assert blocks == ([("thinking", "hmm"), *expected] if after_thought else expected)
