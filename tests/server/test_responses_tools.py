"""``/v1/responses`` with function tools, tool results and ``text.format``, through the
unmodified ``openai`` SDK against the shared tiny-model server: the grammar forces the
calls and formats, so their content is checked even though the model is random."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

HOUR = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_time", "description": "Now.", "parameters": HOUR}]
QUESTION = "What time is it?"
FORCED = {"type": "function", "name": "get_time"}


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def prompt_len(chat_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)

    def count(messages: list[dict]) -> int:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return len(ids if isinstance(ids, list) else ids["input_ids"])

    return count


def _ask(client, **kwargs):
    kwargs = {
        "model": "tiny",
        "input": QUESTION,
        "temperature": 0,
        "max_output_tokens": 60,
        **kwargs,
    }
    return client.responses.create(**kwargs)


@pytest.mark.parametrize("tool_choice", [FORCED, "required"])
def test_forced_function_call(client, tool_choice):
    response = _ask(client, tools=TOOLS, tool_choice=tool_choice)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    call = calls[0]
    assert (
        call.name == "get_time" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    )
    jsonschema.validate(json.loads(call.arguments), HOUR)
    assert response.tools[0].name == "get_time"


def test_streamed_function_call_events(client):
    events = list(_ask(client, tools=TOOLS, tool_choice=FORCED, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    (call,) = events[-1].response.output
    assert arguments == events[-3].arguments == call.arguments
    jsonschema.validate(json.loads(arguments), HOUR)


def test_tool_result_round_trip(client, prompt_len):
    first = _ask(client, tools=TOOLS, tool_choice=FORCED)
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"hour": 7}'}
    chained = _ask(client, tools=TOOLS, input=[result], previous_response_id=first.id)
    assert chained.status in ("completed", "incomplete")
    assert chained.output and chained.output[0].type == "message"
    # the same turn sent statelessly: the call item, then its result
    stateless_input = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result,
    ]  # fmt: skip
    stateless = _ask(client, tools=TOOLS, input=stateless_input, store=False)
    # ChatML ignores tool_calls, so the prompt is the question, an empty turn, the result
    expected = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": '{"hour": 7}'},
    ]
    assert chained.usage.input_tokens == stateless.usage.input_tokens == prompt_len(expected)


def test_text_format_json_schema(client):
    when = {"enum": ["morning", "evening"]}  # no room for whitespace a random model would fill
    spec = {"type": "json_schema", "name": "when", "schema": when, "strict": True}
    response = _ask(client, text={"format": spec})
    assert json.loads(response.output_text) in ("morning", "evening")
    assert response.text.format.type == "json_schema"
    events = list(_ask(client, text={"format": spec}, stream=True))
    assert json.loads(events[-1].response.output_text) in ("morning", "evening")
