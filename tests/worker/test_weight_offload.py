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
from pagedlm.model_executor.weight_offload import WeightOffload, make_weight_offload
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


def test_parameters_go_in_creation_order_while_they_fit():
    # Linear(8, 8) in float32: weight 256 bytes, bias 32.
    offload = _offload(256 + 32 + 32)
    with offload.while_building():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    # The second weight would pass the budget; the second bias still fits; nothing more.
    assert _host_held(offload, model) == ["0.weight", "0.bias", "1.bias"]
    assert offload.offloaded_bytes == 320


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
        embed = nn.Embedding(10, 4)
        head = nn.Linear(4, 10, bias=False)
        head.weight = embed.weight  # tied: the head's own weight is dropped
    offload.settle([embed, head])
    assert offload.offloaded_bytes == 10 * 4 * 4
    assert offload.holds(head.weight) and head.weight is embed.weight


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
    model[1].bias.data = torch.zeros(8)  # its data replaced: no longer in host memory
    offload.settle([model])
    assert _host_held(offload, model) == ["0.weight", "0.bias", "1.bias"]
    assert offload.offloaded_bytes == 128 + 32 + 32


def test_a_platform_without_host_views_ignores_the_budget(caplog):
    with caplog.at_level(logging.WARNING):
        offload = make_weight_offload(
            2, "cpu", CpuPlatform().map_host_tensor, CpuPlatform().empty_host
        )
    assert offload is None
    assert "cpu_offload_gb=2 has no effect on the cpu platform" in caplog.text
    assert make_weight_offload(0, "cpu", _alias, CpuPlatform().empty_host) is None


@pytest.mark.parametrize("value", [-1, float("nan")])
def test_a_negative_budget_is_refused(value):
    with pytest.raises(ValueError, match=r"cpu_offload_gb=.* must be a number of GiB >= 0"):
        EngineArgs(model="unused", cpu_offload_gb=value).create_engine_config()


def test_sleep_leaves_offloaded_parameters_in_host_memory():
    offload = _offload(256)
    with offload.while_building():
        layer = nn.Linear(8, 8)
    saved = OffloadedWeights.offload([layer], pin_memory=False, in_host_memory=offload.holds)
    assert [tensor for tensor, _ in saved.tensors] == []  # (the CPU's bias is on HOST too)
    assert offload.holds(layer.weight)


def _run(path, **kwargs):
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=64, **kwargs)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        [offload] = llm.collective_rpc(lambda worker: worker.runner.weight_offload)
        [model] = llm.apply_model(lambda model: model)
        return outputs, offload, model
    finally:
        llm.llm_engine.shutdown()


def test_an_offloaded_model_computes_what_it_did(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("llama")
    expected, none, _ = _run(path)
    assert none is None
    monkeypatch.setattr(CpuPlatform, "map_host_tensor", lambda self, host: _alias(host))
    budget_gb = 0.0005  # ~524 kB: the embedding and part of the first layer
    outputs, offload, model = _run(path, cpu_offload_gb=budget_gb)
    assert 0 < offload.offloaded_bytes <= budget_gb * 2**30
    held = _host_held(offload, model)
    assert held and held[0] == "model.embed_tokens.weight"
    assert len(held) < len(list(model.parameters()))
    for got, want in zip(outputs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs
        assert got.prompt_logprobs == want.prompt_logprobs


def test_host_buffers_stay_on_the_host_while_a_model_is_built():
    # load_model builds under ``torch.device(device)``; the offloader allocates inside it.
    with torch.device("meta"):
        host = CpuPlatform().empty_host((2, 3), torch.float32)
    assert host.device.type == "cpu"
