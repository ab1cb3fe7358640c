"""Sleep mode and weight updates with worker processes (TP=2 on gloo): every rank sleeps,
wakes (all at once, or by vLLM's tags: the weights, then the KV cache) and loads its shard
of a replacement checkpoint (between waking the weights and the KV cache); afterwards the run equals one
worker's on the same weights, and a replacement that fails to load on the ranks brings
every rank back to the old weights."""

from __future__ import annotations

import shutil

import pytest
import torch
from parity import assert_same_run, greedy_run, make_llm, one_worker_run, processes_gone


@pytest.fixture(scope="module")
def replacement(llama, tmp_path_factory):
    """A checkpoint of the tiny Llama's shape with other weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)
    path = tmp_path_factory.mktemp("replacement")
    model.save_pretrained(path)
    return path


def test_ranks_sleep_wake_and_take_new_weights(llama, llama_reference, replacement, tmp_path):
    new_reference = one_worker_run(replacement)
    broken = tmp_path / "broken"
    shutil.copytree(replacement, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()  # the same config.json, no weights: every rank fails to load
    llm = make_llm(llama, tensor_parallel_size=2, enable_sleep_mode=True)
    executor = llm.llm_engine.engine_core.executor
    pids = list(executor.worker_pids)
    try:
        for level in (1, 2):
            llm.sleep(level)
            if level == 1:
                llm.wake_up()
            else:
                with pytest.raises(ValueError, match=r"wake_up\(tags=\['weights'\]\) before"):
                    executor.wake_up(["kv_cache"])  # every rank refuses; none wakes anything
                llm.wake_up(tags=["weights"])
                llm.wake_up(tags=["kv_cache"])
            assert_same_run(greedy_run(llm), llama_reference)
        # The reinforcement-learning order: new weights while the KV cache still sleeps.
        llm.sleep(1)
        llm.wake_up(tags=["weights"])
        llm.update_weights_from_disk(str(replacement))
        llm.wake_up(tags=["kv_cache"])
        assert_same_run(greedy_run(llm), new_reference)
        with pytest.raises(ValueError, match="did not load"):
            llm.update_weights_from_disk(str(broken))
        assert_same_run(greedy_run(llm), new_reference)
        with pytest.raises(NotImplementedError, match="update_weights_from_disk instead"):
            llm.update_weights_from_tensor({"lm_head.weight": torch.zeros(1)})
    finally:
        llm.llm_engine.shutdown()
    assert processes_gone(pids)
