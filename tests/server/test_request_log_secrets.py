"""``--enable-log-requests`` logs what vLLM's request logger logs of a prompt (its text,
token ids, embeddings' shape), never its ``cache_salt`` (a secret against prefix-cache
probing), nor the API key the client presented."""

from __future__ import annotations

import logging

import torch
from fake_engine import FakeEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.request_log import log_received

SALT = "SECRET-SALT-e3b0c44298fc1c149afbf4c8996fb924"
API_KEY = "sk-SECRET-KEY-4b7a"


def test_the_request_log_has_the_prompt_but_not_the_salt_or_key(chat_checkpoint, caplog):
    ctx = fake_context(FakeEngine(chat_checkpoint), log_requests=True)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    messages = [{"role": "user", "content": "hi chat"}]
    bodies = {
        "/v1/completions": {"prompt": "hello there", "stream": False},
        "/v1/chat/completions": {"messages": messages, "stream": True},
        "/v1/responses": {"input": "hi responses", "max_output_tokens": 2},
    }
    level = caplog.at_level(logging.INFO, logger="pagedlm.server")
    with level, TestClient(build_app(ctx, api_key=API_KEY)) as client:
        for path, body in bodies.items():
            body = {"model": "tiny", "max_tokens": 2, **body, "cache_salt": SALT}
            if path == "/v1/responses":
                del body["max_tokens"]
            assert client.post(path, json=body, headers=headers).status_code == 200, path
    received = [r.getMessage() for r in caplog.records if "Received request" in r.getMessage()]
    assert len(received) == 3, received
    assert "prompt 'hello there', params" in received[0]  # as if unsalted
    assert SALT not in caplog.text and "cache_salt" not in caplog.text
    assert API_KEY not in caplog.text


def test_other_prompt_forms_lose_only_the_salt(caplog):
    pair = {"text_1": "query", "text_2": "document", "cache_salt": SALT}
    tokens = {"prompt_token_ids": [5, 6, 7], "cache_salt": SALT}
    embeds = {"prompt_embeds": torch.zeros(3, 8), "cache_salt": SALT}
    with caplog.at_level(logging.INFO, logger="pagedlm.server"):
        for prompt in (pair, tokens, embeds):
            log_received("r", prompt, None, 1000)
    lines = [r.getMessage() for r in caplog.records]
    assert "{'text_1': 'query', 'text_2': 'document'}" in lines[0]
    assert "{'prompt_token_ids': [5, 6, 7]}" in lines[1]
    assert "'<embeddings of shape [3, 8]>'" in lines[2]
    assert SALT not in caplog.text


class _NeverWhole(list):
    """A prompt's ids that fail if formatted whole (a slice is a plain list)."""

    def __repr__(self) -> str:
        raise AssertionError("formatted the whole list")


def test_a_huge_prompt_is_cut_before_it_is_formatted(caplog):
    from pagedlm.entrypoints.openai.request_log import shown

    ids = _NeverWhole(range(2_000_000))
    text = "word " * 400_000
    prompt = {"prompt": text, "prompt_token_ids": ids}
    with caplog.at_level(logging.INFO, logger="pagedlm.server"):
        log_received("cmpl-huge", prompt, None, 40)
    line = caplog.records[-1].getMessage()
    assert line.startswith("Received request cmpl-huge: prompt {'prompt': 'word word")
    assert len(line) < 150
    # The first max_len characters are the whole repr's.
    for value in ([*range(500)], "x" * 500, {"a": [1] * 300, "b": "y" * 300}, (3,) * 100):
        assert shown(value, 40) == repr(value)[:40] + "..."
    assert shown([1, 2], 40) == "[1, 2]"
