"""Replacing a running engine's weights (SGLang's ``update_weights_from_disk`` /
``update_weights_from_tensor``): afterwards the engine generates exactly what an engine
started on the new weights does (cached prefixes of the old weights forgotten); what
cannot be updated is refused before anything is unloaded, and a failed load brings the
old weights back. Offline, and over HTTP."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.entrypoints.openai.admin import AdminOptions
from server.server_utils import in_process_app, write_chat_checkpoint

PROMPTS = [[5, 9, 2, 77, 31, 8, 100, 3, 3, 64, *range(12, 40)], [42, 7]]  # 38: two blocks
PARAMS = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, ignore_eos=True)


def _perturbed(source, target) -> dict[str, torch.Tensor]:
    """A copy of the checkpoint at ``source`` with other weights, saved at ``target``;
    returns the new state dict (checkpoint names)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _run(llm: LLM) -> list:
    """Greedy tokens (prompts that hit the prefix cache when run twice) and, from another
    request, prompt logprobs (which never read the prefix cache)."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, plain, use_tqdm=False)]
    scored = llm.generate(prompts[:1], PARAMS, use_tqdm=False)[0]
    logprobs = [
        round(scored.prompt_logprobs[i][t].logprob, 4)
        for i, t in enumerate(scored.prompt_token_ids)
        if i
    ]
    return [tokens, logprobs]


def _llm(path) -> LLM:
    return LLM(
        str(path), skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=64,
        enable_sleep_mode=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    old = tiny_checkpoint("llama")
    new = tmp_path_factory.mktemp("updated")
    new_state = _perturbed(old, new)
    references = {}
    for name, path in (("old", old), ("new", new)):
        llm = _llm(path)
        references[name] = _run(llm)
        llm.llm_engine.shutdown()
    assert references["old"] != references["new"]
    return old, new, new_state, references


def test_from_disk_then_from_tensor_generate_as_fresh_engines(checkpoints) -> None:
    old, new, new_state, references = checkpoints
    llm = _llm(old)
    try:
        assert _run(llm) == references["old"]  # its prompts' blocks are now cached
        llm.update_weights_from_disk(str(new))
        assert _run(llm) == references["new"]
        llm.sleep(level=2)
        llm.wake_up()  # a level-2 wake-up reads the checkpoint it was updated from
        assert _run(llm) == references["new"]
        from transformers import AutoModelForCausalLM

        old_state = AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32).state_dict()
        llm.update_weights_from_tensor(old_state)
        assert _run(llm) == references["old"]
        llm.update_weights_from_tensor(list(new_state.items()))
        assert _run(llm) == references["new"]
    finally:
        llm.llm_engine.shutdown()


def test_weights_replaced_between_waking_the_weights_and_the_kv_cache(checkpoints) -> None:
    """The reinforcement-learning order (vLLM's tags): wake the weights, replace them while
    the KV cache still sleeps, then wake the KV cache."""
    from transformers import AutoModelForCausalLM

    old, new, _, references = checkpoints
    old_state = AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32).state_dict()
    llm = _llm(old)
    worker = llm.llm_engine.engine_core.executor.worker
    try:
        _run(llm)
        for level, update, expected in (
            (1, lambda: llm.update_weights_from_disk(str(new)), "new"),
            (2, lambda: llm.update_weights_from_tensor(old_state), "old"),
        ):
            llm.sleep(level)
            llm.wake_up(tags=["weights"])
            assert worker.sleeping_tags == {"kv_cache"} and llm.llm_engine.is_sleeping()
            update()
            assert worker.model_runner.kv_cache is None  # the new model got no KV cache yet
            llm.wake_up(tags=["kv_cache"])
            assert not llm.llm_engine.is_sleeping()
            assert _run(llm) == references[expected]
    finally:
        llm.llm_engine.shutdown()


def test_what_cannot_be_updated_is_refused_and_a_failed_load_restores(
    checkpoints, tmp_path
) -> None:
    old, new, new_state, references = checkpoints
    wider = tmp_path / "wider"
    shutil.copytree(new, wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    llm = _llm(old)
    engine = llm.llm_engine
    try:
        with pytest.raises(ValueError, match="has intermediate_size=256 where the served"):
            llm.update_weights_from_disk(str(wider))
        with pytest.raises(ValueError, match="does not exist"):
            llm.update_weights_from_disk(str(tmp_path / "absent"))
        engine.add_request("busy", {"prompt_token_ids": PROMPTS[0]}, PARAMS)
        with pytest.raises(ValueError, match="1 requests are unfinished"):
            llm.update_weights_from_disk(str(new))
        engine.abort_request(["busy"])
        while engine.has_unfinished_requests():
            engine.step()
        llm.sleep(level=1)
        with pytest.raises(ValueError, match="asleep; wake_up"):
            llm.update_weights_from_tensor(new_state)
        llm.wake_up()
        partial = {k: v for k, v in new_state.items() if "layers.1." not in k}
        with pytest.raises(ValueError, match=r"did not load .* weights of .* again"):
            llm.update_weights_from_tensor(partial)
        assert _run(llm) == references["old"]
    finally:
        engine.shutdown()


def test_a_gguf_model_takes_no_tensors(tmp_path) -> None:
    from pagedlm.config import ArchConfig, ModelConfig
    from pagedlm.model_executor.loader import _check_float_layers

    arch = ArchConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                    "hidden_size": 8, "num_hidden_layers": 1,
                                    "num_attention_heads": 1, "intermediate_size": 8})  # fmt: skip
    gguf = ModelConfig("model.gguf", None, arch, torch.float32, 16)
    with pytest.raises(ValueError, match="GGUF file's quantized blocks"):
        _check_float_layers(gguf, keep_blocks=True)


def test_over_http_behind_its_flag(tmp_path_factory) -> None:
    old = write_chat_checkpoint(tmp_path_factory.mktemp("chat-old"))
    new = tmp_path_factory.mktemp("chat-new")
    _perturbed(old, new)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip

    async def tokens(client: httpx.AsyncClient) -> list[int]:
        response = await client.post("/v1/completions", json=body)
        return response.json()["choices"][0]["token_ids"]

    async def run(path, admin: AdminOptions) -> list:
        engine, app = in_process_app(path, admin=admin, num_kv_blocks=32, max_model_len=64)
        results = []
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                results.append(await tokens(client))
                update = await client.post(
                    "/update_weights_from_disk", json={"model_path": str(new)}
                )
                results.append((update.status_code, update.json()))
                results.append(await tokens(client))
                bad = await client.post("/update_weights_from_disk", json={"path": "x"})
                results.append((bad.status_code, bad.json()))
        finally:
            engine.shutdown()
        return results

    before, updated, after, bad = asyncio.run(run(old, AdminOptions(enable_weight_updates=True)))
    assert updated[0] == 200 and updated[1]["success"] is True
    assert bad[0] == 400 and "model_path" in bad[1]["error"]["message"]
    (fresh, *_) = asyncio.run(run(new, AdminOptions()))
    assert after == fresh and before != fresh
    _, refused, unchanged, _ = asyncio.run(run(old, AdminOptions()))
    assert refused[0] == 400 and "--enable-weight-updates" in refused[1]["error"]["message"]
    assert unchanged == before
