"""KV offloading to host memory (vLLM's ``OffloadingConnector``, ``--kv-offloading-size``)
end to end on CPU.

A tiny device cache (16 blocks of 4 tokens) loses a prompt's prefix to other prompts; the
host pool keeps it, and the prompt's next run loads it. Loaded tokens show in
``RequestOutput.num_cached_tokens`` (prefix-cache hits plus loaded tokens) and in the
scheduler's ``ExternalKV.num_loaded_tokens``. Tiny random fp32 Llama checkpoint, greedy
decoding: every run's tokens must equal those of an engine without offloading.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import add_engine_args, engine_args_from_cli
from pagedlm.kv_cache.hashing import update_block_hashes
from pagedlm.kv_transfer.host_pool import HostBlockIndex
from pagedlm.kv_transfer.offloading_config import host_block_bytes, num_host_blocks
from tiny_checkpoints import random_prompts, save_random_model

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # keys and values, 2 layers, 2 KV heads of 16, fp32
ENGINE = dict(
    skip_tokenizer_init=True,
    max_model_len=64,
    block_size=BLOCK,
    num_kv_blocks=16,
    max_num_batched_tokens=32,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("offloading-llama")
    save_random_model(path, "LlamaConfig", {})
    return str(path)


def offloading(model: str, num_blocks: int, **overrides) -> LLM:
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": num_blocks},
    }
    return LLM(model, kv_transfer_config=transfer, **{**ENGINE, **overrides})


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 6):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def external(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.external


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prefix_evicted_from_the_device_is_loaded_from_host(
    model, async_scheduling, prefix_caching
):
    (first, *others) = random_prompts([21, 21, 21, 21], seed=11)
    reference = LLM(model, **ENGINE)
    expected = tokens(generate(reference, [first])) + tokens(generate(reference, others))
    llm = offloading(
        model,
        64,
        async_scheduling=async_scheduling,
        enable_prefix_caching=prefix_caching,
    )
    outputs = generate(llm, [first])
    assert outputs[0].num_cached_tokens == 0
    # Three more prompts of 7 blocks each (21 tokens + 6 generated) through 16 device
    # blocks: the first prompt's blocks are reused for them.
    outputs += generate(llm, others)
    assert tokens(outputs) == expected
    kv_manager = llm.llm_engine.engine_core.scheduler.kv_manager
    local_hit = kv_manager.get_computed_blocks(llm_request(first)).num_computed_tokens
    assert local_hit < 20  # the device lost (some of) its prefix
    again = generate(llm, [first])
    assert tokens(again) == expected[:1]
    # Every full block but the one holding the last prompt token: 5 blocks, 20 tokens.
    assert again[0].num_cached_tokens == 20
    assert external(llm).num_loaded_tokens == 20 - local_hit
    assert external(llm).num_failed_tokens == 0


def llm_request(prompt: list[int]):
    from pagedlm.core.request import Request

    return Request("probe", list(prompt), SamplingParams(max_tokens=1))


def test_the_pool_keeps_the_most_recently_used_blocks(model):
    """Prompts of 9 tokens store 2 blocks each (the generated tokens fill no block); a pool
    of 6 blocks keeps 3 prompts, and the least recently used one is computed again."""
    prompts = random_prompts([9, 9, 9, 9], seed=12)
    expected = tokens(generate(LLM(model, **ENGINE), prompts, max_tokens=2))
    llm = offloading(model, 6, enable_prefix_caching=False)
    for prompt in prompts:
        generate(llm, [prompt], max_tokens=2)
    connector = external(llm).connector
    assert len(connector.index) == 6 and connector.index.num_evicted == 2  # prompt 0's
    cached = []
    for index in (1, 0, 2, 3):  # 1 loads (now the newest); 0 evicts 2; 2 evicts 3
        (output,) = generate(llm, [prompts[index]], max_tokens=2)
        assert output.outputs[0].token_ids == expected[index]
        cached.append(output.num_cached_tokens)
    assert cached == [8, 0, 0, 0]
    assert external(llm).num_loaded_tokens == 8


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generated_blocks_serve_the_next_turn(model, async_scheduling):
    """A conversation's next prompt holds the previous answer: the blocks its generated
    tokens filled load too."""
    (prompt, more) = random_prompts([10, 5], seed=13)
    reference = LLM(model, **ENGINE)
    (answer,) = tokens(generate(reference, [prompt], max_tokens=8))
    follow_up = prompt + answer[:6] + more  # 16 known tokens, then 5 new ones
    (expected,) = tokens(generate(reference, [follow_up]))
    llm = offloading(model, 64, enable_prefix_caching=False, async_scheduling=async_scheduling)
    assert tokens(generate(llm, [prompt], max_tokens=8)) == [answer]
    (got,) = generate(llm, [follow_up])
    assert got.outputs[0].token_ids == expected
    assert got.num_cached_tokens == 16  # 2 prompt blocks and 2 blocks of the answer


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_block_evicted_between_lookup_and_load_is_computed(model, prefix_caching):
    """The scheduler found the prompt's blocks, then lost the second one before planning
    the load: the load fails from that block on and the request computes the rest."""
    (prompt, *others) = random_prompts([21, 21, 21, 21], seed=14)
    expected = tokens(generate(LLM(model, **ENGINE), [prompt]))
    llm = offloading(model, 64, enable_prefix_caching=prefix_caching)
    generate(llm, [prompt])
    generate(llm, others)  # the device cache loses the prompt's blocks
    connector = external(llm).connector
    lookup = connector.get_num_new_matched_tokens
    lost = []

    def lookup_then_evict(request, num_computed_tokens):
        found = lookup(request, num_computed_tokens)
        if found and not lost:
            second = num_computed_tokens // BLOCK + 1
            lost.append(request.block_hashes[second])
            connector.index.discard(lost[0])
        return found

    connector.get_num_new_matched_tokens = lookup_then_evict
    (got,) = generate(llm, [prompt])
    assert lost and got.outputs[0].token_ids == expected[0]
    local_hit = got.num_cached_tokens - external(llm).num_loaded_tokens
    assert external(llm).num_loaded_tokens == 4  # the block before the lost one
    assert external(llm).num_failed_tokens == 20 - local_hit - 4
    assert lost[0] in connector.index  # computed, then stored again


def test_a_reset_prefix_cache_empties_the_pool(model):
    (prompt,) = random_prompts([13], seed=15)
    llm = offloading(model, 64, enable_prefix_caching=False)
    generate(llm, [prompt])
    assert len(external(llm).connector.index) > 0
    assert llm.reset_prefix_cache()
    assert len(external(llm).connector.index) == 0
    (got,) = generate(llm, [prompt])
    assert got.num_cached_tokens == 0


def test_kv_offloading_size_sizes_the_pool_from_the_block_bytes(model):
    args = EngineArgs(model=model, kv_offloading_size=5.5 * BLOCK_BYTES / 2**30, **ENGINE)
    config, _ = args.create_engine_config()
    transfer = config.kv_transfer
    assert transfer is not None and transfer.kv_connector == "OffloadingConnector"
    assert transfer.kv_role == "kv_both"
    assert host_block_bytes(config) == BLOCK_BYTES
    assert num_host_blocks(config) == 5


def test_a_zero_block_count_beside_a_byte_budget_takes_the_budget(model):
    """Older vLLM configs carry ``num_cpu_blocks: 0`` next to ``cpu_bytes_to_use``."""
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 8 * BLOCK_BYTES, "num_cpu_blocks": 0},
    }
    config, _ = EngineArgs(
        model=model, kv_transfer_config=transfer, **ENGINE
    ).create_engine_config()
    assert num_host_blocks(config) == 8


def test_the_cli_flags_reach_the_engine_config(model):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--model", model, "--block-size", "4", "--kv-offloading-size", "0.5"]
    argv += ["--kv-offloading-backend", "native"]
    args = engine_args_from_cli(parser.parse_args(argv))
    assert args.kv_offloading_size == 0.5 and args.kv_offloading_backend == "native"
    config, _ = args.create_engine_config()
    assert config.kv_transfer is not None
    assert config.kv_transfer.kv_connector == "OffloadingConnector"
    assert config.kv_transfer.kv_connector_extra_config == {"cpu_bytes_to_use": 2**29}
    assert num_host_blocks(config) == 2**29 // BLOCK_BYTES


def with_extra(extra: dict, role: str = "kv_both") -> dict:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_offloading_size": 0}, "positive number of GiB"),
        ({"kv_offloading_size": -1.0}, "positive number of GiB"),
        ({"kv_offloading_size": float("nan")}, "positive number of GiB"),
        ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, "'native'"),
        ({"kv_offloading_backend": "disk"}, "Unknown kv_offloading_backend"),
        (
            {"kv_offloading_size": 1.0, "kv_transfer_config": with_extra({"num_cpu_blocks": 4})},
            "drop kv_transfer_config",
        ),
        ({"kv_offloading_size": 1e-9}, "raise kv_offloading_size"),
        ({"kv_transfer_config": with_extra({})}, "cpu_bytes_to_use"),
        (
            {"kv_transfer_config": with_extra({"num_cpu_blocks": 4, "cpu_bytes_to_use": 8192})},
            "one of them",
        ),
        ({"kv_transfer_config": with_extra({"num_cpu_blocks": 2.5})}, "whole number"),
        ({"kv_transfer_config": with_extra({"num_cpu_blocks": 4, "block_size": 8})}, "block_size"),
        (
            {"kv_transfer_config": with_extra({"num_cpu_blocks": 4, "eviction_policy": "arc"})},
            "'lru'",
        ),
        ({"kv_transfer_config": with_extra({"num_cpu_blocks": 4, "disk": 1})}, "known"),
        (
            {"kv_transfer_config": with_extra({"num_cpu_blocks": 4}, role="kv_producer")},
            "kv_both",
        ),
    ],
)
def test_bad_offloading_options_are_refused_naming_the_fix(model, overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=model, **{**ENGINE, **overrides}).create_engine_config()


def test_the_index_evicts_the_least_recently_used_digest():
    index = HostBlockIndex(2)
    first, second, third = b"a", b"b", b"c"
    assert index.store(first) is not None and index.store(second) is not None
    assert index.store(first) is None  # held: touched, not stored again
    slot = index.get(second)
    assert index.store(third) == slot  # the second was the least recently used
    assert second not in index and index.num_evicted == 1
    index.touch([first])
    index.store(second)
    assert first in index and third not in index
    index.discard(first)
    assert index.store(third) is not None and len(index) == 2
    index.reset()
    assert len(index) == 0


def test_digests_match_the_prefix_cache(model):
    """The pool is keyed by the prefix cache's chained digests (an adapter, salt or image
    changes them exactly as it changes the prefix cache's)."""
    (prompt,) = random_prompts([9], seed=16)
    llm = offloading(model, 64, enable_prefix_caching=False)
    generate(llm, [prompt], max_tokens=2)
    request = llm_request(prompt)
    digests = update_block_hashes(request, BLOCK)
    assert all(digest in external(llm).connector.index for digest in digests)


@pytest.mark.parametrize("async_scheduling,delay", [(False, 36), (True, 35)])
def test_a_loaded_prompt_never_stalls_a_request_that_needs_its_blocks(
    model, async_scheduling, delay
):
    """A long generation fills the cache while a prompt loads its evicted prefix from the
    host into the remaining blocks; the generation needs one more block the very next step.
    The loaded prompt gives its blocks back (to load or hit them again later) instead of
    holding them while the generation, preempted, waits for them at the head of the queue."""
    (prompt,) = random_prompts([21], seed=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=56, temperature=0.0, ignore_eos=True)
    reference = LLM(model, **ENGINE)
    expected = tokens(generate(reference, [[1, 2, 3, 4]], max_tokens=56)) + tokens(
        generate(reference, [prompt], max_tokens=4)
    )
    llm = offloading(model, 64, async_scheduling=async_scheduling)
    generate(llm, [prompt], max_tokens=2)
    generate(llm, random_prompts([21, 21, 21], seed=4), max_tokens=2)  # evicts its blocks
    engine = llm.llm_engine
    engine.add_request("long", {"prompt_token_ids": [1, 2, 3, 4]}, long_params)
    for _ in range(delay):
        engine.step()
    engine.add_request("loads", {"prompt_token_ids": prompt}, params)
    finished = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert not engine.has_unfinished_requests(), "no progress"
    assert [finished["long"].outputs[0].token_ids, finished["loads"].outputs[0].token_ids] == (
        expected
    )
    assert external(llm).num_loaded_tokens > 0


def test_an_adapter_id_reused_for_another_adapter_loads_none_of_the_old_ones_blocks(
    model, tmp_path
):
    """After ``remove_lora`` the id may name another adapter: its prompts must not load
    the blocks the first adapter computed under that id."""
    from pagedlm.lora.request import LoRARequest
    from peft_adapters import LLAMA_MODULES, make_adapter

    for name, seed in (("first", 0), ("second", 1)):
        make_adapter(Path(model), tmp_path / name, LLAMA_MODULES, rank=8, seed=seed)
    first, second = (LoRARequest(n, 1, str(tmp_path / n)) for n in ("first", "second"))
    (prompt,) = random_prompts([17], seed=17)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    lora = dict(enable_lora=True, max_lora_rank=8, enable_prefix_caching=False)

    def run(llm: LLM, adapter: LoRARequest):
        request = {"prompt_token_ids": prompt}
        (output,) = llm.generate([request], params, lora_request=adapter, use_tqdm=False)
        return output

    expected = run(LLM(model, **ENGINE, **lora), second).outputs[0].token_ids
    llm = offloading(model, 64, **lora)
    run(llm, first)
    assert llm.llm_engine.remove_lora(1)
    output = run(llm, second)
    assert output.outputs[0].token_ids == expected
    assert output.num_cached_tokens == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_new_weights_while_a_loaded_request_waits_forget_its_blocks(
    model, tmp_path, async_scheduling
):
    """Paused with its cache kept, a request whose prefix was loaded from the pool waits
    holding those blocks; new weights must not leave them (or the pool's copies) to be read:
    after the update it generates what a fresh engine on the new weights does."""
    other = tmp_path / "other"
    save_random_model(other, "LlamaConfig", {"initializer_range": 0.5})
    (first, *others) = random_prompts([21, 21, 21, 21], seed=11)
    expected = tokens(generate(LLM(str(other), **ENGINE), [first]))
    llm = offloading(model, 64, async_scheduling=async_scheduling)
    generate(llm, [first] + others)  # first's blocks leave the device for the pool
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    engine.add_request("r", {"prompt_token_ids": first}, SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True))  # fmt: skip
    engine.step()  # its load step: it waits holding the loaded blocks
    core.pause("keep", clear_cache=False)  # (collects the load where steps run ahead)
    assert external(llm).num_loaded_tokens >= 20
    llm.update_weights_from_disk(str(other))
    core.resume()
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [list(finished[0].outputs[0].token_ids)] == expected


def test_a_latent_cache_is_offloaded_once_per_layer(tmp_path):
    """DeepSeek's latent cache (one tensor per layer, keys that are the values) goes
    through the pool as one tensor: the pool holds it once, and a prefix evicted from the
    device comes back from it with the tokens of an engine without offloading."""
    from model_executor.test_zoo_models_deepseek import CASES, save_deepseek

    save_deepseek(tmp_path, *CASES["v3"], cache_head_dim=False)
    model = str(tmp_path)
    (first, *others) = random_prompts([21, 21, 21, 21], seed=11)
    reference = LLM(model, **ENGINE)
    expected = tokens(generate(reference, [first])) + tokens(generate(reference, others))
    llm = offloading(model, 64)
    outputs = generate(llm, [first]) + generate(llm, others)
    assert tokens(outputs) == expected
    again = generate(llm, [first])
    assert tokens(again) == expected[:1]
    assert external(llm).num_loaded_tokens > 0 and external(llm).num_failed_tokens == 0
    connector = llm.llm_engine.engine_core.executor.worker.model_runner.kv_connector
    assert connector._store.values is connector._store.keys


def test_a_latent_model_sizes_the_pool_from_its_latent_blocks(tmp_path, monkeypatch):
    """The pool's block count is decided from the configuration: for a DeepSeek model its
    latent cache's one tensor per layer (unless PAGEDLM_MLA_DISABLE=1), so a byte budget
    buys as many latent blocks as it holds. A worker whose blocks then turn out larger
    (a backend that keeps latent attention expanded) refuses rather than overspend."""
    import types

    from model_executor.test_zoo_models_deepseek import CASES, KEY_HEAD_DIM, MLA, save_deepseek
    from pagedlm.kv_transfer.base import KVConnectorRole
    from pagedlm.kv_transfer.offloading import OffloadingConnector

    monkeypatch.delenv("PAGEDLM_MLA_DISABLE", raising=False)
    save_deepseek(tmp_path, *CASES["v3"], cache_head_dim=False)
    width = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    latent = MLA["num_hidden_layers"] * BLOCK * width * 4  # one float32 tensor per layer
    expanded = MLA["num_hidden_layers"] * 2 * BLOCK * MLA["num_key_value_heads"] * KEY_HEAD_DIM * 4
    size = 10.5 * latent / 2**30
    config, _ = EngineArgs(
        model=str(tmp_path), kv_offloading_size=size, **ENGINE
    ).create_engine_config()
    assert host_block_bytes(config) == latent and num_host_blocks(config) == 10

    worker = OffloadingConnector(config, KVConnectorRole.WORKER)
    shape = (MLA["num_hidden_layers"], BLOCK, MLA["num_key_value_heads"], KEY_HEAD_DIM)
    expanded_blocks = types.SimpleNamespace(
        block_shape=shape, dtype=torch.float32, shares_values=False
    )
    with pytest.raises(ValueError, match="PAGEDLM_MLA_DISABLE=1"):
        worker.register_kv_caches(expanded_blocks)

    monkeypatch.setenv("PAGEDLM_MLA_DISABLE", "1")
    config, _ = EngineArgs(
        model=str(tmp_path), kv_offloading_size=size, **ENGINE
    ).create_engine_config()
    assert host_block_bytes(config) == expanded
    assert num_host_blocks(config) == int(10.5 * latent) // expanded  # 2 of 10


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_saved_for_a_request_that_failed_are_not_loaded_later(
    model, tmp_path, async_scheduling
):
    """A step that cannot read a request's adapter runs it without, fails it, and has
    already copied the blocks it computed to the pool under the adapter's digests; the
    connector is told (``request_finished`` of a request whose status is
    ``FINISHED_ERROR``) and forgets them, so the adapter's next request, readable again,
    computes its prompt rather than load keys and values of the base model."""
    from pagedlm.engine.exceptions import RequestFailedError
    from pagedlm.lora.request import LoRARequest
    from peft_adapters import LLAMA_MODULES, make_adapter

    for name, seed in (("x", 3), ("x_ref", 3), ("y", 4)):  # x_ref: x's weights elsewhere
        make_adapter(Path(model), tmp_path / name, LLAMA_MODULES, rank=8, seed=seed)
    names = ["x", "y", "x_ref"]
    x, y, x_ref = (LoRARequest(n, i, str(tmp_path / n)) for i, n in enumerate(names, 1))
    (prompt,) = random_prompts([17], seed=18)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    lora = dict(enable_lora=True, max_lora_rank=8, max_loras=1, max_cpu_loras=1)

    def run(llm: LLM, adapter: LoRARequest):
        request = {"prompt_token_ids": prompt}
        (output,) = llm.generate([request], params, lora_request=adapter, use_tqdm=False)
        return output

    expected = run(LLM(model, **ENGINE, **lora), x_ref).outputs[0].token_ids
    llm = offloading(model, 64, async_scheduling=async_scheduling, **lora)
    engine = llm.llm_engine
    assert engine.add_lora(x) and engine.add_lora(y)  # max_cpu_loras=1: x left the host
    (tmp_path / "x").rename(tmp_path / "x_away")
    with pytest.raises(RequestFailedError, match="could not be read"):
        run(llm, x)
    assert external(llm).connector.num_saved_blocks > 0  # its step saved them first
    (tmp_path / "x_away").rename(tmp_path / "x")
    output = run(llm, x)
    assert output.outputs[0].token_ids == expected
    assert output.num_cached_tokens == 0 and external(llm).num_loaded_tokens == 0


def test_prefix_cache_hits_are_stored_again_once_the_pool_lost_them(model):
    """A prompt whose blocks left the pool but not the device cache hits them locally; its
    request stores them again (vLLM's connector stores every block the pool lacks, not only
    those the request computes), so once the device loses them too the pool serves them."""
    (prompt, *others) = random_prompts([9, 9, 9], seed=19)
    (expected,) = tokens(generate(LLM(model, **ENGINE), [prompt], max_tokens=2))
    llm = offloading(model, 4, enable_prefix_caching=True)  # 2 prompts of 2 blocks
    generate(llm, [prompt], max_tokens=2)
    generate(llm, others, max_tokens=2)  # the pool drops the prompt's blocks
    index = external(llm).connector.index
    digests = update_block_hashes(llm_request(prompt), BLOCK)
    assert not any(digest in index for digest in digests)
    (hit,) = generate(llm, [prompt], max_tokens=2)
    assert hit.num_cached_tokens == 8 and external(llm).num_loaded_tokens == 0  # device hits
    assert all(digest in index for digest in digests)
    assert llm.llm_engine.engine_core.scheduler.kv_manager.reset_prefix_cache()  # device only
    (again,) = generate(llm, [prompt], max_tokens=2)
    assert again.outputs[0].token_ids == expected
    assert again.num_cached_tokens == 8 and external(llm).num_loaded_tokens == 8
