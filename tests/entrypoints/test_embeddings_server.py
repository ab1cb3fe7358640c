"""``/v1/embeddings`` through the unmodified openai SDK, in process over a real ``AsyncLLM``
(its engine core in a child process) serving a tiny random BERT; and the 400s that name
``--runner`` on a server of the wrong kind."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from embedding_checkpoints import TEXTS, hf_hidden, reference_vector, write_bert
from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.serving_embedding import encode_vector
from pagedlm.entrypoints.openai.serving_engine import ServingContext
from pagedlm.metrics.prometheus import PrometheusMetrics
from server.server_utils import in_process_app

MODEL = "tiny-bert"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("bert-mean")
    return path, write_bert(path, "mean", normalize=True)


@pytest.fixture(scope="module")
def app(bert_dir):
    engine, app = in_process_app(
        bert_dir[0],
        MODEL,
        num_kv_blocks=64,
        chat_template=CHAT_TEMPLATE,  # --chat-template: BERT's tokenizer has none
    )
    yield app
    engine.shutdown()


def _run(app, work):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://t/v1", http_client=http)
            return await work(client, http)

    return asyncio.run(main())


def _references(bert_dir, app) -> list[torch.Tensor]:
    tokenizer = app.tokenizer
    model = bert_dir[1]
    return [
        reference_vector(hf_hidden(model, tokenizer.encode(text)), "mean", True) for text in TEXTS
    ]


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_sdk_embeddings_match_transformers(app, bert_dir, encoding_format):
    """None: the SDK's default, which asks for base64 on the wire and decodes it itself."""

    async def work(client, http):
        if encoding_format is None:
            return await client.embeddings.create(model=MODEL, input=TEXTS)
        return await client.embeddings.create(
            model=MODEL, input=TEXTS, encoding_format=encoding_format
        )

    response = _run(app, work)
    assert [item.index for item in response.data] == list(range(len(TEXTS)))
    tokenizer = app.tokenizer
    num_tokens = sum(len(tokenizer.encode(text)) for text in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    assert response.model == MODEL
    for item, want in zip(response.data, _references(bert_dir, app), strict=True):
        embedding = item.embedding
        if encoding_format == "base64":  # asked for explicitly: the SDK hands it over as is
            embedding = np.frombuffer(base64.b64decode(embedding), dtype="<f4").tolist()
        got = torch.tensor(embedding)
        assert (got - want).abs().max().item() < 1e-4


def test_base64_by_default_is_native_float32_of_the_float_answer(app):
    """The default base64 form is the float answer as float32 in this machine's byte
    order (vLLM's default ``endianness``, "native"); token-id list inputs, usage."""

    async def work(client, http):
        body = {"model": MODEL, "input": [[5, 6, 7, 8], [9, 10]]}  # token-id lists
        floats = await http.post("/v1/embeddings", json=body)
        packed = await http.post("/v1/embeddings", json={**body, "encoding_format": "base64"})
        single = await http.post("/v1/embeddings", json={"model": MODEL, "input": [5, 6, 7, 8]})
        return floats.json(), packed.json(), single.json()

    floats, packed, single = _run(app, work)
    for plain, encoded in zip(floats["data"], packed["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype="=f4")
        np.testing.assert_array_equal(decoded, np.asarray(plain["embedding"], dtype=np.float32))
    assert floats["usage"]["prompt_tokens"] == 6
    assert single["data"][0]["embedding"] == floats["data"][0]["embedding"]
    assert encode_vector(torch.tensor([1.0, -2.5]), "base64") == base64.b64encode(
        np.array([1.0, -2.5], dtype="=f4").tobytes()
    ).decode("ascii")


def test_bad_requests_get_400_naming_the_fix(app):
    async def work(client, http):
        answers = {}
        for name, body in {
            "dimensions": {"input": "hello", "dimensions": 8},  # not a Matryoshka model
            "empty": {"input": []},
            "mixed": {"input": ["hello", [5, 6]]},
            "empty_ids": {"input": [[5], []]},
            "vocab": {"input": [[5, 10_000]]},
            "generate": None,
        }.items():
            if body is None:
                response = await http.post("/v1/completions", json={"prompt": "hi"})
            else:
                response = await http.post("/v1/embeddings", json={"model": MODEL, **body})
            answers[name] = (response.status_code, response.json()["error"]["message"])
        ok = await client.embeddings.create(model=MODEL, input="hello", encoding_format="float")
        return answers, ok

    answers, ok = _run(app, work)
    assert all(status == 400 for status, _ in answers.values()), answers
    assert "Matryoshka" in answers["dimensions"][1]
    assert "input is empty" in answers["empty"][1]
    assert answers["mixed"][1].startswith("input")
    assert "The prompt is empty" in answers["empty_ids"][1]
    assert "outside the vocabulary" in answers["vocab"][1]
    assert "--runner" in answers["generate"][1] and "/v1/embeddings" in answers["generate"][1]
    assert len(ok.data[0].embedding) == 32  # the server still serves after the errors


def test_embeddings_on_a_generative_server_name_the_runner_flag():
    ctx = ServingContext(engine=None, model_names=["gen"], metrics=PrometheusMetrics("gen"))
    app = build_app(ctx)

    async def work(client, http):
        with pytest.raises(openai.BadRequestError) as error:
            await client.embeddings.create(model="gen", input="hello")
        return error.value

    error = _run(app, work)
    assert "--runner pooling" in str(error)


def test_the_chat_form_embeds_the_rendered_conversation(app):
    """vLLM's chat-form embedding request: ``messages`` through the chat template."""
    messages = [{"role": "user", "content": "the quick fox"}, {"role": "user", "content": "a cat"}]
    ids = app.tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=False
    )

    async def work(client, http):
        chat = await http.post("/v1/embeddings", json={"model": MODEL, "messages": messages})
        direct = await http.post("/v1/embeddings", json={"model": MODEL, "input": list(ids)})
        both = await http.post(
            "/v1/embeddings", json={"model": MODEL, "messages": messages, "input": "x"}
        )
        neither = await http.post("/v1/embeddings", json={"model": MODEL})
        return chat, direct, both, neither

    chat, direct, both, neither = _run(app, work)
    assert chat.status_code == 200, chat.text
    assert chat.json()["data"][0]["embedding"] == direct.json()["data"][0]["embedding"]
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    assert both.status_code == neither.status_code == 400
    assert "not both" in both.json()["error"]["message"]
    assert "Send input" in neither.json()["error"]["message"]


def test_add_special_tokens_as_vllm_defaults_it(app):
    """vLLM's ``add_special_tokens``: true for ``input`` texts, false for ``messages`` (the
    template writes what it needs); either way on request."""
    tokenizer = app.tokenizer
    messages = [{"role": "user", "content": "the quick fox"}]
    rendered = tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=False
    )
    bare = tokenizer.encode("hello world", add_special_tokens=False)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id

    async def work(client, http):
        bodies = [
            {"input": "hello world"},
            {"input": "hello world", "add_special_tokens": False},
            {"input": bare},
            {"input": [cls, *bare, sep]},
            {"messages": messages, "add_special_tokens": True},
            {"input": [cls, *rendered, sep]},
            {"messages": messages},
        ]
        answers = [await http.post("/v1/embeddings", json={"model": MODEL, **b}) for b in bodies]
        return [answer.json() for answer in answers]

    answers = _run(app, work)
    default, without, _, _, chat_with, _, chat = answers
    vector = [answer["data"][0]["embedding"] for answer in answers]
    assert default["usage"]["prompt_tokens"] == len(bare) + 2
    assert vector[0] == vector[3]  # input texts get [CLS] ... [SEP] by default
    assert without["usage"]["prompt_tokens"] == len(bare) and vector[1] == vector[2]
    assert chat["usage"]["prompt_tokens"] == len(rendered)  # messages: none added
    assert chat_with["usage"]["prompt_tokens"] == len(rendered) + 2 and vector[4] == vector[5]


def _encoded(values, embed_dtype: str, byteorder: str) -> list[float]:
    """The values of a binary embedding decoded independently of the server's encoder."""
    order = "<" if byteorder == "little" else ">"
    if embed_dtype in ("float32", "float16"):
        size = 4 if embed_dtype == "float32" else 2
        return np.frombuffer(values, dtype=f"{order}f{size}").astype(np.float64).tolist()
    if embed_dtype == "bfloat16":  # the high half of a float32
        halves = np.frombuffer(values, dtype=f"{order}u2").astype(np.uint32) << 16
        return halves.view(np.float32).astype(np.float64).tolist()
    codes = torch.frombuffer(bytearray(values), dtype=torch.uint8)
    fp8 = torch.float8_e4m3fn if embed_dtype == "fp8_e4m3" else torch.float8_e5m2
    return codes.view(fp8).to(torch.float64).tolist()


@pytest.mark.parametrize(
    ("embed_dtype", "tolerance"),
    [  # (rtol, atol): half the spacing of the format's numbers (fp8's small ones: absolute)
        ("float32", (0.0, 0.0)),
        ("float16", (1e-3, 1e-7)),
        ("bfloat16", (4e-3, 1e-7)),
        ("fp8_e4m3", (0.0625, 1e-3)),
        ("fp8_e5m2", (0.125, 1e-5)),
    ],
)
def test_embed_dtype_and_endianness_shape_the_binary_forms(app, embed_dtype, tolerance):
    body = {"model": MODEL, "input": ["hello world", "a cat"], "embed_dtype": embed_dtype}

    async def work(client, http):
        floats = await http.post("/v1/embeddings", json={**body, "encoding_format": "float"})
        encoded = {
            endianness: await http.post(
                "/v1/embeddings",
                json={**body, "encoding_format": "base64", "endianness": endianness},
            )
            for endianness in ("native", "big", "little")
        }
        raw = await http.post("/v1/embeddings", json={**body, "encoding_format": "bytes"})
        only = await http.post(
            "/v1/embeddings", json={**body, "encoding_format": "bytes_only", "endianness": "big"}
        )
        pooled = await http.post(
            "/pooling", json={**body, "encoding_format": "bytes_only", "endianness": "big"}
        )
        return floats.json(), {k: v.json() for k, v in encoded.items()}, raw, only, pooled

    floats, encoded, raw, only, pooled = _run(app, work)
    want = [item["embedding"] for item in floats["data"]]
    for endianness, answer in encoded.items():
        order = sys.byteorder if endianness == "native" else endianness
        for item, values in zip(answer["data"], want, strict=True):
            got = _encoded(base64.b64decode(item["embedding"]), embed_dtype, order)
            np.testing.assert_allclose(got, values, rtol=tolerance[0], atol=tolerance[1])
    assert encoded["native"]["usage"] == floats["usage"]
    # vLLM's "bytes": the vectors back to back, where each lies in the metadata header.
    assert raw.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(raw.headers["metadata"])
    assert metadata["model"] == MODEL and metadata["id"].startswith("embd-")
    assert metadata["usage"] == {
        "prompt_tokens": floats["usage"]["prompt_tokens"],
        "total_tokens": floats["usage"]["prompt_tokens"],
    }
    width = len(raw.content) // 2
    assert [(d["index"], d["start"], d["end"], d["shape"]) for d in metadata["data"]] == [
        (0, 0, width, [32]),
        (1, width, 2 * width, [32]),
    ]
    assert {(d["embed_dtype"], d["endianness"]) for d in metadata["data"]} == {
        (embed_dtype, "native")
    }
    for item, values in zip(metadata["data"], want, strict=True):
        part = raw.content[item["start"] : item["end"]]
        np.testing.assert_allclose(
            _encoded(part, embed_dtype, sys.byteorder), values, rtol=tolerance[0], atol=tolerance[1]
        )
    assert "metadata" not in only.headers and len(only.content) == len(raw.content)
    assert _encoded(only.content, embed_dtype, "big") == _encoded(
        raw.content, embed_dtype, sys.byteorder
    )
    assert pooled.content == only.content  # /pooling encodes as /v1/embeddings


def test_bad_encodings_get_400_naming_the_allowed_values(app):
    async def work(client, http):
        answers = []
        for field, value in [
            ("embed_dtype", "int8"),
            ("endianness", "middle"),
            ("encoding_format", "hex"),
        ]:
            response = await http.post(
                "/v1/embeddings", json={"model": MODEL, "input": "hi", field: value}
            )
            answers.append((response.status_code, response.json()["error"]))
        return answers

    (s1, dtype), (s2, order), (s3, encoding) = _run(app, work)
    assert (s1, s2, s3) == (400, 400, 400)
    assert dtype["param"] == "embed_dtype"
    assert all(name in dtype["message"] for name in ("float32", "bfloat16", "fp8_e5m2"))
    assert all(name in order["message"] for name in ("native", "big", "little"))
    assert all(name in encoding["message"] for name in ("float", "base64", "bytes_only"))
