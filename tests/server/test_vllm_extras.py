"""Small request fields and flags of vLLM's server over ``FakeEngine``: ``/tokenize``'s
``return_token_strs``, chat's ``reasoning_effort`` handed to the chat template, and
``--enable-force-include-usage``."""

from __future__ import annotations

from fake_engine import FakeEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app

TEMPLATE = "{{ reasoning_effort or 'none' }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_tokenize_returns_the_token_strings(chat_checkpoint):
    engine = FakeEngine(chat_checkpoint)
    with TestClient(build_app(fake_context(engine))) as client:
        answer = client.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True})
        plain = client.post("/tokenize", json={"prompt": "héllo"}).json()
    body = answer.json()
    assert body["token_strs"] == engine.tokenizer.convert_ids_to_tokens(body["tokens"])
    assert len(body["token_strs"]) == body["count"] and "token_strs" not in plain


def test_reasoning_effort_reaches_the_chat_template(chat_checkpoint):
    engine = FakeEngine(chat_checkpoint)
    ctx = fake_context(engine, chat_template=TEMPLATE)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "return_token_ids": True}  # fmt: skip
    with TestClient(build_app(ctx)) as client:
        effort = client.post("/v1/chat/completions", json={**body, "reasoning_effort": "high"})
        default = client.post("/v1/chat/completions", json=body)
        bad = client.post("/v1/chat/completions", json={**body, "reasoning_effort": "max"})
    decode = engine.tokenizer.decode
    assert decode(effort.json()["prompt_token_ids"]) == "high|hi"
    assert decode(default.json()["prompt_token_ids"]) == "none|hi"
    assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]


def test_force_include_usage_ends_every_stream_with_the_usage(chat_checkpoint):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
    for forced in (False, True):
        ctx = fake_context(FakeEngine(chat_checkpoint), force_include_usage=forced)
        with TestClient(build_app(ctx)) as client:
            text = client.post("/v1/completions", json=body).text
        assert ('"usage"' in text) == forced


DOC_TEMPLATE = (
    "{% for d in documents or [] %}[{{ d['title'] }}]{% endfor %}"
    "{% for t in tools or [] %}<{{ t['function']['name'] }}>{% endfor %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ greeting or '' }}"
)


def test_documents_and_the_chat_tokenize_fields_reach_the_template(chat_checkpoint):
    """vLLM's chat ``documents``, and ``/tokenize``'s chat fields (``tools``,
    ``chat_template``, ``chat_template_kwargs``): the prompt a chat request would send."""
    engine = FakeEngine(chat_checkpoint)
    ctx = fake_context(engine, chat_template=DOC_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    with TestClient(build_app(ctx)) as client:
        chat = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 1, "return_token_ids": True,
            "documents": [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}],
        })  # fmt: skip
        tokenized = client.post("/tokenize", json={
            "messages": messages, "tools": [tool], "chat_template_kwargs": {"greeting": "!"},
        })  # fmt: skip
        own = client.post(
            "/tokenize", json={"messages": messages, "chat_template": "<{{ 1 + 1 }}>"}
        )
        reserved = client.post(
            "/tokenize", json={"messages": messages, "chat_template_kwargs": {"tools": []}}
        )
    decode = engine.tokenizer.decode
    assert decode(chat.json()["prompt_token_ids"]) == "[a][b]hi"
    assert decode(tokenized.json()["tokens"]) == "<lookup>hi!"
    # A request's own template needs --trust-request-chat-template, as in vLLM.
    assert own.status_code == 400 and "trust-request-chat-template" in own.text
    assert reserved.status_code == 400 and "chat_template_kwargs" in reserved.text


def test_tokenize_adds_special_tokens_as_vllm_does(chat_checkpoint):
    """``add_special_tokens`` on ``/tokenize``: vLLM's defaults (true for a prompt, false for
    messages, whose chat template writes its own) and the request's value when given."""
    engine = FakeEngine(chat_checkpoint)
    ctx = fake_context(engine)
    seen: list[bool] = []  # what each tokenization was asked (the chat template's too)
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, **kw: (
        seen.append(kw["add_special_tokens"]) or encode(text, **kw)
    )
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(build_app(ctx)) as client:
        for body in (
            {"messages": messages},
            {"messages": messages, "add_special_tokens": True},
            {"prompt": "hi"},
            {"prompt": "hi", "add_special_tokens": False},
        ):
            assert client.post("/tokenize", json=body).status_code == 200
    assert seen == [False, True, True, False]


def test_tokenize_answers_are_the_json_starlette_renders(chat_checkpoint):
    """/tokenize and /detokenize encode with msgspec (a long answer's ``json.dumps`` held
    the event loop ~8x longer): the bytes are what ``JSONResponse`` would send."""
    from starlette.responses import JSONResponse

    engine = FakeEngine(chat_checkpoint)
    with TestClient(build_app(fake_context(engine))) as client:
        text = 'héllo wörld, "quoted" \u2028 tab\t ' * 50
        tokens = client.post("/tokenize", json={"prompt": text, "return_token_strs": True})
        ids = tokens.json()["tokens"]
        words = client.post("/detokenize", json={"tokens": ids})
    for response in (tokens, words):
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert response.content == JSONResponse(response.json()).body
    assert words.json() == {"prompt": engine.tokenizer.decode(ids)}
