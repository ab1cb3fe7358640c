"""The strict body parser, pydantic error messages, the Warning header and the list caps,
without a server."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.limits import RequestLimits
from pagedlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedlm.entrypoints.openai.request_body import (
    MAX_JSON_DEPTH,
    loads_strict,
    validation_message,
    warning_header,
)
from pagedlm.entrypoints.openai.structured_request import GrammarCheck


def _nested(depth: int) -> bytes:
    return b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"t": NaN}', "NaN is not a JSON value"),
        (b'{"t": -Infinity}', "-Infinity is not a JSON value"),
        (b'{"t": 1e400}', "1e400 is out of range"),
        (b'{"a": 1, "b": {"c": 1, "c": 2}}', "'c' appears more than once"),
        (b'{"s": "\\udc00x"}', "lone UTF-16 surrogate \\udc00"),
        (b'{"\\ud800": 1}', "lone UTF-16 surrogate"),
        (_nested(MAX_JSON_DEPTH + 1), f"deeper than {MAX_JSON_DEPTH} levels"),
        (b"[" * 100_000 + b"]" * 100_000, "deeper than"),
        (b"[1]", "got an array"),
        (b"null", "got null"),
        (b"\xff\xfe{", "not valid JSON"),
        (b'{"n": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ],
)
def test_strict_json_refuses(raw, needle):
    with pytest.raises(APIError) as caught:
        loads_strict(raw)
    assert needle in caught.value.message and caught.value.status == 400


def test_strict_json_accepts_what_the_standard_allows():
    assert loads_strict(_nested(MAX_JSON_DEPTH)) is not None
    body = {"s": "héllo 😀", "f": 1.5e308, "i": 2**64, "n": None, "l": [True, {}]}
    assert loads_strict(json.dumps(body).encode()) == body
    assert loads_strict(json.dumps(body, ensure_ascii=False).encode("utf-8")) == body


def _error(model, body) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return validation_message(caught.value)


def test_validation_messages_name_the_field():
    message, param = _error(CompletionRequest, {"prompt": {"a": 1}})
    assert param == "prompt"
    assert message == "prompt: expected one of: str, list[str], list[int], list[list[int]]"
    message, param = _error(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"text": "x"}]}]}
    )
    # A part without "type" that implies none (vLLM's rule): its place and the fix.
    assert param == "messages.0.content.0"
    assert message.startswith('messages.0.content.0: the part has no "type"')
    assert '{"type": "text", "text": ...}' in message
    assert _error(CompletionRequest, {"prompt": "x", "seed": 2**63})[1] == "seed"
    assert _error(CompletionRequest, {"prompt": "x", "top_p": "nan"})[0].startswith("top_p:")


def test_unknown_and_deprecated_fields_are_noted():
    context: dict = {}
    ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x", "mood": "calm"}],
            "frobnicate": 1,
            "guided_regex": "a+",
            "guided_json": None,
        },
        context=context,
    )
    assert list(context["ignored"]) == ["frobnicate", "messages[].mood"]
    assert list(context["deprecated"]) == ["guided_regex"]  # null means "not sent"


def test_warning_header_is_printable_ascii():
    header = warning_header(['ignored unknown fields: é"\n\x00'])
    assert header.isascii() and header.isprintable()
    assert header == '299 pagedlm "ignored unknown fields: \\u00e9\\"\\n\\u0000"'


def test_list_caps():
    limits = RequestLimits(max_stop_strings=2, max_completion_prompts=2)
    limits.check(CompletionRequest(prompt=[1, 2, 3, 4], stop=["a", "b"]))  # one prompt
    with pytest.raises(APIError, match=r"stop has 3 entries.*--max-stop-strings"):
        limits.check(CompletionRequest(prompt="x", stop=["a", "b", "c"]))
    with pytest.raises(APIError, match=r"prompt has 3 entries.*--max-completion-prompts"):
        limits.check(CompletionRequest(prompt=["a", "b", "c"]))
    with pytest.raises(ValueError, match="--max-tools must be at least 1"):
        RequestLimits(max_tools=0)


def test_logit_bias_is_clamped_as_vllm_and_bad_values_name_the_fix():
    """vLLM clamps a request's biases to [-100, 100] (OpenAI's range) when it builds the
    sampling parameters; ``SamplingParams`` itself takes them as given (vLLM's too)."""
    from pagedlm.sampling_params import SamplingParams

    bias = {"5": 1000, "6": -1e9, "7": 3.5, "8": "-2"}
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for model, fields in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, chat)):
        request = model.model_validate({**fields, "logit_bias": bias})
        params = request.base_sampling_params(max_tokens=4, logprobs=None, grammar=GrammarCheck())
        assert params.logit_bias == {5: 100.0, 6: -100.0, 7: 3.5, 8: -2.0}
    assert SamplingParams(logit_bias={5: 1000.0}).logit_bias == {5: 1000.0}
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(logit_bias={5: float("inf")})

    for value, needle in [
        ({"5": "abc"}, "the bias of token 5 is 'abc'; send a finite number from -100 to 100"),
        ({"5": "Infinity"}, "send a finite number"),
        ({"5": "NaN"}, "send a finite number"),
        ({"5": None}, "send a finite number"),
        ({"5": [1]}, "send a finite number"),
        ([1, 2], 'send an object mapping token ids to biases, e.g. {"50256": -100}'),
    ]:
        with pytest.raises(ValidationError) as error:
            CompletionRequest.model_validate({"prompt": "x", "logit_bias": value})
        message, param = validation_message(error.value)
        assert needle in message and param == "logit_bias", message
    with pytest.raises(APIError, match="NaN is not a JSON value"):
        loads_strict(b'{"prompt": "x", "logit_bias": {"5": NaN}}')
    with pytest.raises(APIError, match="not a token id"):
        CompletionRequest.model_validate(
            {"prompt": "x", "logit_bias": {"abc": 1}}
        ).base_sampling_params(max_tokens=4, logprobs=None, grammar=GrammarCheck())


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_stream_options_without_stream_is_refused_as_vllm(model):
    """vLLM's requests refuse ``stream_options`` unless ``stream`` is true (an empty or
    null ``stream_options`` is not refused, as there)."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    fields = {"prompt": "x"} if model is CompletionRequest else chat
    options = {"include_usage": True}
    for stream in ({}, {"stream": False}):
        message, param = _error(model, {**fields, **stream, "stream_options": options})
        assert param == "stream_options", message
        assert "stream_options can only be sent with stream=true" in message, message
        assert "send stream=true or drop stream_options" in message, message
    assert model.model_validate({**fields, "stream": True, "stream_options": options}).include_usage
    for options in (None, {}):
        model.model_validate({**fields, "stream": False, "stream_options": options})
