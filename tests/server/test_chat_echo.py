"""Chat completions' ``echo`` (vLLM's): when the last message has the reply's role, each
choice's content starts with that message's text (streamed as each choice's first content
delta); usage and finish reasons are those of the same request without it, and a
non-streaming answer carries the prompt's logprobs."""

from __future__ import annotations

import asyncio
import json

import httpx

from server.server_utils import in_process_app

USER = {"role": "user", "content": "Hi"}
PREFILL = {"role": "assistant", "content": "Sure, "}
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def _chat(**fields) -> dict:
    return {"model": "tiny", "max_tokens": 4, "temperature": 0, **fields}


def _stream_events(text: str) -> list[dict]:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _post_all(checkpoint, bodies: list[dict]) -> list[httpx.Response]:
    engine, app = in_process_app(checkpoint, num_kv_blocks=32, max_model_len=128)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.post("/v1/chat/completions", json=body) for body in bodies]

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def test_echo_prepends_the_last_message_of_the_replys_role(chat_checkpoint) -> None:
    parts = [{"type": "text", "text": "Sure"}, {"type": "text", "text": "thing"}]
    answers = _post_all(
        chat_checkpoint,
        [
            _chat(messages=[USER, PREFILL], **CONTINUE),
            _chat(messages=[USER, PREFILL], echo=True, **CONTINUE),
            _chat(messages=[USER], echo=True),  # the reply is the assistant's: nothing echoed
            _chat(messages=[USER]),
            _chat(messages=[USER], echo=True, add_generation_prompt=False),  # continues "user"
            _chat(messages=[USER, PREFILL], echo=True, n=2, **CONTINUE),
            _chat(messages=[USER, {"role": "assistant", "content": parts}], echo=True, **CONTINUE),
            _chat(messages=[USER, PREFILL], echo=True, prompt_logprobs=1, **CONTINUE),
        ],
    )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    plain, echoed, other_role, other_plain, user_role, several, joined, two = (
        a.json() for a in answers
    )
    generated = plain["choices"][0]["message"]["content"]
    message = echoed["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Sure, " + generated}
    assert echoed["usage"] == plain["usage"]
    assert echoed["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    # vLLM's: an echoing request answers with its prompt's logprobs (top_logprobs of them).
    positions = echoed["prompt_logprobs"]
    assert len(positions) == echoed["usage"]["prompt_tokens"] and positions[0] is None
    assert all(len(position) == 1 for position in positions[1:])
    assert all(len(position) <= 2 for position in two["prompt_logprobs"][1:])
    assert any(len(position) == 2 for position in two["prompt_logprobs"][1:])

    assert other_role["choices"][0]["message"] == other_plain["choices"][0]["message"]
    assert user_role["choices"][0]["message"]["role"] == "user"
    assert user_role["choices"][0]["message"]["content"].startswith("Hi")
    assert [c["message"]["content"] for c in several["choices"]] == ["Sure, " + generated] * 2
    assert joined["choices"][0]["message"]["content"].startswith("Sure\nthing")


def test_a_stream_sends_the_echo_as_each_choices_first_content(chat_checkpoint) -> None:
    usage = {"stream_options": {"include_usage": True}}
    whole, streamed, plain = _post_all(
        chat_checkpoint,
        [
            _chat(messages=[USER, PREFILL], echo=True, n=2, **CONTINUE),
            _chat(messages=[USER, PREFILL], echo=True, n=2, stream=True, **usage, **CONTINUE),
            _chat(messages=[USER, PREFILL], n=2, stream=True, **usage, **CONTINUE),
        ],
    )
    events = _stream_events(streamed.text)
    for index in (0, 1):
        deltas = [
            e["choices"][0]["delta"]
            for e in events
            if e["choices"] and e["choices"][0]["index"] == index
        ]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert deltas[1] == {"content": "Sure, "}
        text = "".join(delta.get("content") or "" for delta in deltas)
        assert text == whole.json()["choices"][index]["message"]["content"]
    plain_events = _stream_events(plain.text)
    assert events[-1]["usage"] == plain_events[-1]["usage"] == whole.json()["usage"]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes.count(None) == len(finishes) - 2
    assert "prompt_logprobs" not in json.dumps(events)  # a stream sends none (as vLLM)
