"""The fields vLLM's pooling bodies share (``/v1/embeddings``, ``/pooling``, ``/classify``,
``/score``, ``/rerank``), in process over real ``AsyncLLM``s serving tiny random BERTs:
``request_id`` names the response, ``priority`` needs ``--scheduling-policy priority``,
``truncation_side`` and ``padding`` shape the prompt, ``use_activation`` is the embedding
route's newer ``normalize``, and ``mm_processor_kwargs`` / ``media_io_kwargs`` (nothing to
apply them to) are 400s. They were unknown fields, ignored with a warning."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from embedding_checkpoints import write_bert, write_bert_classifier
from server.server_utils import in_process_app

MODEL = "tiny"
TEXT = "the quick brown fox jumps over the lazy dog"
QUERY = "the quick brown fox"
DOCUMENTS = ["a cat sat on the mat", "the lazy dog"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-embed")
    write_bert(path, "mean", normalize=True)
    engine, app = in_process_app(path, MODEL, num_kv_blocks=64)
    yield app
    engine.shutdown()


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-score")
    write_bert_classifier(path, num_labels=1)
    engine, app = in_process_app(path, MODEL, num_kv_blocks=64, scheduling_policy="priority")
    yield app
    engine.shutdown()


def _post(app, requests: list[tuple[str, dict]], headers=None) -> list[httpx.Response]:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return [
                await http.post(path, json={"model": MODEL, **body}, headers=headers)
                for path, body in requests
            ]

    return asyncio.run(main())


def _vector(response: httpx.Response) -> torch.Tensor:
    assert response.status_code == 200, response.text
    return torch.tensor(response.json()["data"][0]["embedding"])


def test_request_id_names_the_response_on_every_route(embedder, scorer):
    embed, pool = _post(
        embedder, [("/v1/embeddings", {"input": TEXT}), ("/pooling", {"input": TEXT})]
    )
    fields = {"request_id": "mine-1"}
    answers = _post(
        embedder,
        [("/v1/embeddings", {"input": TEXT, **fields}), ("/pooling", {"input": TEXT, **fields})],
    )
    answers += _post(
        scorer,
        [
            ("/classify", {"input": TEXT, **fields}),
            ("/score", {"text_1": QUERY, "text_2": DOCUMENTS, **fields}),
            ("/rerank", {"query": QUERY, "documents": DOCUMENTS, **fields}),
        ],
    )
    ids = [answer.json()["id"] for answer in answers]
    assert ids == ["embd-mine-1", "pool-mine-1", "classify-mine-1", "score-mine-1", "rerank-mine-1"]
    assert all("warning" not in answer.headers for answer in answers)
    assert embed.json()["id"] != "embd-mine-1" and pool.json()["id"].startswith("pool-")
    (header,) = _post(
        embedder, [("/v1/embeddings", {"input": TEXT, **fields})], {"X-Request-Id": "hdr"}
    )
    assert header.json()["id"] == "embd-hdr"  # vLLM's order: the header wins


def test_priority_needs_the_priority_scheduling_policy(embedder, scorer):
    refused = _post(
        embedder,
        [("/v1/embeddings", {"input": TEXT, "priority": 3}), ("/pooling", {"input": TEXT, "priority": -1})],
    )  # fmt: skip
    for answer in refused:
        assert answer.status_code == 400, answer.text
        assert "--scheduling-policy priority" in answer.json()["error"]["message"]
    (served,) = _post(embedder, [("/v1/embeddings", {"input": TEXT, "priority": 0})])
    assert served.status_code == 200
    answers = _post(
        scorer,
        [
            ("/classify", {"input": TEXT, "priority": 5}),
            ("/score", {"text_1": QUERY, "text_2": DOCUMENTS, "priority": -2, "user": "u"}),
            ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "priority": 1, "user": "u"}),
        ],
    )
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert all("warning" not in answer.headers for answer in answers)


def test_truncation_side_and_padding_shape_the_prompt(embedder):
    full = embedder.tokenizer.encode(TEXT)  # [CLS] ... [SEP]
    pad = embedder.tokenizer.pad_token_id
    cut = {"input": TEXT, "truncate_prompt_tokens": 4}
    answers = _post(
        embedder,
        [
            ("/v1/embeddings", {**cut, "truncation_side": "left"}),
            ("/v1/embeddings", {"input": full[-4:]}),
            ("/v1/embeddings", {**cut, "truncation_side": "right"}),
            ("/v1/embeddings", {"input": full[:4]}),
            ("/v1/embeddings", {"input": full, "truncate_prompt_tokens": 4, "truncation_side": "right"}),
            ("/v1/embeddings", {"input": "a cat", "padding": "max_length", "truncate_prompt_tokens": 8}),
            ("/v1/embeddings", {"input": "a cat", "padding": "do_not_pad"}),
        ],
    )  # fmt: skip
    vectors = [_vector(answer) for answer in answers[:5]]
    assert torch.equal(vectors[0], vectors[1]) and torch.equal(vectors[2], vectors[3])
    assert torch.equal(vectors[4], vectors[3])  # token ids: cut on the side asked too
    assert not torch.allclose(vectors[0], vectors[2])
    short = embedder.tokenizer.encode("a cat")
    padded, unpadded = answers[5], answers[6]
    assert padded.json()["usage"]["prompt_tokens"] == 8
    assert unpadded.json()["usage"]["prompt_tokens"] == len(short)
    (reference,) = _post(
        embedder, [("/v1/embeddings", {"input": short + [pad] * (8 - len(short))})]
    )
    assert torch.equal(_vector(padded), _vector(reference))


def test_use_activation_is_the_newer_normalize(embedder):
    raw, normalized, clash = _post(
        embedder,
        [
            ("/v1/embeddings", {"input": TEXT, "use_activation": False}),
            ("/v1/embeddings", {"input": TEXT}),
            ("/v1/embeddings", {"input": TEXT, "use_activation": False, "normalize": True}),
        ],
    )
    assert abs(_vector(normalized).norm().item() - 1.0) < 1e-4
    assert abs(_vector(raw).norm().item() - 1.0) > 1e-2
    assert clash.status_code == 400 and "disagree" in clash.json()["error"]["message"]


def test_processor_kwargs_without_images_are_refused(embedder, scorer):
    messages = [{"role": "user", "content": TEXT}]
    answers = _post(
        embedder,
        [
            ("/v1/embeddings", {"input": TEXT, "mm_processor_kwargs": {"size": 4}}),
            ("/pooling", {"messages": messages, "media_io_kwargs": {"image": {"mode": "RGB"}}}),
        ],
    )
    answers += _post(scorer, [("/score", {"text_1": QUERY, "text_2": DOCUMENTS, "mm_processor_kwargs": {"a": 1}})])  # fmt: skip
    params = [answer.json()["error"]["param"] for answer in answers]
    assert [a.status_code for a in answers] == [400] * 3
    assert params == ["mm_processor_kwargs", "media_io_kwargs", "mm_processor_kwargs"]
    assert all("drop it" in answer.json()["error"]["message"] for answer in answers)
    (empty,) = _post(embedder, [("/v1/embeddings", {"input": TEXT, "mm_processor_kwargs": {}})])
    assert empty.status_code == 200
