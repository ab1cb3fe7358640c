"""The shared-storage KV connector (vLLM's ``ExampleConnector``) end to end on CPU.

A producer engine computes prompts and stores their blocks; a fresh consumer engine over
the same directory loads them instead of computing them. The loaded tokens are reported as
vLLM reports them, in ``RequestOutput.num_cached_tokens`` (local prefix-cache hits plus
loaded tokens), and counted by the scheduler's ``ExternalKV.num_loaded_tokens``. Tiny random
fp32 Llama checkpoint, greedy decoding: the consumer's tokens must equal the producer's.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.config import EngineConfig, KVTransferConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import add_engine_args, engine_args_from_cli
from pagedlm.kv_cache.hashing import hash_block_tokens
from pagedlm.kv_transfer.model_identity import model_digest
from pagedlm.kv_transfer.shared_storage import SharedStorageConnector, storage_dir
from tiny_checkpoints import random_prompts, save_random_model

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
ENGINE = dict(
    skip_tokenizer_init=True,
    max_model_len=96,
    block_size=BLOCK,
    num_kv_blocks=96,
    max_num_batched_tokens=32,
    enable_prefix_caching=False,  # every load below comes from storage, not local hits
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("kv-transfer-llama")
    save_random_model(path, "LlamaConfig", {})
    return str(path)


def engine(model: str, storage, role: str | None, **overrides) -> LLM:
    transfer = None
    if role is not None:
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    return LLM(model, kv_transfer_config=transfer, **{**ENGINE, **overrides})


def generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def loaded_tokens(llm: LLM) -> int:
    return llm.llm_engine.engine_core.scheduler.external.num_loaded_tokens


def stored_blocks(prompt: list[int]) -> list[str]:
    """The file names (block digests) of a plain prompt's full blocks."""
    keys, parent = [], None
    for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
        parent = hash_block_tokens(parent, prompt[start : start + BLOCK])
        keys.append(parent.hex())
    return keys


def block_file(llm: LLM, prompt: list[int], index: int):
    config: EngineConfig = llm.llm_engine.config
    return storage_dir(config) / f"{stored_blocks(prompt)[index]}.safetensors"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_consumer_loads_what_the_producer_saved(model, tmp_path, async_scheduling):
    prompts = random_prompts([21, 9, 40, 3])
    producer = engine(model, tmp_path, "kv_producer")
    expected = generate(producer, prompts)
    assert [o.num_cached_tokens for o in expected] == [0, 0, 0, 0]
    # Every full prompt block was saved (the 3-token prompt has none).
    saved = sorted(p.name for p in storage_dir(producer.llm_engine.config).iterdir())
    assert saved == sorted(f"{k}.safetensors" for p in prompts for k in stored_blocks(p))
    del producer

    consumer = engine(model, tmp_path, "kv_consumer", async_scheduling=async_scheduling)
    got = generate(consumer, prompts)
    assert tokens(got) == tokens(expected)
    # All full blocks but the one holding the last prompt token (it must be computed).
    want = [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
    assert [o.num_cached_tokens for o in got] == want == [20, 8, 36, 0]
    assert loaded_tokens(consumer) == sum(want)


def test_a_shared_prefix_loads_only_the_stored_part(model, tmp_path):
    (stored,) = random_prompts([20], seed=3)
    (other,) = random_prompts([11], seed=4)
    prompt = stored[:13] + other  # shares 3 full blocks (12 tokens) and one more token
    producer = engine(model, tmp_path, "kv_producer")
    generate(producer, [stored])
    reference = generate(engine(model, tmp_path, None), [prompt])
    consumer = engine(model, tmp_path, "kv_consumer")
    got = generate(consumer, [prompt])
    assert tokens(got) == tokens(reference)
    assert got[0].num_cached_tokens == 12
    assert loaded_tokens(consumer) == 12


def test_kv_both_saves_then_loads_in_one_engine(model, tmp_path):
    (prompt,) = random_prompts([17], seed=5)
    llm = engine(model, tmp_path, "kv_both")
    first = generate(llm, [prompt])
    second = generate(llm, [prompt])  # no prefix caching: the blocks come from storage
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == 16
    assert tokens(first) == tokens(second)


def test_missing_and_corrupt_blocks_are_computed(model, tmp_path):
    prompts = random_prompts([22, 18, 13], seed=6)
    producer = engine(model, tmp_path, "kv_producer")
    expected = generate(producer, prompts)
    block_file(producer, prompts[0], 2).write_bytes(b"\x00garbage")  # unreadable
    block_file(producer, prompts[1], 1).unlink()  # gone
    corrupt = block_file(producer, prompts[2], 0)
    data = bytearray(corrupt.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the values: readable, but its digest differs
    corrupt.write_bytes(bytes(data))

    consumer = engine(model, tmp_path, "kv_consumer")
    got = generate(consumer, prompts)
    assert tokens(got) == tokens(expected)
    # The blocks before the first bad one load; the rest are computed.
    assert [o.num_cached_tokens for o in got] == [8, 4, 0]
    # A missing file is a miss at lookup (only block 0 of the second prompt is planned);
    # unreadable and corrupt ones fail at load, with every block planned after them.
    external = consumer.llm_engine.engine_core.scheduler.external
    assert external.num_failed_tokens == (20 - 8) + 0 + 12
    assert external.num_loaded_tokens == 8 + 4


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_deleted_block_between_lookup_and_load_is_computed(model, tmp_path, prefix_caching):
    """The scheduler saw the file, the worker did not find it: the load fails late, the
    request is computed, and requests in the same steps are untouched; with prefix caching,
    the same prompt twice in one batch loads twice (a block is indexed only once loaded)."""
    prompts = random_prompts([21, 15], seed=7)
    prompts.append(prompts[0])
    producer = engine(model, tmp_path, "kv_producer")
    expected = generate(producer, prompts)
    consumer = engine(model, tmp_path, "kv_consumer", enable_prefix_caching=prefix_caching)
    connector = consumer.llm_engine.engine_core.executor.worker.model_runner.kv_connector
    doomed = block_file(consumer, prompts[0], 1)
    start_load_kv = connector.start_load_kv

    def delete_then_load(metadata):
        doomed.unlink(missing_ok=True)
        start_load_kv(metadata)

    connector.start_load_kv = delete_then_load
    got = generate(consumer, prompts)
    assert tokens(got) == tokens(expected)
    assert [o.num_cached_tokens for o in got] == [4, 12, 4]


class CountingConnector(SharedStorageConnector):
    """A third-party connector, found through ``kv_connector_module_path``."""

    num_loads = 0

    def start_load_kv(self, metadata):
        CountingConnector.num_loads += len(metadata.loads)
        super().start_load_kv(metadata)


def test_a_connector_from_a_module_path(model, tmp_path):
    (prompt,) = random_prompts([13], seed=8)
    generate(engine(model, tmp_path, "kv_producer"), [prompt])
    transfer = KVTransferConfig(
        kv_connector="CountingConnector",
        kv_connector_module_path=__name__,
        kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    llm = LLM(model, kv_transfer_config=transfer, **ENGINE)
    got = generate(llm, [prompt])
    assert got[0].num_cached_tokens == 12
    assert CountingConnector.num_loads == 1


@pytest.mark.parametrize(
    ("transfer", "message"),
    [
        ({"kv_connector": "ExampleConnector"}, "no kv_role"),
        ({"kv_connector": "ExampleConnector", "kv_role": "both"}, "Unsupported kv_role"),
        ({"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_ip": "x"}, "kv_ip"),
        ({"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}, "ExampleConnector"),
        (
            {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "fail",
            },
            "recompute",
        ),
        (
            {
                "kv_connector": "SharedStorageConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"storage_path": "/tmp"},
            },
            "shared_storage_path",
        ),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_config_is_refused_naming_the_fix(model, transfer, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=model, kv_transfer_config=transfer, **ENGINE).create_engine_config()


def test_unknown_keys_are_listed_with_the_known_ones():
    with pytest.raises(ValueError) as error:
        KVTransferConfig.parse({"kv_connector": "ExampleConnector", "kv_port": 1})
    assert "kv_port" in str(error.value) and "kv_connector_extra_config" in str(error.value)


def test_the_cli_flag_reaches_the_engine_config(model, tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flag = (
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer", '
        f'"kv_connector_extra_config": {{"shared_storage_path": "{tmp_path}"}}}}'
    )
    args = engine_args_from_cli(
        parser.parse_args(["--model", model, "--kv-transfer-config", flag, "--block-size", "4"])
    )
    config, _ = args.create_engine_config()
    assert config.kv_transfer is not None
    assert config.kv_transfer.kv_role == "kv_consumer"
    assert config.kv_transfer.is_kv_consumer and not config.kv_transfer.is_kv_producer
    assert config.kv_transfer.kv_connector_extra_config == {"shared_storage_path": str(tmp_path)}


def perturbed_copy(model: str, target) -> str:
    """``model``'s config with other weights (a fine-tune of the same base, say)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, target)
    weights = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    for name, tensor in weights.items():
        if "proj" in name:
            weights[name] = tensor + 0.08 * torch.randn(tensor.shape, generator=generator)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return str(target)


def test_checkpoints_of_the_same_name_and_config_do_not_share_blocks(model, tmp_path):
    other = perturbed_copy(model, tmp_path / "orgB" / Path(model).name)
    prompts = random_prompts([17, 21], seed=9)
    expected = tokens(generate(engine(other, tmp_path, None), prompts))
    generate(engine(model, tmp_path / "kv", "kv_producer"), prompts)
    consumer = engine(other, tmp_path / "kv", "kv_consumer")
    assert tokens(generate(consumer, prompts)) == expected
    assert loaded_tokens(consumer) == 0


def digest(model: str, **overrides) -> str:
    config, _ = EngineArgs(model=model, **{**ENGINE, **overrides}).create_engine_config()
    return model_digest(config)


def test_the_model_digest_names_the_weights(model, tmp_path):
    copy = shutil.copytree(model, tmp_path / "copy")
    assert digest(model) == digest(model)
    assert digest(str(copy)) != digest(model)  # another path: maybe other weights
    weights = copy / "model.safetensors"
    before = digest(str(copy))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert digest(str(copy)) != before  # rewritten in place
    dummy = digest(model, load_format="dummy")
    assert dummy != digest(model)
    assert digest(model, load_format="dummy", seed=1) != dummy


def test_updating_the_weights_is_refused_naming_the_fix(model, tmp_path):
    """The storage directory is named for the weights the engine started with: the new
    weights' KV must be neither loaded from it nor stored in it."""
    other = perturbed_copy(model, tmp_path / "new")
    llm = engine(model, tmp_path / "kv", "kv_both")
    with pytest.raises(ValueError, match="Start an engine on the new checkpoint"):
        llm.llm_engine.update_weights_from_disk(other)
    (prompt,) = random_prompts([9], seed=10)
    assert generate(llm, [prompt])[0].num_cached_tokens == 0  # still serving the old weights


def test_requests_with_an_adapter_neither_save_nor_load(model, tmp_path):
    """An adapter's id and path name it only within one engine: here the consumer runs
    other weights under the producer's id and path."""
    from pagedlm.lora.request import LoRARequest
    from peft_adapters import LLAMA_MODULES, make_adapter

    adapter = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    (prompt,) = random_prompts([17], seed=11)
    lora = dict(enable_lora=True, max_lora_rank=8)

    def run(llm: LLM):
        request = {"prompt_token_ids": prompt}
        return llm.generate([request], GREEDY, lora_request=adapter, use_tqdm=False)

    make_adapter(Path(model), tmp_path / "adapter", LLAMA_MODULES, rank=8, seed=0)
    producer = engine(model, tmp_path / "kv", "kv_producer", **lora)
    run(producer)
    assert not any(storage_dir(producer.llm_engine.config).iterdir())
    shutil.rmtree(tmp_path / "adapter")
    make_adapter(Path(model), tmp_path / "adapter", LLAMA_MODULES, rank=8, seed=1)
    expected = tokens(run(engine(model, tmp_path, None, **lora)))
    consumer = engine(model, tmp_path / "kv", "kv_consumer", **lora)
    assert tokens(run(consumer)) == expected
    assert loaded_tokens(consumer) == 0


def test_a_block_whose_save_failed_is_saved_by_a_later_step(model, tmp_path, monkeypatch):
    import safetensors.torch

    write = safetensors.torch.save_file
    failures = []

    def failing_once(tensors, filename, metadata=None):
        if not failures:
            failures.append(filename)
            raise OSError(28, "No space left on device")
        write(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_once)
    (prompt,) = random_prompts([13], seed=12)
    producer = engine(model, tmp_path, "kv_producer")
    generate(producer, [prompt])
    connector = producer.llm_engine.engine_core.scheduler.external.connector
    assert failures and connector.num_failed_saves == 1 and connector.num_saved_blocks == 2
    generate(producer, [prompt])  # the prompt again: its missing block is written now
    assert connector.num_saved_blocks == 3
    assert all(block_file(producer, prompt, index).is_file() for index in range(3))


def test_the_scheduler_remembers_stored_blocks_within_a_bound(tmp_path):
    from pagedlm.kv_transfer.stored_blocks import StoredBlocks

    on_disk = {"a", "b", "c"}
    looked_up = []

    def exists(key: str) -> bool:
        looked_up.append(key)
        return key in on_disk

    stored = StoredBlocks(exists, lambda key: None, max_remembered=2)
    assert stored.is_stored("a") and stored.is_stored("b") and stored.is_stored("c")
    assert len(stored) == 2  # "a" forgotten
    looked_up.clear()
    assert stored.is_stored("c") and looked_up == []
    assert stored.is_stored("a") and looked_up == ["a"]  # on disk again

    assert stored.plan_save("d") and not stored.plan_save("d")  # one writer
    stored.end_step()
    assert stored.plan_save("e")
    stored.end_step()
    stored.saved(num_failed=0)  # "d" written
    assert stored.is_stored("d")
    stored.saved(num_failed=1)  # "e" not written: planned again
    assert stored.plan_save("e")


def test_a_latent_cache_is_stored_once_and_loaded(tmp_path):
    """DeepSeek's latent cache (keys that are the values) goes to storage as ``key``
    alone, and a consumer loads it into the same tokens as the producer computed."""
    from safetensors import safe_open

    from model_executor.test_zoo_models_deepseek import CASES, save_deepseek

    path = tmp_path / "deepseek"
    save_deepseek(path, *CASES["v3"], cache_head_dim=False)
    prompts = random_prompts([21, 9])
    producer = engine(str(path), tmp_path / "kv", "kv_producer")
    expected = generate(producer, prompts)
    with safe_open(str(block_file(producer, prompts[0], 0)), framework="pt") as stored:
        assert list(stored.keys()) == ["key"]
    del producer
    consumer = engine(str(path), tmp_path / "kv", "kv_consumer")
    got = generate(consumer, prompts)
    assert tokens(got) == tokens(expected)
    assert loaded_tokens(consumer) == 20 + 8


def test_blocks_hit_in_the_prefix_cache_are_saved_for_other_engines(model, tmp_path):
    """A conversation's next prompt holds the previous answer, whose blocks the producer
    computed as generated tokens (never saved: only prompt blocks are) and now hits in its
    own prefix cache. It saves them then, as vLLM's connector saves every prompt block the
    store lacks, so another engine loads the whole conversation, not only its first prompt."""
    (prompt, more) = random_prompts([10, 5], seed=13)
    producer = engine(model, tmp_path, "kv_producer", enable_prefix_caching=True)
    (first,) = producer.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    follow_up = prompt + first.outputs[0].token_ids[:6] + more  # 16 known tokens, then 5
    (hit,) = generate(producer, [follow_up])
    assert hit.num_cached_tokens == 16  # the first turn's blocks, prompt and answer
    consumer = engine(model, tmp_path, "kv_consumer")
    (got,) = generate(consumer, [follow_up])
    assert got.outputs[0].token_ids == hit.outputs[0].token_ids
    assert got.num_cached_tokens == 20 and loaded_tokens(consumer) == 20


def test_an_invalidated_block_is_removed_once_its_write_is_reported():
    from pagedlm.kv_transfer.stored_blocks import StoredBlocks

    on_disk: set[str] = set()
    stored = StoredBlocks(on_disk.__contains__, on_disk.discard)
    assert stored.plan_save("a") and stored.plan_save("b")
    stored.end_step()
    on_disk.update({"a", "b"})
    stored.saved(num_failed=0)
    assert stored.plan_save("c")  # written by the step in flight
    stored.end_step()
    stored.invalidate(["a", "c"])
    assert on_disk == {"b"}  # "a" at once
    on_disk.add("c")  # the step in flight writes it after all
    assert not stored.plan_save("c")  # its write is still in flight
    stored.saved(num_failed=0)
    assert on_disk == {"b"} and not stored.is_stored("c") and not stored.is_stored("a")
    assert stored.is_stored("b")
    assert stored.plan_save("a") and stored.plan_save("c")  # computed again, written again


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_blocks_of_a_request_that_fails_are_removed(model, tmp_path, async_scheduling):
    """A request that fails in a step (here its logits processor raises; a step that cannot
    read a LoRA adapter fails its requests the same way) may have had its blocks written
    with keys and values its digests do not promise: the connector is told
    (``request_finished`` of a request whose status is ``FINISHED_ERROR``) and removes what
    it wrote for it, so no engine loads them. Other requests' blocks stay."""
    from pagedlm.engine.exceptions import RequestFailedError
    from sample.logits_processor_examples import RaiseAt

    failing, other = random_prompts([17, 13], seed=14)
    producer = engine(
        model,
        tmp_path,
        "kv_producer",
        logits_processors=[RaiseAt],
        async_scheduling=async_scheduling,
    )
    raising = SamplingParams(max_tokens=3, temperature=0.0, extra_args={"raise_at": 0})
    with pytest.raises(RequestFailedError, match="boom"):
        producer.generate(
            [{"prompt_token_ids": failing}, {"prompt_token_ids": other}],
            [raising, GREEDY],
            use_tqdm=False,
        )
    connector = producer.llm_engine.engine_core.scheduler.external.connector
    assert connector.num_saved_blocks == 4 + 3  # written first, then removed
    assert not any(block_file(producer, failing, index).exists() for index in range(4))
    assert all(block_file(producer, other, index).is_file() for index in range(3))


def test_a_block_whose_file_went_is_written_again_by_the_request_that_computes_it(model, tmp_path):
    """A stored block's file removed behind the engine's back (the store evicted it): the
    scheduler still remembered it stored, planned a load that failed, and never wrote it
    again, so every later prompt computed it. A failed load now makes the scheduler look
    the block up on disk again, and the request that computes it writes it."""
    (prompt,) = random_prompts([17], seed=15)
    llm = engine(model, tmp_path, "kv_both")
    (first,) = generate(llm, [prompt])
    gone = block_file(llm, prompt, 1)
    gone.unlink()
    (second,) = generate(llm, [prompt])  # loads block 0, computes blocks 1 to 3
    assert second.num_cached_tokens == 4 and second.outputs == first.outputs
    assert gone.is_file()
    (third,) = generate(llm, [prompt])
    assert third.num_cached_tokens == 16 and third.outputs == first.outputs
