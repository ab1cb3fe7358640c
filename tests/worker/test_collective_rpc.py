"""vLLM's worker RPC with the worker in this process: ``LLM.collective_rpc`` calls a
``worker_extension_cls`` method or a function on the worker, ``LLM.apply_model`` a function
on the model; a weight pushed through it changes what the engine computes; a worker's
exception names the rank and the method and leaves the engine running; a bad extension
fails start-up naming the flag."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import add_engine_args, engine_args_from_cli
from pagedlm.worker.rpc import WorkerRpcError
from worker_extensions import EMBEDDING, RankProbe, embedding_shape

PROMPT = [{"prompt_token_ids": [5, 9, 2, 77, 31, 8, 100, 3]}]
SCORED = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=64, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    llm = _llm(tiny_checkpoint("llama"), worker_extension_cls="worker_extensions:RankProbe")
    yield llm
    llm.llm_engine.shutdown()


def _prompt_logprobs(llm: LLM) -> list[float]:
    output = llm.generate(PROMPT, SCORED, use_tqdm=False)[0]
    return [
        output.prompt_logprobs[i][t].logprob for i, t in enumerate(output.prompt_token_ids) if i
    ]


def test_an_extension_method_runs_on_the_worker(llm):
    results = llm.collective_rpc("whoami", args=("hello",), kwargs={"suffix": "!"})
    assert results == [{"tag": "hello!", "rank": 0, "class": "RankProbeWorker"}]
    assert llm.llm_engine.collective_rpc("whoami", None, ("engine",))[0]["tag"] == "engine"


def test_a_function_takes_the_worker_and_any_values_in_process(llm):
    tensor = torch.arange(3)
    results = llm.collective_rpc(lambda worker, t: (worker.rank, t * 2), args=(tensor,))
    assert len(results) == 1 and results[0][0] == 0
    assert torch.equal(results[0][1], tensor * 2)  # in process: no encoding at all
    worker = llm.llm_engine.engine_core.executor.worker
    assert llm.collective_rpc(lambda w: w) == [worker]


def test_apply_model(llm):
    assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"]
    assert llm.apply_model(embedding_shape) == [[384, 64]]


def test_a_weight_pushed_through_the_extension_changes_the_model(llm):
    before = _prompt_logprobs(llm)
    [doubled_sum] = llm.collective_rpc("scale_embedding", args=(2.0,))
    weight = llm.apply_model(lambda model: dict(model.named_parameters())[EMBEDDING])[0]
    assert doubled_sum == pytest.approx(float(weight.sum()), abs=1e-2)
    changed = _prompt_logprobs(llm)
    assert max(abs(a - b) for a, b in zip(changed, before)) > 1e-3
    llm.collective_rpc("scale_embedding", args=(0.5,))
    assert _prompt_logprobs(llm) == pytest.approx(before, abs=1e-5)


def test_a_worker_exception_names_rank_and_method_and_the_engine_goes_on(llm):
    before = _prompt_logprobs(llm)
    with pytest.raises(
        WorkerRpcError, match=r"'fail_on' failed on worker rank 0: ValueError"
    ) as info:
        llm.collective_rpc("fail_on", args=(0,))
    assert (info.value.rank, info.value.method) == (0, "fail_on")
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(WorkerRpcError, match=r"ZeroDivisionError"):
        llm.collective_rpc(lambda worker: 1 / 0)
    with pytest.raises(WorkerRpcError, match=r"has no method 'no_such_method'.*--worker-extension"):
        llm.collective_rpc("no_such_method")
    assert llm.collective_rpc("fail_on", args=(1,)) == ["fine"]
    assert _prompt_logprobs(llm) == pytest.approx(before, abs=1e-6)


def test_the_caller_s_mistakes_are_refused_before_the_worker(llm):
    with pytest.raises(ValueError, match="timeout=0"):
        llm.collective_rpc("whoami", timeout=0, args=("x",))
    with pytest.raises(TypeError, match="method's name or a function"):
        llm.collective_rpc(42)


def test_without_an_extension_the_worker_s_own_methods_answer(tiny_checkpoint):
    llm = _llm(tiny_checkpoint("llama"))
    try:
        assert llm.collective_rpc("apply_model", args=(embedding_shape,)) == [[384, 64]]
        with pytest.raises(WorkerRpcError, match="no method 'whoami'"):
            llm.collective_rpc("whoami", args=("x",))
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("worker_extensions:Clashing", r"--worker-extension-cls .*'sleep' is the worker's own"),
        ("worker_extensions:rank_plus", r"--worker-extension-cls .* is a function, not a class"),
        ("no_such_package.module:Class", r"--worker-extension-cls .*cannot import"),
        ("worker_extensions:Missing", r"--worker-extension-cls .*has no attribute"),
        ("NoModule", r"--worker-extension-cls .*not a qualified name"),
    ],
)
def test_a_bad_extension_fails_start_up_naming_the_flag(tiny_checkpoint, name, error):
    args = EngineArgs(model=str(tiny_checkpoint("llama")), worker_extension_cls=name)
    with pytest.raises(ValueError, match=error):
        args.create_engine_config()


def test_an_extension_method_hidden_by_a_worker_attribute_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"--worker-extension-cls .*'config' is the worker's own"):
        _llm(tiny_checkpoint("llama"), worker_extension_cls="worker_extensions:InstanceClash")


def test_the_flag_and_a_class_from_python(tiny_checkpoint):
    parser = add_engine_args(argparse.ArgumentParser())
    namespace = parser.parse_args(["--worker-extension-cls", "worker_extensions.RankProbe"])
    assert engine_args_from_cli(namespace).worker_extension_cls == "worker_extensions.RankProbe"
    args = EngineArgs(model=str(tiny_checkpoint("llama")), worker_extension_cls=RankProbe)
    assert args.worker_extension_cls == "worker_extensions:RankProbe"
    config, _ = args.create_engine_config()
    assert config.parallel.worker_extension_cls == "worker_extensions:RankProbe"


def test_data_parallel_replicas_answer_in_replica_order(tiny_checkpoint):
    llm = _llm(tiny_checkpoint("llama"), data_parallel_size=2)
    try:
        replicas = llm.collective_rpc(lambda worker: worker.config.parallel.data_parallel_rank)
        assert replicas == [0, 1]
    finally:
        llm.llm_engine.shutdown()
