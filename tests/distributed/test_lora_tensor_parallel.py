"""LoRA under tensor parallelism: two worker processes (gloo), each holding its shard of
every adapter (B rows of column-parallel layers, A columns of row-parallel ones), give one
worker's tokens and prompt logprobs; the adapters reach the workers over the step codec,
and add/list/remove/pin_lora reach every rank over collective_rpc."""

from __future__ import annotations

import pytest
from parity import PROMPTS, assert_same_run, make_llm, processes_gone

from pagedlm import LoRARequest, SamplingParams
from peft_adapters import LLAMA_MODULES, make_adapter


def _run(path, lora: LoRARequest, **parallel):
    llm = make_llm(path, enable_lora=True, max_loras=2, **parallel)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        loras = [lora, None, lora]
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        executor = llm.llm_engine.engine_core.executor
        return outputs, list(getattr(executor, "worker_pids", []))
    finally:
        llm.llm_engine.shutdown()


def test_lora_over_two_tensor_parallel_ranks(llama, llama_reference, tmp_path):
    make_adapter(llama, tmp_path / "adapter", LLAMA_MODULES, rank=8)
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    single, _ = _run(llama, lora)
    sharded, pids = _run(llama, lora, tensor_parallel_size=2)
    assert_same_run(sharded, single)
    assert single[0].outputs[0].token_ids != llama_reference[0].outputs[0].token_ids
    assert_same_run(single[1:2], llama_reference[1:2])  # the base-model request
    assert len(pids) == 2 and processes_gone(pids)


def test_adapter_management_reaches_every_rank(llama, tmp_path):
    """add/list/remove/pin_lora broadcast to both worker processes (the request crossing
    as its fields), each rank holding the same adapters."""
    loras = []
    for index in (1, 2):
        make_adapter(llama, tmp_path / str(index), LLAMA_MODULES, rank=4, seed=index)
        loras.append(LoRARequest(f"a{index}", index, str(tmp_path / str(index))))
    llm = make_llm(llama, enable_lora=True, max_loras=2, tensor_parallel_size=2)
    engine = llm.llm_engine
    pids = list(engine.engine_core.executor.worker_pids)
    try:
        assert engine.add_lora(loras[1]) and engine.list_loras() == {2}
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, lora_request=loras[0])
        assert engine.list_loras() == {1, 2}
        assert engine.pin_lora(2)
        assert engine.remove_lora(1) and not engine.remove_lora(1)
        assert sorted(map(sorted, llm.collective_rpc("list_loras"))) == [[2], [2]]
        with pytest.raises(ValueError, match="1 is not loaded"):
            engine.pin_lora(1)
    finally:
        engine.shutdown()
    assert processes_gone(pids)
