"""``cpu_offload_gb``: parameters moved to host memory as the model is built, in creation
order and within the budget, read in place through the platform's view of host memory.
The CPU platform has no such view (its weights are in host memory already), so these tests
give it one: the host tensor itself, which is what the device reads on CUDA too."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.weight_offload import WeightOffload, make_weight_offload
from pagedlm.worker import sleep
from pagedlm.worker.sleep import OffloadedWeights
from pagedlm_cpu.platform import CpuPlatform

PROMPTS = [{"prompt_token_ids": [5, 9, 2, 77, 31, 8, 100, 3]}, {"prompt_token_ids": [4, 4, 19]}]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=1)


def _alias(host: torch.Tensor) -> torch.Tensor:
    """A new tensor over the host tensor's memory (what a device view is)."""
    return host.view(host.shape)


def _offload(budget: int) -> WeightOffload:
    return WeightOffload(budget, _alias, lambda shape, dtype: torch.empty(shape, dtype=dtype))


def _host_held(offload: WeightOffload, module: nn.Module) -> list[str]:
    return [name for name, p in module.named_parameters() if offload.holds(p)]


def test_parameters_go_in_creation_order_while_less_than_the_budget_is_offloaded():
    # Linear(8, 8) in float32: weight 256 bytes, bias 32. As vLLM: the last one offloaded
    # may pass the budget by its own size.
    offload = _offload(256 + 32 + 32)
    with offload.while_building():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    assert _host_held(offload, model) == ["0.weight", "0.bias", "1.weight"]
    assert offload.offloaded_bytes == 544


def test_vocabulary_tables_stay_on_the_device():
    offload = _offload(1 << 20)
    with offload.while_building():
        model = nn.ModuleDict({"embed": VocabParallelEmbedding(10, 8), "layer": nn.Linear(8, 8)})
    offload.settle([model])
    assert _host_held(offload, model) == ["layer.weight", "layer.bias"]


def test_values_are_kept_and_writes_reach_host_memory():
    torch.manual_seed(0)
    offload = _offload(1 << 20)
    with offload.while_building():
        layer = nn.Linear(4, 3)
    expected = layer.weight.detach().clone()
    [(_, host, _)] = [held for held in offload._held.values() if held[0] is layer.weight]
    assert torch.equal(host, expected) and host.data_ptr() == layer.weight.data_ptr()
    with torch.no_grad():
        layer.weight.copy_(torch.ones(3, 4))  # a loader filling it
    assert torch.equal(host, torch.ones(3, 4))


def test_a_shared_parameter_is_counted_once():
    offload = _offload(1 << 20)
    with offload.while_building():
        first = nn.Linear(4, 10, bias=False)
        second = nn.Linear(4, 10, bias=False)
        second.weight = first.weight  # shared: the second's own weight is dropped
    offload.settle([first, second])
    assert offload.offloaded_bytes == 10 * 4 * 4
    assert offload.holds(second.weight) and second.weight is first.weight


def test_meta_parameters_stay():
    offload = _offload(1 << 20)
    with offload.while_building(), torch.device("meta"):
        layer = nn.Linear(4, 4)
    assert offload.offloaded_bytes == 0 and layer.weight.is_meta


def test_settle_offloads_replaced_parameters_again_within_the_budget():
    offload = _offload(256 + 32)
    with offload.while_building():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert _host_held(offload, model) == ["0.weight", "0.bias"]
    model[0].weight = nn.Parameter(torch.zeros(8, 4))  # quantization at load, say: 128 bytes
    model[0].bias.data = torch.zeros(8)  # its data replaced: no longer in host memory
    offload.settle([model])
    assert _host_held(offload, model) == ["0.weight", "0.bias", "1.weight"]
    assert offload.offloaded_bytes == 128 + 32 + 256
    del model[1].weight  # a layer dropping a parameter (DeepSeek's folded kv_b_proj)
    offload.prune([model])
    assert offload.offloaded_bytes == 128 + 32


def test_a_platform_without_host_views_ignores_the_budget(caplog):
    with caplog.at_level(logging.WARNING):
        offload = make_weight_offload(
            2, "cpu", CpuPlatform().map_host_tensor, CpuPlatform().empty_host
        )
    assert offload is None
    assert "cpu_offload_gb=2 has no effect on the cpu platform" in caplog.text
    assert make_weight_offload(0, "cpu", _alias, CpuPlatform().empty_host) is None


@pytest.mark.parametrize("value", [-1, float("nan"), "4", True, float("inf")])
def test_a_bad_budget_is_refused(value):
    with pytest.raises(ValueError, match=r"cpu_offload_gb=.* must be"):
        EngineArgs(model="unused", cpu_offload_gb=value).create_engine_config()


def test_sleep_leaves_offloaded_parameters_in_host_memory(monkeypatch):
    offload = _offload(1)
    with offload.while_building():
        layer = nn.Linear(8, 8)
    assert offload.holds(layer.weight) and not offload.holds(layer.bias)
    # On the CPU every tensor is on the host device: make sleep take "cpu:1" for the host,
    # so it moves the layer's tensors as it would a GPU's.
    monkeypatch.setattr(sleep, "HOST", torch.device("cpu", 1))
    saved = OffloadedWeights.offload([layer], pin_memory=False, in_host_memory=offload.holds)
    assert [tensor for tensor, _ in saved.tensors] == [layer.bias]
    assert offload.holds(layer.weight)
    saved.restore(torch.device("cpu"))


def _run(path, **kwargs):
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=64, **kwargs)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        [offload] = llm.collective_rpc(lambda worker: worker.runner.weight_offload)
        [model] = llm.apply_model(lambda model: model)
        return outputs, offload, model
    finally:
        llm.llm_engine.shutdown()


def test_an_offloaded_model_computes_what_it_did(tiny_checkpoint, monkeypatch, caplog):
    path = tiny_checkpoint("llama")
    expected, none, _ = _run(path)
    assert none is None
    monkeypatch.setattr(CpuPlatform, "map_host_tensor", lambda self, host: _alias(host))
    budget_gb = 0.00005  # ~52 kB: part of the first layer
    with caplog.at_level(logging.INFO, logger="pagedlm.model_executor.weight_offload"):
        outputs, offload, model = _run(path, cpu_offload_gb=budget_gb)
    # The layers' parameters until the budget is reached; the embedding and head stay.
    # (The CPU's linear kernels keep packed copies since: only the count is left to read.)
    assert offload.offloaded_bytes >= budget_gb * 2**30
    assert "cpu_offload_gb: 0.00 GiB of weights in host memory" in caplog.text
    assert not offload.holds(model.model.embed_tokens.weight)
    for got, want in zip(outputs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs
        assert got.prompt_logprobs == want.prompt_logprobs


def test_host_buffers_stay_on_the_host_while_a_model_is_built():
    # load_model builds under ``torch.device(device)``; the offloader allocates inside it.
    with torch.device("meta"):
        host = CpuPlatform().empty_host((2, 3), torch.float32)
    assert host.device.type == "cpu"
