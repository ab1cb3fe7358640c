"""The OpenAI-compatible endpoints, spoken to with the unmodified ``openai`` SDK."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import EOS_ID


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


def _token_id(tiny_server, text: str) -> int:
    ids = _token_ids(tiny_server, text)
    assert len(ids) == 1, ids
    return ids[0]


def test_completion_basic(client):
    result = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5)
    assert result.object == "text_completion"
    assert len(result.choices) == 1
    choice = result.choices[0]
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(b"Hello world")
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5
    assert result.model == "tiny"


def _token_ids(tiny_server, text: str) -> list[int]:
    response = httpx.post(
        f"{tiny_server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}
    )
    return response.json()["tokens"]


def test_completion_prompt_forms_and_n(client, tiny_server):
    result = client.completions.create(
        model="tiny", prompt=["ab", "cde"], max_tokens=3, n=2, seed=1, temperature=1.0
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == 2 + 3
    assert result.usage.completion_tokens == 4 * 3
    by_ids = client.completions.create(
        model="tiny", prompt=_token_ids(tiny_server, "ab"), max_tokens=3, temperature=0
    )
    by_text = client.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(
        model="tiny",
        prompt=[_token_ids(tiny_server, "ab"), _token_ids(tiny_server, "cde")],
        max_tokens=2,
        temperature=0,
    )
    assert len(many.choices) == 2
    assert many.usage.prompt_tokens == 5


def test_echo_logprobs(client):
    prompt = "The cat"
    result = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    choice = result.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens[: len(prompt)]) == prompt
    # The top candidate of a greedy sample is the sample itself.
    for token, top in zip(logprobs.tokens[len(prompt) :], logprobs.top_logprobs[len(prompt) :]):
        assert 1 <= len(top) <= 3
        assert max(top, key=top.get) == token or "\ufffd" in token


def test_max_tokens_zero_with_echo_scores_the_prompt(client):
    result = client.completions.create(
        model="tiny", prompt="scoring", max_tokens=0, echo=True, logprobs=1
    )
    choice = result.choices[0]
    assert choice.text == "scoring"
    assert len(choice.logprobs.tokens) == len("scoring")
    assert result.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)


def test_stop_and_seed(client):
    free = client.completions.create(model="tiny", prompt="Once", max_tokens=12, temperature=0)
    text = free.choices[0].text
    start = next(
        i
        for i in range(1, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].strip() == text[i : i + 2]
    )
    stop = text[start : start + 2]
    stopped = client.completions.create(
        model="tiny", prompt="Once", max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    seeded = [
        client.completions.create(
            model="tiny", prompt="seed", max_tokens=8, temperature=1.0, seed=42
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_streaming_matches_non_streaming(client, tiny_server):
    # Only the two bytes of "é" (C3 A9) can be sampled, so the stream must hold back the
    # first byte of each "é" until the second arrives.
    bias = {str(token_id): 100.0 for token_id in _token_ids(tiny_server, "é")}
    kwargs = dict(model="tiny", prompt="héllo", max_tokens=24, temperature=1.0, seed=7)
    whole = client.completions.create(**kwargs, extra_body={"logit_bias": bias})
    chunks = list(
        client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"logit_bias": bias},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "é" in whole.choices[0].text, whole.choices[0].text
    assert "".join(texts) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}


def test_vllm_extras(client, tiny_server):
    a = _token_id(tiny_server, "A")
    biased = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=6,
        temperature=1.0,
        extra_body={"logit_bias": {str(a): 1000}, "top_k": 5, "min_p": 0.01},
    )
    assert biased.choices[0].text == "A" * 6  # bias clamped to +100, still dominant
    stopped = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=6,
        extra_body={"logit_bias": {str(a): 100}, "stop_token_ids": [a]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == ""
    assert stopped.choices[0].stop_reason == a
    extras = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=4,
        extra_body={
            "ignore_eos": True,
            "min_tokens": 4,
            "repetition_penalty": 1.2,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "prompt_logprobs": 1,
            "cache_salt": "tenant-a",
            "priority": 0,
        },
    )
    assert extras.usage.completion_tokens == 4
    prompt_logprobs = extras.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == 1
    scored = client.completions.create(
        model="tiny", prompt="abc", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 2}
    )
    first = next(iter(scored)).choices[0].model_extra["prompt_logprobs"]
    assert len(first) == 3 and first[0] is None
    assert all(len(position) in (2, 3) for position in first[1:])
    assert all(entry["logprob"] <= 0 for position in first[1:] for entry in position.values())


def test_chat(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
    ]
    result = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=4, logprobs=True, top_logprobs=3
    )
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert result.usage.completion_tokens == len(choice.logprobs.content) == 4
    assert all(len(item.top_logprobs) == 3 for item in choice.logprobs.content)
    assert result.usage.prompt_tokens > len("Be brief.Hi!")
    several = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, n=3, extra_body={"prompt_logprobs": 0}
    )
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert len(several.model_extra["prompt_logprobs"]) == several.usage.prompt_tokens
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        stream=True,
        seed=3,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=3)
    assert text == whole.choices[0].message.content


def test_chat_continue_final_message(client, tiny_server):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]
    rendered = httpx.post(
        f"{tiny_server.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    continued = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    # Continuing leaves the final message open: no <|im_end|> after "Sure".
    assert continued.usage.prompt_tokens == rendered["count"] - 2
    with pytest.raises(openai.BadRequestError, match="tokenize"):
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"tokenize": True}},
        )


def test_sdk_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="tiny", prompt="x", suffix="y")
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="x", logprobs=21)
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model="tiny", prompt="x", n=1000)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt="x", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="tiny", prompt=[10_000], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="priority scheduling is not enabled") as bad:
        client.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"priority": 1}
        )
    assert bad.value.param == "priority"  # vLLM's "Got priority 1 but ..." names the field


@pytest.mark.parametrize(
    ("content", "headers", "needle"),
    [
        (b"{not json", {"content-type": "application/json"}, "not valid JSON"),
        (b"[1, 2]", {"content-type": "application/json"}, "JSON object"),
        (b'{"prompt": "x"}', {"content-type": "text/plain"}, "Content-Type"),
        (b'{"model": "tiny"}', {"content-type": "application/json"}, "prompt"),
    ],
)
def test_malformed_requests(tiny_server, content, headers, needle):
    response = httpx.post(f"{tiny_server.url}/v1/completions", content=content, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"]
    assert error["code"] == 400


@pytest.mark.parametrize(
    "content_type", [None, "application/json; charset=utf-8", "application/vnd.api+json"]
)
def test_json_bodies_without_application_json(tiny_server, content_type):
    """Read as JSON, as FastAPI (so vLLM) reads them: ``requests.post(url, data=...)``
    sends no Content-Type at all."""
    headers = {} if content_type is None else {"content-type": content_type}
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
    response = httpx.post(f"{tiny_server.url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 200, response.text


def test_unknown_route_and_method(tiny_server):
    missing = httpx.get(f"{tiny_server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = httpx.get(f"{tiny_server.url}/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
    anthropic_style = httpx.get(f"{tiny_server.url}/v1/messages")
    assert anthropic_style.json()["type"] == "error"


def test_info_endpoints(client, tiny_server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    url = tiny_server.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] == EOS_ID
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["count"] == len("héllo".encode())
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "héllo"
