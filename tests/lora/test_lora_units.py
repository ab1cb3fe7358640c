"""LoRA pieces without an engine: the scheduler's adapter limit, prefix-cache keys, the
worker's slots and host cache, the wire forms of ``LoRARequest``."""

from __future__ import annotations

import pytest
import torch

from pagedlm.config import ArchConfig, CacheConfig, LoRAConfig, SchedulerConfig
from pagedlm.core.request import Request
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.kv_cache.manager import KVCacheManager
from pagedlm.lora.manager import LoRAManager
from pagedlm.lora.ops import TorchLoRAOps
from pagedlm.lora.request import LoRARequest
from pagedlm.metrics import EngineMetrics
from pagedlm.model_executor.models.llama import LlamaForCausalLM
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import NewRequestData, SchedulerOutput, codec
from pagedlm.step.scheduler_output import CachedRequestData
from peft_adapters import LLAMA_MODULES, make_adapter


def _lora(index: int) -> LoRARequest:
    return LoRARequest(f"a{index}", index, f"/adapters/{index}")


def _slots(manager: LoRAManager) -> dict[int, int]:
    """Adapter id -> device slot (every adapter here has one path)."""
    return {lora_id: slot for (lora_id, _), slot in manager.slot_of.items()}


def _request(request_id: str, lora: LoRARequest | None, tokens: int = 4) -> Request:
    return Request(request_id, list(range(tokens)), SamplingParams(max_tokens=4), lora_request=lora)


def test_scheduler_runs_no_more_adapters_than_max_loras():
    scheduler = OneBudgetScheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=4),
        64,
        max_loras=2,
    )
    for request in [
        _request("r1", _lora(1)),
        _request("r2", _lora(2)),
        _request("r3", _lora(3)),  # a third adapter: waits
        _request("r4", _lora(1)),  # a running adapter: admitted behind it
        _request("r5", None),  # the base model: admitted
        # Another adapter under a running id (removed, then loaded again while its
        # requests run): a third adapter, waits.
        _request("r6", LoRARequest("moved", 1, "/adapters/elsewhere")),
    ]:
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["r1", "r2", "r4", "r5"]
    assert [r.lora_request for r in first.scheduled_new_reqs][-1] is None
    assert [r.request_id for r in scheduler.waiting] == ["r3", "r6"]
    stats = scheduler.make_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (
        {"a1": 2, "a2": 1},
        {"a3": 1, "moved": 1},
    )
    (info,) = [m for m in EngineMetrics().snapshot(stats) if m.name == "pagedlm:lora_requests_info"]
    assert info.labels == {
        "max_lora": "2",
        "running_lora_adapters": "a1,a2",
        "waiting_lora_adapters": "a3,moved",
    }
    assert scheduler.schedule().scheduled_new_reqs == []  # still two adapters running
    scheduler.abort_requests(["r2"])
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["r3"]


def test_prefix_cache_keeps_adapters_apart():
    manager = KVCacheManager(4, 16, enable_prefix_caching=True)
    first = _request("a", _lora(1), tokens=9)
    manager.allocate_slots(first, 9)
    assert manager.get_computed_blocks(_request("b", None, 9)).num_computed_tokens == 0
    assert manager.get_computed_blocks(_request("c", _lora(2), 9)).num_computed_tokens == 0
    assert manager.get_computed_blocks(_request("d", _lora(1), 9)).num_computed_tokens == 8


def test_lora_request_checks_and_wire_round_trip():
    with pytest.raises(ValueError, match="lora_int_id must be > 0"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="no lora_path"):
        LoRARequest("a", 1)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    data = NewRequestData("r", [1, 2], 2, SamplingParams(), [0], 0, _lora(3))
    step = SchedulerOutput([data], CachedRequestData(), {"r": 2}, 2)
    decoded = codec.decode(codec.encode(step), SchedulerOutput)
    assert decoded.scheduled_new_reqs[0].lora_request == _lora(3)

    from pagedlm.engine.messages import request_from_wire, request_to_wire

    request = _request("r", _lora(5))
    assert request_from_wire(request_to_wire(request)).lora_request == _lora(5)


class _State:
    def __init__(self, lora: LoRARequest | None) -> None:
        self.lora_request = lora


def test_manager_slots_are_lru_and_the_host_cache_is_bounded(tiny_checkpoint, tmp_path):
    import numpy as np

    base = tiny_checkpoint("llama")
    arch = ArchConfig.from_directory(base)
    loras = []
    for index in range(1, 4):
        make_adapter(base, tmp_path / str(index), LLAMA_MODULES, rank=4, seed=index)
        loras.append(LoRARequest(f"a{index}", index, str(tmp_path / str(index))))
    model = LlamaForCausalLM(arch)
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    manager = LoRAManager(
        config, arch, model, 16, TorchLoRAOps(), torch.float32, torch.device("cpu")
    )
    qsl = np.array([0, 2, 3, 6])

    def step(*adapters):
        manager.prepare_step([_State(a) for a in adapters], qsl, 8)

    step(loras[0], None, loras[1])
    assert _slots(manager) == {1: 0, 2: 1}
    assert manager.state.token_slots[:8].tolist() == [0, 0, -1, 1, 1, 1, -1, -1]
    step(loras[1], None, None)
    step(loras[2], loras[1], None)  # evicts adapter 1, the least recently used
    assert _slots(manager) == {2: 1, 3: 0}
    # max_cpu_loras=2: adapter 1 left the host too
    assert [key[0] for key in manager.cached_keys] == [2, 3]
    assert [slot for slot, _ in manager.state.groups] == [0, 1]
    layer = manager.layers["model.layers.0.self_attn.qkv_proj"]
    assert layer.active == [True, True]
    with pytest.raises(RuntimeError, match="max_loras=2"):
        step(*loras)
