"""vLLM's ``cache_salt`` on the pooling routes (``/v1/embeddings``, ``/pooling``,
``/classify``, ``/score``, ``/rerank``), in process over a real ``AsyncLLM`` serving tiny
decoders whose prompts take their prefixes from the prefix cache (last-token pooling):
an embedding model (texts) and a one-label classifier (a cross-encoder: text pairs).

The bodies had no ``cache_salt``: it was dropped as an unknown field, and a salted
request shared blocks with every other. The prefix-cache hit counter shows the salt
reaching the engine: a prompt sent again hits only under the salt it was first sent with.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from embedding_checkpoints import WORDS, write_decoder, write_wordpiece_tokenizer
from server.server_utils import in_process_app

MODEL = "tiny"
TEXT = " ".join(WORDS[:20] * 2)  # 40 words, 42 tokens: two full blocks of 16
OTHER = " ".join(WORDS[10:30] * 2)


def _served(path, model_class: str, **config):
    write_wordpiece_tokenizer(path)
    write_decoder(path, "LlamaConfig", model_class, **config)
    return in_process_app(path, MODEL, num_kv_blocks=64, block_size=16)


def _hits_per_request(engine, app, requests: list[tuple[str, dict]]) -> list[int]:
    """Each request's prefix-cache hits, in tokens (each must answer 200)."""

    def hits() -> int:
        return sum(m.value for m in engine.get_metrics() if m.name == "pagedlm:prefix_cache_hits")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            counts = []
            for path, body in requests:
                before = hits()
                response = await http.post(path, json={"model": MODEL, **body})
                assert response.status_code == 200, (path, response.text)
                counts.append(hits() - before)
            return counts

    return asyncio.run(main())


def _salted_thrice(path: str, body: dict) -> list[tuple[str, dict]]:
    """``body`` under salt a, then b, then a again (salts of their own per route)."""
    route = path.strip("/").replace("/", "-")
    return [(path, {**body, "cache_salt": f"{route}-{salt}"}) for salt in "aba"]


@pytest.mark.parametrize(
    ("model_class", "config", "requests"),
    [
        (
            "LlamaModel",
            {},
            [
                ("/v1/embeddings", {"input": TEXT}),
                ("/pooling", {"input": [TEXT]}),
                ("/score", {"text_1": TEXT, "text_2": OTHER}),
                ("/rerank", {"query": OTHER, "documents": [TEXT]}),
            ],
        ),
        (
            "LlamaForSequenceClassification",
            {"num_labels": 1},  # a cross-encoder: /score and /rerank read pairs
            [
                ("/classify", {"input": TEXT}),
                ("/score", {"text_1": TEXT, "text_2": OTHER}),
                ("/rerank", {"query": TEXT, "documents": [OTHER]}),
            ],
        ),
    ],
    ids=["embedding", "cross-encoder"],
)
def test_a_salt_keeps_its_prompts_blocks_to_itself(tmp_path, model_class, config, requests):
    engine, app = _served(tmp_path, model_class, **config)
    try:
        plan = [call for path, body in requests for call in _salted_thrice(path, body)]
        counts = _hits_per_request(engine, app, plan)
    finally:
        engine.shutdown()
    for (path, _), (first, other, again) in zip(requests, zip(*[iter(counts)] * 3), strict=True):
        assert (first, other) == (0, 0), path  # a new salt shares no block
        assert again >= 32, path  # its own salt: the two full blocks of each prompt


BAD_SALTS = [
    ("", "1 to 128 characters"),
    ("x" * 129, "has 129"),
    ("tenant/a", "'/'"),
    ("a@b", "'@'"),
    ("back\\slash", "NUL"),
    ("nul\x00", "NUL"),
    (7, "valid string"),
    (["a"], "valid string"),
]


def test_a_bad_salt_is_a_400_naming_cache_salt(tmp_path):
    """vLLM's rule on every route that takes a salt (the generation routes included):
    a non-empty string of at most 128 characters without '@', '/', '\\' or NUL. A 129th
    character was accepted on /v1/completions and /v1/chat/completions."""
    engine, app = _served(tmp_path, "LlamaModel")
    bodies = {
        "/v1/embeddings": {"input": TEXT},
        "/pooling": {"input": TEXT},
        "/score": {"text_1": TEXT, "text_2": OTHER},
        "/rerank": {"query": TEXT, "documents": [OTHER]},
        "/classify": {"input": TEXT},
        "/v1/completions": {"prompt": TEXT},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": TEXT}]},
    }

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            answers = []
            for path, body in bodies.items():
                for salt, _ in BAD_SALTS:
                    body = {"model": MODEL, **body, "cache_salt": salt}
                    answers.append((path, salt, await http.post(path, json=body)))
            fine = {"model": MODEL, "input": TEXT, "cache_salt": "x" * 128}
            good = await http.post("/v1/embeddings", json=fine)
            return answers, good

    try:
        answers, good = asyncio.run(main())
    finally:
        engine.shutdown()
    assert good.status_code == 200, good.text
    needles = dict((repr(salt), needle) for salt, needle in BAD_SALTS)
    for path, salt, response in answers:
        assert response.status_code == 400, (path, salt, response.text)
        error = response.json()["error"]
        assert error["param"] == "cache_salt", (path, salt, error)
        assert needles[repr(salt)] in error["message"], (path, salt, error)
