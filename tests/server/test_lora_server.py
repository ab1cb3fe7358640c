"""LoRA over HTTP with the real server: --lora-modules, ``model`` naming an adapter,
/v1/models with parents, loading and unloading at run time, vLLM's 400/404 errors, the
lora_requests_info gauge; the server stays healthy through every bad request."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import start_server

from peft_adapters import LLAMA_MODULES, make_adapter, rename_tensors

PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def lora_server(chat_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(chat_checkpoint, root / "first", LLAMA_MODULES, rank=8, std=0.3)
    make_adapter(chat_checkpoint, root / "second", LLAMA_MODULES[:4], rank=4, seed=3, std=0.3)
    make_adapter(chat_checkpoint, root / "too_wide", LLAMA_MODULES, rank=16)
    make_adapter(chat_checkpoint, root / "unknown", LLAMA_MODULES)
    rename_tensors(root / "unknown", "layers.0.self_attn.q_proj", "layers.0.self_attn.c_attn")
    server = start_server(
        chat_checkpoint,
        tmp_path_factory.mktemp("logs") / "lora.log",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--allow-runtime-lora-updating", "--lora-modules", f"first={root / 'first'}",
    )  # fmt: skip
    yield server, root
    server.stop()


def _text(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0)
    return out.choices[0].text


def test_adapters_by_name_loaded_and_unloaded_at_run_time(lora_server):
    server, root = lora_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "first"}
    assert models["first"].parent == "tiny" and models["first"].root == str(root / "first")
    base, first = _text(client, "tiny"), _text(client, "first")
    assert base != first

    def post(route: str, **body) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)

    loaded = post("load_lora_adapter", lora_name="again", lora_path=str(root / "first"))
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'again' added successfully."
    assert _text(client, "again") == first
    assert post("load_lora_adapter", lora_name="second", lora_path=str(root / "second")).is_success
    second = client.chat.completions.create(
        model="second", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert second.model == "second"

    errors = [
        (post("load_lora_adapter", lora_name="again", lora_path=str(root / "first")), 400,
         "has already been loaded"),
        (post("load_lora_adapter", lora_name="w", lora_path=str(root / "too_wide")), 400,
         "LoRA rank 16 is greater than max_lora_rank 8"),
        (post("load_lora_adapter", lora_name="u", lora_path=str(root / "unknown")), 400,
         "target module 'model.layers.0.self_attn.c_attn' does not exist"),
        # vLLM's 404 for a path with no adapter.
        (post("load_lora_adapter", lora_name="m", lora_path=str(root / "missing")), 404,
         "No adapter found for"),
        (post("unload_lora_adapter"), 400, "either 'lora_name' and 'lora_int_id'"),
        (post("load_lora_adapter", lora_name="x"), 400, "Both 'lora_name' and 'lora_path'"),
        (post("unload_lora_adapter", lora_name="nope"), 404, "'nope' cannot be found"),
        # An adapter named as the base model took over every request for the base model.
        (post("load_lora_adapter", lora_name="tiny", lora_path=str(root / "first")), 400,
         "'tiny' is a name this server serves the base model under"),
    ]  # fmt: skip
    for response, status, message in errors:
        assert response.status_code == status and message in response.json()["error"]["message"]

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _text(client, "never-loaded")
    unloaded = post("unload_lora_adapter", lora_name="again")
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    with pytest.raises(openai.NotFoundError):
        _text(client, "again")
    assert _text(client, "first") == first  # nothing else was harmed
    assert _text(client, "tiny") == base
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'pagedlm:lora_requests_info{max_lora="2"' in metrics


def test_runtime_updating_is_off_without_the_flags(tiny_server, chat_checkpoint):
    response = httpx.post(
        f"{tiny_server.url}/v1/load_lora_adapter",
        json={"lora_name": "a", "lora_path": str(chat_checkpoint)},
        timeout=30,
    )
    assert response.status_code == 404
    assert "--enable-lora --allow-runtime-lora-updating" in response.json()["error"]["message"]


def test_unloading_an_adapter_drops_it_from_the_workers(chat_checkpoint, tmp_path):
    """vLLM's unload route removes the adapter from the engine too, not only its name."""
    import asyncio

    from server_utils import in_process_app

    from pagedlm.entrypoints.openai.serving_lora import LoRARegistry

    make_adapter(chat_checkpoint, tmp_path / "a", LLAMA_MODULES, rank=8, std=0.3)
    registry = LoRARegistry("tiny", enabled=True, runtime_updating=True)
    engine, app = in_process_app(chat_checkpoint, enable_lora=True, max_lora_rank=8,
                                 num_kv_blocks=64, loras=registry)  # fmt: skip

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            body = {"lora_name": "a", "lora_path": str(tmp_path / "a")}
            assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 200
            loaded = await engine.list_loras()
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
            assert unloaded.status_code == 200
            return loaded, await engine.list_loras()

    try:
        loaded, after = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(loaded) == 1 and after == set()
