"""``/classify``, ``/score``, ``/rerank`` and ``/pooling`` in process over a real
``AsyncLLM`` (its engine core in a child process): a tiny random BERT cross-encoder
against transformers, an embedding model's cosine scores, and the 400s that name the
fix."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embedding_checkpoints import (
    hf_hidden,
    write_bert,
    write_bert_classifier,
    write_decoder,
    write_wordpiece_tokenizer,
)
from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.serving_engine import ServingContext
from pagedlm.metrics.prometheus import PrometheusMetrics
from server.server_utils import in_process_app

MODEL = "tiny"
QUERY = "the quick brown fox"
DOCUMENTS = ["a cat sat on the mat", "the lazy dog", "hello world one two three"]
TOLERANCE = 1e-4
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _app(path, **options):
    return in_process_app(path, MODEL, num_kv_blocks=64, chat_template=CHAT_TEMPLATE, **options)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-ce")
    model = write_bert_classifier(path, num_labels=1)
    engine, app = _app(path)
    yield model, app
    engine.shutdown()


def _post_all(app, requests: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            answers = []
            for path, body in requests:
                response = await http.post(path, json={"model": MODEL, **body})
                answers.append((response.status_code, response.json()))
            return answers

    return asyncio.run(main())


def _logit(model, tokenizer, *texts: str) -> float:
    with torch.no_grad():
        return model(**tokenizer(*texts, return_tensors="pt")).logits[0, 0].item()


def test_score_and_rerank_match_transformers(cross_encoder):
    model, app = cross_encoder
    want = [
        torch.tensor(_logit(model, app.tokenizer, QUERY, d)).sigmoid().item() for d in DOCUMENTS
    ]
    (s1, score), (s2, v1), (s3, rerank), (s4, top), (s5, raw) = _post_all(
        app,
        [
            ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
            ("/v1/score", {"text_1": [QUERY] * 3, "text_2": DOCUMENTS}),
            ("/rerank", {"query": QUERY, "documents": DOCUMENTS}),
            ("/v2/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 1}),
            ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[:1], "use_activation": False}),
        ],
    )
    assert (s1, s2, s3, s4, s5) == (200,) * 5
    assert score["object"] == "list" and score["model"] == MODEL
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in score["data"])
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=TOLERANCE)
    assert [d["score"] for d in v1["data"]] == pytest.approx(want, abs=TOLERANCE)
    pair_tokens = sum(len(app.tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    assert score["usage"]["prompt_tokens"] == score["usage"]["total_tokens"] == pair_tokens
    order = sorted(range(3), key=lambda i: -want[i])
    assert [r["index"] for r in rerank["results"]] == order
    assert [r["document"]["text"] for r in rerank["results"]] == [DOCUMENTS[i] for i in order]
    assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx(
        sorted(want, reverse=True), abs=TOLERANCE
    )
    assert rerank["usage"] == {"total_tokens": pair_tokens}
    assert [r["index"] for r in top["results"]] == order[:1]
    raw_want = _logit(model, app.tokenizer, QUERY, DOCUMENTS[0])
    assert raw["results"][0]["relevance_score"] == pytest.approx(raw_want, abs=TOLERANCE)


def test_classify_and_pooling_give_the_probabilities(cross_encoder):
    model, app = cross_encoder
    (s1, classify), (s2, pooled), (s3, legacy) = _post_all(
        app,
        [
            ("/classify", {"input": [QUERY, DOCUMENTS[1]]}),
            ("/pooling", {"input": QUERY}),
            ("/classify", {"input": QUERY, "softmax": False}),  # vLLM's older name
        ],
    )
    assert (s1, s2, s3) == (200, 200, 200)
    for item, text in zip(classify["data"], [QUERY, DOCUMENTS[1]], strict=True):
        want = torch.tensor(_logit(model, app.tokenizer, text)).sigmoid().item()
        assert item["probs"] == pytest.approx([want], abs=TOLERANCE)
        assert item["num_classes"] == 1 and item["label"] == "LABEL_0"
    assert pooled["data"][0]["object"] == "pooling"
    assert pooled["data"][0]["data"] == pytest.approx(classify["data"][0]["probs"], abs=1e-6)
    raw = _logit(model, app.tokenizer, QUERY)
    assert legacy["data"][0]["probs"] == pytest.approx([raw], abs=TOLERANCE)


def test_bad_requests_get_400_naming_the_fix(cross_encoder):
    _, app = cross_encoder
    answers = _post_all(
        app,
        [
            ("/score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS}),
            ("/rerank", {"query": QUERY, "documents": []}),
            ("/v1/embeddings", {"input": QUERY}),
            ("/pooling", {"input": QUERY, "dimensions": 4}),
            ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}),
            ("/score", {"text_1": QUERY}),
        ],
    )
    statuses = [status for status, _ in answers]
    messages = [body["error"]["message"] for _, body in answers]
    assert statuses == [400] * 6, answers
    assert "text_1 has 2 items and text_2 3" in messages[0]
    assert "at least one item in query and in documents" in messages[1]
    assert "does not embed" in messages[2] and "/classify" in messages[2]
    assert "dimensions applies to embedding models" in messages[3]
    assert "top_n" in messages[4]
    assert "text_2" in messages[5]
    ((status, ok),) = _post_all(app, [("/score", {"text_1": QUERY, "text_2": QUERY})])
    assert status == 200 and len(ok["data"]) == 1  # the server still serves


def test_an_embedding_server_scores_by_cosine_and_does_not_classify(tmp_path):
    model = write_bert(tmp_path, "cls", normalize=True)
    engine, app = _app(tmp_path)
    try:
        (s1, score), (s2, rerank), (s3, classify), (s4, activation) = _post_all(
            app,
            [
                ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
                ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
                ("/classify", {"input": QUERY}),
                ("/score", {"text_1": QUERY, "text_2": DOCUMENTS, "use_activation": True}),
            ],
        )
    finally:
        engine.shutdown()
    tokenizer = app.tokenizer
    query = hf_hidden(model, tokenizer.encode(QUERY))[0]
    want = [
        F.cosine_similarity(query, hf_hidden(model, tokenizer.encode(d))[0], dim=0).item()
        for d in DOCUMENTS
    ]
    assert (s1, s2, s3, s4) == (200, 200, 400, 400)
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=TOLERANCE)
    tokens = len(tokenizer.encode(QUERY)) + sum(len(tokenizer.encode(d)) for d in DOCUMENTS)
    assert score["usage"]["prompt_tokens"] == tokens  # the query embedded once
    assert [r["index"] for r in rerank["results"]] == sorted(range(3), key=lambda i: -want[i])[:2]
    assert "does not classify" in classify["error"]["message"]
    assert "cosine similarity" in activation["error"]["message"]


def test_pooling_routes_on_a_generative_server_name_the_runner_flag():
    ctx = ServingContext(engine=None, model_names=[MODEL], metrics=PrometheusMetrics(MODEL))
    answers = _post_all(
        build_app(ctx),
        [
            ("/classify", {"input": "hi"}),
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/rerank", {"query": "a", "documents": ["b"]}),
            ("/pooling", {"input": "hi"}),
        ],
    )
    for status, body in answers:
        assert status == 400 and "--runner pooling" in body["error"]["message"]


def test_truncate_prompt_tokens_reaches_the_pairs(cross_encoder):
    model, app = cross_encoder
    tokenizer = app.tokenizer
    document = "embeddings are vectors of floats one two three four five"
    ((status, body),) = _post_all(
        app, [("/rerank", {"query": QUERY, "documents": [document], "truncate_prompt_tokens": 9})]
    )
    encoded = tokenizer(QUERY, document, truncation=True, max_length=9, return_tensors="pt")
    with torch.no_grad():
        want = model(**encoded).logits[0, 0].sigmoid().item()
    assert status == 200 and body["usage"]["total_tokens"] == 9
    assert body["results"][0]["relevance_score"] == pytest.approx(want, abs=TOLERANCE)


def test_invocations_answers_as_the_route_its_body_belongs_to(cross_encoder):
    _, app = cross_encoder
    direct = _post_all(
        app,
        [
            ("/rerank", {"query": QUERY, "documents": DOCUMENTS}),
            ("/score", {"text_1": QUERY, "text_2": DOCUMENTS[0]}),
            ("/classify", {"input": QUERY}),
        ],
    )
    routed = _post_all(
        app,
        [
            ("/invocations", {"query": QUERY, "documents": DOCUMENTS}),
            ("/invocations", {"text_1": QUERY, "text_2": DOCUMENTS[0]}),
            ("/invocations", {"input": QUERY}),  # a classifier: /classify
            ("/invocations", {"nothing": 1}),
        ],
    )
    for (s1, want), (s2, got) in zip(direct, routed, strict=False):
        assert s1 == s2 == 200
        assert got.get("results", got.get("data")) == want.get("results", want.get("data"))
    status, body = routed[-1]
    assert status == 400 and "query and documents (rerank)" in body["error"]["message"]


def test_classify_and_pooling_take_the_chat_form(cross_encoder):
    _, app = cross_encoder
    messages = [{"role": "user", "content": QUERY}, {"role": "user", "content": "the lazy dog"}]
    ids = app.tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=False
    )
    (s1, chat), (s2, direct), (s3, pooled) = _post_all(
        app,
        [
            ("/classify", {"messages": messages}),
            ("/classify", {"input": list(ids)}),
            ("/pooling", {"messages": messages}),
        ],
    )
    assert (s1, s2, s3) == (200, 200, 200)
    assert chat["data"][0]["probs"] == direct["data"][0]["probs"]
    assert pooled["data"][0]["data"] == direct["data"][0]["probs"]
    assert chat["usage"]["prompt_tokens"] == len(ids)


def test_pooling_takes_a_token_wise_task(tmp_path):
    """vLLM's ``task`` on /pooling: a token classifier's probabilities at every token (its
    prompt chunked over steps of 8 tokens), a row per token in ``data``; a task the model
    does not serve is a 400 naming the ones it does."""
    write_wordpiece_tokenizer(tmp_path)
    model = write_decoder(tmp_path, "LlamaConfig", "LlamaForTokenClassification", num_labels=3)
    engine, app = _app(tmp_path, max_num_batched_tokens=8)
    try:
        text = "the quick brown fox jumps over the lazy dog"
        (s1, tokens), (s2, default), (s3, raw), (s4, wrong), (s5, classify) = _post_all(
            app,
            [
                ("/pooling", {"input": text, "task": "token_classify"}),
                ("/pooling", {"input": [text]}),  # the model's own task
                ("/pooling", {"input": text, "task": "token_classify", "use_activation": False}),
                ("/pooling", {"input": text, "task": "token_embed"}),
                ("/classify", {"input": text}),
            ],
        )
    finally:
        engine.shutdown()
    assert (s1, s2, s3, s4, s5) == (200, 200, 200, 400, 400)
    ids = app.tokenizer.encode(text)
    assert len(ids) > 8
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    rows = tokens["data"][0]["data"]
    assert (torch.tensor(rows) - logits.softmax(-1)).abs().max().item() < TOLERANCE
    assert (torch.tensor(raw["data"][0]["data"]) - logits).abs().max().item() < TOLERANCE
    assert default["data"][0]["data"] == rows
    assert tokens["usage"]["prompt_tokens"] == len(ids)
    for body in (wrong, classify):
        assert "serves the tasks ['token_classify']" in body["error"]["message"]
    assert wrong["error"]["param"] == "task"


def test_an_embedding_server_embeds_every_token_on_pooling(tmp_path):
    model = write_bert(tmp_path, "cls", normalize=True)
    engine, app = _app(tmp_path)
    try:
        (s1, tokens), (s2, reward), (s3, half) = _post_all(
            app,
            [
                ("/pooling", {"input": QUERY, "task": "token_embed", "encoding_format": "base64"}),
                ("/pooling", {"input": QUERY, "task": "token_classify"}),
                (
                    "/pooling",
                    {
                        "input": QUERY,
                        "task": "token_embed",
                        "encoding_format": "base64",
                        "embed_dtype": "float16",
                        "endianness": "big",
                    },
                ),
            ],
        )
    finally:
        engine.shutdown()
    assert (s1, s2, s3) == (200, 400, 200)
    want = F.normalize(hf_hidden(model, app.tokenizer.encode(QUERY)), dim=-1)
    got = np.frombuffer(base64.b64decode(tokens["data"][0]["data"]), dtype="<f4")
    got = torch.from_numpy(got.copy()).reshape(want.shape)
    assert (got - want).abs().max().item() < TOLERANCE
    rows = np.frombuffer(base64.b64decode(half["data"][0]["data"]), dtype=">f2")
    assert (torch.from_numpy(rows.astype(np.float32)).reshape(want.shape) - want).abs().max() < 1e-3
    assert "token_embed" in reward["error"]["message"]


def test_score_takes_vllms_newer_names(cross_encoder):
    """vLLM's /score reads its two sides as queries and documents, queries and items,
    data_1 and data_2, or text_1 and text_2: the first complete pair in that order, the
    others' fields ignored; no complete pair is a 400 naming them."""
    _, app = cross_encoder
    answers = _post_all(
        app,
        [
            ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
            ("/score", {"queries": QUERY, "documents": DOCUMENTS}),
            ("/score", {"queries": [QUERY] * 3, "items": DOCUMENTS}),
            ("/v1/score", {"data_1": QUERY, "data_2": DOCUMENTS}),
            ("/score", {"queries": QUERY, "documents": DOCUMENTS, "text_1": "x", "text_2": "y"}),
            ("/score", {"data_1": QUERY, "data_2": DOCUMENTS, "text_1": "x", "text_2": "y"}),
            ("/score", {"queries": QUERY, "text_1": QUERY, "text_2": DOCUMENTS}),
            ("/invocations", {"queries": QUERY, "documents": DOCUMENTS}),
        ],
    )
    assert [status for status, _ in answers] == [200] * 8, answers
    want = [d["score"] for d in answers[0][1]["data"]]
    for _, body in answers[1:]:
        assert [d["score"] for d in body["data"]] == want
    errors = _post_all(
        app,
        [
            ("/score", {"queries": QUERY, "text_2": DOCUMENTS}),
            ("/score", {"queries": DOCUMENTS[:2], "documents": DOCUMENTS}),
            ("/score", {}),
        ],
    )
    assert [status for status, _ in errors] == [400] * 3
    (_, mixed), (_, uneven), (_, empty) = errors
    assert "queries with documents" in mixed["error"]["message"]
    assert "text_1 with text_2" in mixed["error"]["message"]
    assert mixed["error"]["param"] == "documents"
    assert "queries has 2 items and documents 3" in uneven["error"]["message"]
    assert "none of them" in empty["error"]["message"]
