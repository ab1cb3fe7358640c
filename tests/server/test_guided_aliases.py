"""vLLM's older ``guided_*`` fields on completions and chat, against the shared tiny-model
server: each constrains the output as its ``structured_outputs`` key does, is reported as
deprecated (``Warning`` header; logged once per field), and cannot be mixed with
``structured_outputs``; ``guided_decoding_backend`` may only name the server's backend."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

CHOICES = ["yes", "no"]
ALIASES = [
    ("guided_choice", CHOICES, lambda text: text in CHOICES),
    ("guided_regex", "[ab]{4}", lambda text: re.fullmatch("[ab]{4}", text) is not None),
    ("guided_json", {"enum": ["up", "down"]}, lambda text: json.loads(text) in ("up", "down")),
    ("guided_grammar", 'root ::= "left" | "right"', lambda text: text in ("left", "right")),
]
MESSAGES = [{"role": "user", "content": "Pick one."}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize(("field", "value", "valid"), ALIASES, ids=[a[0] for a in ALIASES])
def test_alias_constrains_completions_and_chat(client, field, value, valid):
    extra = {field: value}
    completion = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=12, extra_body=extra
    )
    assert valid(completion.choices[0].text), completion.choices[0].text
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, extra_body=extra
    )
    assert valid(chat.choices[0].message.content), chat.choices[0].message.content


def test_alias_is_reported_as_deprecated_and_logged_once(tiny_server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "guided_regex": "[xy]{2}"}
    for _ in range(2):
        response = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert "guided_regex is deprecated" in response.headers["warning"]
        assert re.fullmatch("[xy]{2}", response.json()["choices"][0]["message"]["content"])
    assert tiny_server.log_text().count("'guided_regex' is deprecated") == 1


def test_alias_and_structured_outputs_together_are_a_400(client):
    extra = {"guided_choice": CHOICES, "structured_outputs": {"choice": CHOICES}}
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=extra)


def test_guided_decoding_backend_must_name_the_servers_backend(client):
    extra = {"guided_choice": CHOICES, "guided_decoding_backend": "xgrammar:no-fallback"}
    reply = client.completions.create(model="tiny", prompt="Pick:", max_tokens=4, extra_body=extra)
    assert reply.choices[0].text in CHOICES
    extra["guided_decoding_backend"] = "outlines"
    with pytest.raises(openai.BadRequestError, match="uses 'xgrammar'") as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=extra)
    assert caught.value.body["param"] == "guided_decoding_backend"
