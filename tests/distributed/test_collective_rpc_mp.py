"""vLLM's worker RPC over two tensor-parallel worker processes (gloo): an extension method
and an importable function run on both ranks and return one result per rank, in rank
order; a weight pushed through the extension reaches every rank's shard; what cannot cross
without pickle is refused before it is sent; a rank's exception names it and the method, a
call past its timeout raises, and after either the engine generates as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from parity import assert_same_run, greedy_run, make_llm, processes_gone
from safetensors.torch import load_file

from pagedlm.worker.rpc import WorkerRpcError
from worker_extensions import EMBEDDING, embedding_shape, rank_plus

TESTS = Path(__file__).resolve().parents[1]
BOUND_S = 60.0
"""Every call here is bounded: a hung worker fails the test instead of stalling it."""


@pytest.fixture(scope="module")
def llm(llama):
    with pytest.MonkeyPatch.context() as patch:
        # Worker processes import the extension by name: put tests/ on their path.
        patch.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
        )
        llm = make_llm(
            llama,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            worker_extension_cls="worker_extensions:RankProbe",
        )
    pids = list(llm.llm_engine.engine_core.executor.worker_pids)
    yield llm
    llm.llm_engine.shutdown()
    assert processes_gone(pids)


def test_an_extension_method_answers_from_every_rank(llm, llama):
    results = llm.collective_rpc("whoami", BOUND_S, args=("hi",), kwargs={"suffix": "?"})
    assert results == [
        {"tag": "hi?", "rank": 0, "class": "RankProbeWorker"},
        {"tag": "hi?", "rank": 1, "class": "RankProbeWorker"},
    ]
    # Each rank holds its own half of the vocabulary's rows.
    [weights] = [load_file(path) for path in Path(llama).glob("*.safetensors")]
    embedding = weights[EMBEDDING]
    half = embedding.shape[0] // 2
    expected = [
        [half, round(float(embedding[0, 0]), 6)],
        [half, round(float(embedding[half, 0]), 6)],
    ]
    assert llm.collective_rpc("embedding_rows", BOUND_S) == expected


def test_functions_cross_by_importable_name(llm):
    assert llm.collective_rpc(rank_plus, BOUND_S, args=(10,)) == [10, 11]
    assert llm.apply_model(embedding_shape) == [[192, 64], [192, 64]]


def test_what_cannot_cross_without_pickle_is_refused_before_sending(llm):
    import torch

    with pytest.raises(TypeError, match="no name another process can import"):
        llm.collective_rpc(lambda worker: worker.rank, BOUND_S)
    with pytest.raises(TypeError, match="no name another process can import"):
        llm.apply_model(lambda model: 1)
    with pytest.raises(TypeError, match=r"cannot send a torch\.Tensor to the workers.*\.tolist"):
        llm.collective_rpc("whoami", BOUND_S, args=(torch.zeros(2),))
    with pytest.raises(WorkerRpcError, match=r"ranks 0, 1: TypeError: .*torch\.Tensor back"):
        llm.collective_rpc("hand_back_a_tensor", BOUND_S)
    assert llm.collective_rpc("whoami", BOUND_S, args=("still",))[1]["rank"] == 1


def test_a_weight_pushed_to_every_rank_changes_the_model(llm, llama_reference):
    assert_same_run(greedy_run(llm), llama_reference)
    sums = llm.collective_rpc("scale_embedding", BOUND_S, args=(3.0,))
    assert len(sums) == 2 and sums[0] != sums[1]  # each rank scaled its own shard
    changed = greedy_run(llm)
    assert [o.prompt_logprobs for o in changed] != [o.prompt_logprobs for o in llama_reference]
    llm.collective_rpc("scale_embedding", BOUND_S, args=(1 / 3.0,))
    assert_same_run(greedy_run(llm), llama_reference, tolerance=1e-4)


def test_a_rank_s_exception_names_it_and_the_engine_goes_on(llm, llama_reference):
    with pytest.raises(
        WorkerRpcError, match=r"'fail_on' failed on worker rank 1: ValueError"
    ) as info:
        llm.collective_rpc("fail_on", BOUND_S, args=(1,))
    assert (info.value.rank, info.value.method) == (1, "fail_on")
    assert "rank 1 refuses" in str(info.value) and "Traceback" in str(info.value)
    with pytest.raises(WorkerRpcError, match=r"ranks 0, 1: AttributeError: .*no method 'nope'"):
        llm.collective_rpc("nope", BOUND_S)
    assert llm.collective_rpc("fail_on", BOUND_S, args=(2,)) == ["fine", "fine"]
    assert_same_run(greedy_run(llm), llama_reference, tolerance=1e-4)


def test_a_call_past_its_timeout_raises_and_its_late_answers_are_dropped(llm, llama_reference):
    with pytest.raises(
        TimeoutError, match=r"'nap': worker ranks \[0, 1\] did not answer within 0.3 s"
    ):
        llm.collective_rpc("nap", timeout=0.3, args=(2.0,))
    # The workers finish the nap first; its answers are not taken for this call's.
    assert llm.collective_rpc("whoami", BOUND_S, args=("after",))[0]["tag"] == "after"
    assert_same_run(greedy_run(llm), llama_reference, tolerance=1e-4)
