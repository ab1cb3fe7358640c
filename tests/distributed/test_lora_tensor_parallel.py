"""LoRA under tensor parallelism: two worker processes (gloo), each holding its shard of
every adapter (B rows of column-parallel layers, A columns of row-parallel ones), give one
worker's tokens and prompt logprobs; the adapters reach the workers over the step codec,
and add/list/remove/pin_lora reach every rank over collective_rpc."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from parity import PROMPTS, assert_same_run, make_llm, processes_gone

from pagedlm import LoRARequest, SamplingParams
from pagedlm.engine.exceptions import RequestFailedError
from peft_adapters import LLAMA_MODULES, make_adapter

TESTS = Path(__file__).resolve().parents[1]
BOUND_S = 60.0
"""Every call here is bounded: a hung worker fails the test instead of stalling it."""


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


def _bounded(call, timeout_s: float = BOUND_S):
    """``call()``'s result or exception, or a failed test if it takes over ``timeout_s``
    (ranks that disagree on a collective hang)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # handed to the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"no answer in {timeout_s} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.slow
def test_an_adapter_one_rank_cannot_read_fails_its_request(llama, tmp_path, monkeypatch):
    """Each rank reads its shard of an adapter itself. An adapter that rank 1 alone cannot
    read when a step needs it ran with the adapter on rank 0 and without it on rank 1, and
    only rank 0 reports a step: the request got wrong tokens silently. The ranks now agree
    (any rank's failure fails the request on every rank, none keeps the adapter), so the
    request ends with "error" naming rank 1 and the adapter's next request, readable again,
    gets the tokens of one worker; an ``add_lora`` that one rank cannot read leaves it on
    no rank."""
    make_adapter(llama, tmp_path / "x", LLAMA_MODULES, rank=8, seed=3)
    make_adapter(llama, tmp_path / "y", LLAMA_MODULES, rank=8, seed=4)
    x, y = (LoRARequest(n, i, str(tmp_path / n)) for i, n in enumerate(["x", "y"], 1))
    z = LoRARequest("z", 3, str(tmp_path / "x"))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[2]}]
    lora = dict(enable_lora=True, max_lora_rank=8, max_loras=1, max_cpu_loras=1)
    single = make_llm(llama, **lora)
    try:
        expected = single.generate(prompts, params, use_tqdm=False, lora_request=[x, None])
    finally:
        single.llm_engine.shutdown()
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    )
    llm = make_llm(
        llama, tensor_parallel_size=2, worker_extension_cls="worker_extensions:RankProbe", **lora
    )
    engine = llm.llm_engine
    pids = list(engine.engine_core.executor.worker_pids)
    try:
        assert engine.add_lora(x) and engine.add_lora(y)  # x left both ranks' host caches
        llm.collective_rpc("break_adapter_reads", BOUND_S, args=(1,))
        with pytest.raises(RequestFailedError) as failure:
            _bounded(lambda: llm.generate(prompts, params, use_tqdm=False, lora_request=[x, None]))
        failed, other = (output.outputs[0] for output in failure.value.outputs)
        assert failed.finish_reason == "error"
        assert "'x' (lora_int_id 1) could not be read" in failed.stop_reason
        assert "cannot be read here (worker rank 1)" in failed.stop_reason
        assert other.token_ids == expected[1].outputs[0].token_ids
        with pytest.raises(ValueError, match="cannot be read here"):
            _bounded(lambda: engine.add_lora(z))
        assert [sorted(ids) for ids in llm.collective_rpc("list_loras", BOUND_S)] == [[2], [2]]
        llm.collective_rpc("mend_adapter_reads", BOUND_S)
        again = _bounded(
            lambda: llm.generate(prompts, params, use_tqdm=False, lora_request=[x, None])
        )
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]
    finally:
        engine.shutdown()
    assert processes_gone(pids)
