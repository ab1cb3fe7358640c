"""A pooling request the engine core fails (reported failed by the step that pools it; see
``failing_steps``): offline, the call's other prompts finish and ``RequestFailedError``
names the failed one, its outputs what the call returns for the others; over HTTP that
request's 500, the server serving the next."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest
import torch

from embedding_checkpoints import write_bert, write_bert_classifier
from pagedlm import LLM, PoolingParams
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.engine.exceptions import RequestFailedError
from pagedlm.outputs import RequestOutput
from pooling import failing_steps

TESTS = Path(__file__).resolve().parents[1]
TEXTS = ["the quick brown fox", "a cat sat on the mat", "hello world"]
MESSAGE = "injected: this prompt's step failed it"
ENGINE = dict(num_kv_blocks=32, max_model_len=64)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bert-fail")
    write_bert(path, "mean", normalize=True)
    return path


def _fail_cat(llm: LLM, monkeypatch) -> None:
    token_id = llm.get_tokenizer().convert_tokens_to_ids("cat")
    update = failing_steps.failing_update(token_id, MESSAGE)
    monkeypatch.setattr(OneBudgetScheduler, "update_from_output", update)


def _check_failure(failure: RequestFailedError, expected: list) -> None:
    assert "(prompt 1 of the call)" in str(failure) and MESSAGE in str(failure)
    failed = failure.outputs[1]
    assert isinstance(failed, RequestOutput) and failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].stop_reason == MESSAGE
    for i in (0, 2):
        assert type(failure.outputs[i]) is type(expected[i])
        assert failure.outputs[i].request_id != expected[i].request_id


def test_offline_the_other_prompts_outputs_are_the_calls(bert, monkeypatch):
    """The error's outputs for the other prompts were the engine's raw vectors (not
    normalized as the model's pooler says, and not the ``EmbeddingRequestOutput``
    ``embed`` returns)."""
    llm = LLM(str(bert), **ENGINE)
    params = PoolingParams()
    expected = llm.embed(TEXTS, pooling_params=params, use_tqdm=False)
    pooled = llm.encode(TEXTS, params, use_tqdm=False, pooling_task="embed")
    _fail_cat(llm, monkeypatch)
    with pytest.raises(RequestFailedError) as embed_failure:
        llm.embed(TEXTS, pooling_params=params, use_tqdm=False)
    _check_failure(embed_failure.value, expected)
    with pytest.raises(RequestFailedError) as encode_failure:
        llm.encode(TEXTS, params, use_tqdm=False, pooling_task="embed")
    _check_failure(encode_failure.value, pooled)
    for i in (0, 2):
        got = embed_failure.value.outputs[i].outputs.embedding
        assert got == pytest.approx(expected[i].outputs.embedding, abs=1e-5)
        assert sum(x * x for x in got) == pytest.approx(1.0, abs=1e-5)  # normalized
        got = encode_failure.value.outputs[i].outputs.data
        torch.testing.assert_close(got, pooled[i].outputs.data)
    monkeypatch.undo()
    assert len(llm.embed(TEXTS, use_tqdm=False)) == 3  # the engine serves on
    llm.llm_engine.shutdown()


def test_offline_classify_gives_the_calls_probabilities(tmp_path, monkeypatch):
    path = tmp_path / "classifier"
    write_bert_classifier(path, num_labels=3)
    llm = LLM(str(path), **ENGINE)
    expected = llm.classify(TEXTS, use_tqdm=False)
    _fail_cat(llm, monkeypatch)
    with pytest.raises(RequestFailedError) as failure:
        llm.classify(TEXTS, use_tqdm=False)
    _check_failure(failure.value, expected)
    for i in (0, 2):
        got = failure.value.outputs[i].outputs.probs
        assert got == pytest.approx(expected[i].outputs.probs, abs=1e-5)
        assert sum(got) == pytest.approx(1.0, abs=1e-5)  # through the softmax
    llm.llm_engine.shutdown()


def test_offline_a_cross_encoders_scores_are_the_calls(tmp_path, monkeypatch):
    path = tmp_path / "cross-encoder"
    write_bert_classifier(path, num_labels=1)
    llm = LLM(str(path), **ENGINE)
    queries = ["the dog"] * 3  # pairs element-wise, the marker in the first text's ids
    expected = llm.score(TEXTS, queries, use_tqdm=False)
    _fail_cat(llm, monkeypatch)
    with pytest.raises(RequestFailedError) as failure:
        llm.score(TEXTS, queries, use_tqdm=False)
    _check_failure(failure.value, expected)
    for i in (0, 2):
        assert failure.value.outputs[i].outputs.score == pytest.approx(
            expected[i].outputs.score, abs=1e-5
        )
    llm.llm_engine.shutdown()


def test_over_http_the_failed_embedding_request_is_a_500(bert, monkeypatch):
    from server.server_utils import in_process_app

    # The engine-core process imports failing_steps by name: put tests/ on its path.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.getenv("PYTHONPATH")]))
    )
    engine, app = in_process_app(bert, "emb", **ENGINE)
    token_id = app.tokenizer.convert_tokens_to_ids("cat")

    async def main():
        assert await engine.collective_rpc(
            failing_steps.fail_prompts_with, 60.0, args=(token_id, MESSAGE)
        ) == [True]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            refused = await client.post("/v1/embeddings", json={"model": "emb", "input": TEXTS})
            served = await client.post(
                "/v1/embeddings", json={"model": "emb", "input": [TEXTS[0], TEXTS[2]]}
            )
        return refused, served

    try:
        refused, served = asyncio.run(main())
    finally:
        engine.shutdown()
    assert refused.status_code == 500, refused.text
    assert MESSAGE in refused.json()["error"]["message"]
    assert served.status_code == 200 and len(served.json()["data"]) == 2
