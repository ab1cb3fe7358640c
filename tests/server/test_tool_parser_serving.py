"""How the server drives the tool and reasoning parsers: call ids in each family's form, the
request's tools handed to the parsers that take them, special tokens kept only where a
parser reads them (and no other special token leaking into the content), vLLM's alias
names, and the CLI help listing the registries.

Model output is scripted: ``ScriptedEngine`` writes ``script`` (special tokens as their own
ids), then EOS, through the real detokenizer.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from fake_engine import ScriptedEngine, fake_context
from server_utils import SPECIAL_TOKENS
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.chat_output import ChatOutputParser
from pagedlm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedlm.entrypoints.openai.structured_request import GrammarCheck, plan_tools
from pagedlm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolParser,
    get_tool_parser,
)

MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
OPENAI_ID = re.compile(r"call_[0-9a-f]{24}")
MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]
"""Mistral's markers, special tokens of the ``special_checkpoint`` tokenizer."""
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
MISTRAL_OUTPUT = (
    '[THINK]Paris: call the tool.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
)


@pytest.fixture(scope="module")
def special_checkpoint(chat_checkpoint, tmp_path_factory):
    """The tiny chat checkpoint with Mistral's markers added as special tokens."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("mistral-markers") / "model"
    shutil.copytree(chat_checkpoint, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(path)
    return path


def _client(engine: ScriptedEngine, **server_flags) -> TestClient:
    return TestClient(build_app(fake_context(engine, **server_flags)))


def _chunks(stream: str) -> list[dict]:
    return [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]


# --- call ids ----------------------------------------------------------------------------


def test_call_ids_take_the_parser_familys_form():
    assert OPENAI_ID.fullmatch(ToolParser.new_call_id())
    assert OPENAI_ID.fullmatch(HermesToolParser.new_call_id())
    ids = {MistralToolParser.new_call_id() for _ in range(200)}
    assert len(ids) == 200 and all(MISTRAL_ID.fullmatch(i) for i in ids)

    parser = ChatOutputParser(tool_parser=MistralToolParser())
    parser.feed('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')
    parser.finish()
    [call] = parser.message()["tool_calls"]
    assert MISTRAL_ID.fullmatch(call["id"])
    # a forced call (tool_choice="required") is named by the server parser's family too
    plan = plan_tools([WEATHER_TOOL], "required", True, "mistral", False, grammar=GrammarCheck())
    assert MISTRAL_ID.fullmatch(plan.new_call_id())
    assert OPENAI_ID.fullmatch(
        plan_tools(
            [WEATHER_TOOL], "required", True, None, False, grammar=GrammarCheck()
        ).new_call_id()
    )


# --- tools reach the parsers ---------------------------------------------------------------

PLAN_TOOL = {
    "type": "function",
    "function": {
        "name": "plan",
        "parameters": {
            "type": "object",
            "properties": {"zip": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
QWEN3_CODER_OUTPUT = (
    "<tool_call>\n<function=plan>\n<parameter=zip>\n123\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_coder_types_values_by_the_requests_tools(chat_checkpoint):
    engine = ScriptedEngine(chat_checkpoint, QWEN3_CODER_OUTPUT)
    body = {"model": "tiny", "messages": ASK, "tools": [PLAN_TOOL], "max_tokens": 400}
    anthropic_tool = {"name": "plan", "input_schema": PLAN_TOOL["function"]["parameters"]}
    with _client(engine, tool_parser="qwen3_coder", enable_auto_tool_choice=True) as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        reply = client.post(
            "/v1/messages",
            json={"model": "tiny", "messages": ASK, "tools": [anthropic_tool], "max_tokens": 400},
        ).json()
    [call] = message["tool_calls"]
    # by its look "123" would be a number: the schema says string
    assert json.loads(call["function"]["arguments"]) == {"zip": "123", "days": 3}
    assert OPENAI_ID.fullmatch(call["id"])
    [tool_use] = [block for block in reply["content"] if block["type"] == "tool_use"]
    assert tool_use["input"] == {"zip": "123", "days": 3}
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", tool_use["id"])  # Anthropic's form


# --- special tokens ----------------------------------------------------------------------


def test_special_tokens_are_kept_only_for_parsers_that_read_them(chat_checkpoint):
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [  # (server flags, request fields, skip_special_tokens the engine gets)
        ({"tool_parser": "mistral"}, {"tools": [WEATHER_TOOL]}, False),
        ({"tool_parser": "internlm"}, {"tools": [WEATHER_TOOL], "tool_choice": "auto"}, False),
        ({"tool_parser": "mistral"}, {"tools": [WEATHER_TOOL], "tool_choice": "none"}, True),
        ({"tool_parser": "mistral"}, {"tools": [WEATHER_TOOL], "tool_choice": named}, True),
        ({"tool_parser": "mistral"}, {}, True),
        ({"tool_parser": "granite"}, {"tools": [WEATHER_TOOL]}, True),
        ({"reasoning_parser": "mistral"}, {}, False),
        ({"reasoning_parser": "mistral"}, {"tools": [WEATHER_TOOL], "tool_choice": named}, True),
        ({"reasoning_parser": "qwen3"}, {}, True),
    ]
    engine = ScriptedEngine(chat_checkpoint, "Hi.")
    for flags, fields, skip in cases:
        ctx = fake_context(engine, enable_auto_tool_choice=True, **flags)
        with TestClient(build_app(ctx)) as client:
            body = {"model": "tiny", "messages": ASK, "max_tokens": 50, **fields}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert engine.params[-1].skip_special_tokens is skip, (flags, fields)
            if "tool_parser" in flags and "tool_choice" not in fields:
                anthropic = {"tools": [{"name": "get_weather", "input_schema": {}}]}
                body = {"model": "tiny", "messages": ASK, "max_tokens": 50}
                body |= anthropic if fields else {}
                assert client.post("/v1/messages", json=body).status_code == 200
                assert engine.params[-1].skip_special_tokens is skip, ("messages", flags, fields)


def test_mistral_markers_as_special_tokens_reach_the_parsers(special_checkpoint):
    engine = ScriptedEngine(special_checkpoint, MISTRAL_OUTPUT)
    assert engine.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") in engine.tokenizer.encode(
        MISTRAL_OUTPUT, add_special_tokens=False
    )
    flags = {"tool_parser": "mistral", "reasoning_parser": "mistral"}
    body = {"model": "tiny", "messages": ASK, "tools": [WEATHER_TOOL], "max_tokens": 400}
    responses_tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    with _client(engine, enable_auto_tool_choice=True, **flags) as client:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        stream = client.post("/v1/chat/completions", json={**body, "stream": True}).text
        response = client.post(
            "/v1/responses", json={"model": "tiny", "input": "Weather?", "tools": [responses_tool]}
        ).json()
        engine.script = MISTRAL_OUTPUT.split("[/THINK]")[1]  # /v1/messages has no thoughts
        anthropic_tool = {"name": "get_weather", "input_schema": {"type": "object"}}
        reply = client.post(
            "/v1/messages",
            json={"model": "tiny", "messages": ASK, "tools": [anthropic_tool], "max_tokens": 400},
        ).json()
        # a request with include_stop_str_in_output asks for the EOS text, and gets it
        engine.script = "Hi."
        with_eos = client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": ASK, "include_stop_str_in_output": True},
        ).json()["choices"][0]["message"]

    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == (
        "Paris: call the tool.",
        "Checking.",
    )
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert MISTRAL_ID.fullmatch(call["id"]) and choice["finish_reason"] == "tool_calls"

    deltas = [c["choices"][0]["delta"] for c in _chunks(stream) if c["choices"]]
    texts = [d.get(key) or "" for d in deltas for key in ("content", "reasoning_content")]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    # the EOS that ended the output (and every marker) stays out of the text
    assert not any(token in text for text in texts for token in SPECIAL_TOKENS + MARKERS)
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(streamed) == 1 and MISTRAL_ID.fullmatch(streamed[0]["id"])

    [function_call] = [item for item in response["output"] if item["type"] == "function_call"]
    assert MISTRAL_ID.fullmatch(function_call["call_id"])

    text, tool_use = reply["content"]
    assert text == {"type": "text", "text": "Checking."}
    assert tool_use["input"] == {"city": "Paris"} and MISTRAL_ID.fullmatch(tool_use["id"])
    assert reply["stop_reason"] == "tool_use"

    assert with_eos["content"] == "Hi.<|im_end|>"


# --- names and help ----------------------------------------------------------------------


def test_vllm_alias_names():
    assert get_tool_parser("llama4_pythonic") is PythonicToolParser
    assert get_tool_parser("llama4_json") is Llama3JsonToolParser


def test_cli_help_lists_the_registries(capsys):
    from pagedlm.entrypoints.cli.main import build_parser

    for name in ("llama4_pythonic", "llama4_json"):
        assert build_parser().parse_args(["serve", "--tool-call-parser", name]).tool_call_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    tool_help = text[text.rindex("--tool-call-parser NAME") :]  # the option's help, not usage
    tool_help = tool_help[: tool_help.index("--enable-auto-tool-choice")]
    assert "llama3_json (llama4_json)" in tool_help
    assert "pythonic (llama4_pythonic)" in tool_help
    listed = set(re.findall(r"\w+", tool_help))
    assert set(TOOL_PARSERS) <= listed
    # an engine argument, as in vLLM (its flag named after the field)
    reasoning_help = text[text.rindex("--reasoning-parser REASONING_PARSER Return") :]
    assert set(REASONING_PARSERS) <= set(re.findall(r"\w+", reasoning_help[:600]))
