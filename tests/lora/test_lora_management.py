"""vLLM's adapter management on CPU: ``add_lora`` loads into the workers' host cache,
``list_loras`` names what is loaded (added, or read for a request), ``remove_lora`` forgets
(False when nothing was loaded), ``pin_lora`` keeps an adapter through evictions and
through a level-2 sleep; on ``LoRAManager`` alone, on ``LLMEngine``, and on ``AsyncLLM``
through its engine-core process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from pagedlm import LLM, AsyncLLM, LoRARequest, SamplingParams
from pagedlm.config import ArchConfig, LoRAConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.lora.manager import LoRAManager
from pagedlm.lora.ops import TorchLoRAOps
from pagedlm.model_executor.models.llama import LlamaForCausalLM
from peft_adapters import LLAMA_MODULES, lora_llm, make_adapter

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(5, 30))}


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def loras(base, tmp_path_factory) -> list[LoRARequest]:
    """Four adapters, ids 1 to 4."""
    root = tmp_path_factory.mktemp("adapters")
    made = []
    for index in range(1, 5):
        make_adapter(base, root / str(index), LLAMA_MODULES, rank=4, seed=index)
        made.append(LoRARequest(f"a{index}", index, str(root / str(index))))
    return made


def _slots(manager: LoRAManager) -> dict[int, int]:
    """Adapter id -> device slot (every adapter here has one path)."""
    return {lora_id: slot for (lora_id, _), slot in manager.slot_of.items()}


class _State:
    def __init__(self, lora: LoRARequest | None, req_id: str = "r") -> None:
        self.lora_request = lora
        self.req_id = req_id


def test_manager_add_list_remove_pin(base, loras):
    arch = ArchConfig.from_directory(base)
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    manager = LoRAManager(
        config, arch, LlamaForCausalLM(arch), 16, TorchLoRAOps(), torch.float32, torch.device("cpu")
    )
    one, two, three, four = loras

    def step(*adapters):
        manager.prepare_step([_State(a) for a in adapters], np.array([0, 2, 4]), 8)

    assert manager.add(one) and manager.add(two)
    assert manager.list_ids() == {1, 2} and _slots(manager) == {}  # host memory only
    assert not manager.pin(3)  # not loaded
    assert manager.pin(1)
    assert _slots(manager) == {1: 0}  # pinning gave it a device slot
    manager.add(three)  # max_cpu_loras=2: the least recently used unpinned one goes
    assert manager.list_ids() == {1, 3}
    step(three, four)  # a step needing both slots takes the pinned adapter's
    assert set(_slots(manager)) == {3, 4}
    assert 1 in manager.list_ids()  # but never drops it from the host cache
    step(one, None)  # back in a slot, from host memory, in place of adapter 3
    assert set(_slots(manager)) == {1, 4} and manager.list_ids() == {1, 4}
    assert manager.remove(4) and not manager.remove(4) and not manager.remove(99)
    assert manager.list_ids() == {1} and manager._free_slots == [1 - _slots(manager)[1]]
    assert manager.remove(1)  # a pinned one too
    assert manager.list_ids() == set() and sorted(manager._free_slots) == [0, 1]
    manager.add(four)
    state = manager.host_state()
    manager.pin(4)
    fresh = LoRAManager(
        config, arch, LlamaForCausalLM(arch), 16, TorchLoRAOps(), torch.float32, torch.device("cpu")
    )
    fresh.adopt(manager.host_state())  # what a new model runner takes over
    assert fresh.list_ids() == {4} and _slots(fresh) == {4: 0}
    assert state[1] == set()  # a snapshot: the later pin is not in it


def _tokens(llm: LLM, lora: LoRARequest | None = None) -> list[int]:
    output = llm.generate([PROMPT], PARAMS, use_tqdm=False, lora_request=lora)[0]
    return list(output.outputs[0].token_ids)


def test_llm_engine_adapters_survive_a_level_2_sleep(base, loras):
    one, two, three, _ = loras
    llm = LLM(
        str(base),
        skip_tokenizer_init=True,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        max_cpu_loras=3,
        num_kv_blocks=32,
        enable_sleep_mode=True,
    )
    engine = llm.llm_engine
    try:
        assert engine.list_loras() == set()
        assert engine.add_lora(one) is True and engine.list_loras() == {1}
        expected = _tokens(llm, two)
        assert expected != _tokens(llm)  # the adapter changes the tokens
        assert engine.list_loras() == {1, 2}  # a request loaded adapter 2
        assert engine.pin_lora(2) is True
        with pytest.raises(ValueError, match="3 is not loaded"):
            engine.pin_lora(3)
        llm.sleep(2)
        llm.wake_up()  # a new model runner: it takes the adapters over
        assert engine.list_loras() == {1, 2}
        worker = engine.engine_core.executor.worker
        assert 2 in _slots(worker.model_runner.lora)  # pinned: back in a device slot
        assert _tokens(llm, two) == expected
        assert engine.remove_lora(1) is True and engine.remove_lora(1) is False
        assert engine.list_loras() == {2}
        moved = LoRARequest("moved", 1, three.lora_path)  # a removed id may name other files
        assert engine.add_lora(moved) and engine.list_loras() == {1, 2}
        with pytest.raises(ValueError, match="already names the adapter"):
            engine.add_lora(LoRARequest("again", 1, one.lora_path))
    finally:
        engine.shutdown()


def test_without_enable_lora(base, loras):
    llm = LLM(str(base), skip_tokenizer_init=True, num_kv_blocks=16)
    engine = llm.llm_engine
    try:
        assert engine.list_loras() == set() and engine.remove_lora(1) is False
        with pytest.raises(ValueError, match="not loaded"):
            engine.pin_lora(1)
        with pytest.raises(ValueError, match="enable_lora=True"):
            engine.add_lora(loras[0])
    finally:
        engine.shutdown()


def test_async_llm_manages_adapters_in_its_engine_core(base, loras):
    one, two, *_ = loras
    args = EngineArgs(
        model=str(base),
        skip_tokenizer_init=True,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        num_kv_blocks=32,
    )
    engine = AsyncLLM.from_engine_args(args)

    async def run() -> None:
        assert await engine.add_lora(one) is True
        assert await engine.list_loras() == {1}
        outputs = [o async for o in engine.generate(PROMPT, PARAMS, "with-two", lora_request=two)]
        assert outputs[-1].finished
        assert outputs[-1].lora_request == two  # vLLM's RequestOutput field
        assert await engine.list_loras() == {1, 2}
        assert await engine.pin_lora(1) is True
        with pytest.raises(ValueError, match="9 is not loaded"):
            await engine.pin_lora(9)
        assert await engine.remove_lora(2) is True
        assert await engine.remove_lora(2) is False
        assert await engine.list_loras() == {1}

    try:
        asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine.shutdown()


def test_a_failed_read_keeps_its_device_slot(base, loras, tmp_path):
    """An adapter whose files are gone when a step needs it (evicted from the host cache
    and then deleted) fails the requests that name it, which run without it; the slot taken
    for it was lost, so with max_loras=1 every later adapter step died on an
    AssertionError."""
    arch = ArchConfig.from_directory(base)
    config = LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    manager = LoRAManager(
        config, arch, LlamaForCausalLM(arch), 16, TorchLoRAOps(), torch.float32, torch.device("cpu")
    )
    gone = LoRARequest("gone", 9, str(tmp_path / "deleted"))
    failed = manager.prepare_step(
        [_State(gone, "a"), _State(None, "b"), _State(gone, "c")], np.array([0, 2, 3, 5]), 6
    )
    assert sorted(failed) == ["a", "c"] and "No adapter found for" in failed["a"]
    assert manager.state.token_slots[:6].tolist() == [-1] * 6  # run without it
    assert manager.prepare_step([_State(loras[0], "d")], np.array([0, 2]), 2) == {}
    assert _slots(manager) == {1: 0}


def test_an_adapter_another_rank_cannot_read_fails_here_too(base, loras, monkeypatch):
    """Under tensor or pipeline parallelism each rank reads its shard of an adapter. One
    that another rank cannot read fails its requests on this rank too (the output rank alone
    reports a step, so a failure of another rank's own was silent, its request's tokens
    wrong), and no rank keeps it: the ranks hold the same host cache and slots, and read
    from disk (where they agree) at the same points. A step that reads nothing gathers
    nothing."""
    from pagedlm.lora import manager as lora_manager

    gathered: list[list[str | None]] = []
    other_rank = ["disk gone"]

    def two_ranks(texts, device):
        gathered.append(list(texts))
        return [list(texts), [other_rank[0] for _ in texts]]

    monkeypatch.setattr(lora_manager, "gather_from_every_rank", two_ranks)
    arch = ArchConfig.from_directory(base)
    config = LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    manager = LoRAManager(
        config, arch, LlamaForCausalLM(arch), 16, TorchLoRAOps(), torch.float32, torch.device("cpu")
    )
    failed = manager.prepare_step(
        [_State(loras[0], "a"), _State(None, "b")], np.array([0, 2, 3]), 3
    )
    assert failed == {
        "a": "LoRA adapter 'a1' (lora_int_id 1) could not be read when its request needed "
        "it: disk gone (worker rank 1)"
    }
    assert gathered == [[None]]  # read here
    assert manager.list_ids() == set() and _slots(manager) == {}
    assert manager.state.token_slots[:3].tolist() == [-1] * 3  # run without it
    with pytest.raises(ValueError, match=r"^disk gone \(worker rank 1\)$"):
        manager.add(loras[1])
    assert manager.list_ids() == set()
    other_rank[0] = None  # readable everywhere again
    assert manager.prepare_step([_State(loras[0], "c")], np.array([0, 2]), 2) == {}
    assert _slots(manager) == {1: 0} and manager.list_ids() == {1}
    del gathered[:]
    assert manager.prepare_step([_State(loras[0], "d")], np.array([0, 2]), 2) == {}
    assert manager.add(loras[0]) and gathered == []


def _run_to_end(engine, outputs: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = list(output.outputs[0].token_ids)


def test_an_id_removed_while_its_requests_run_and_loaded_again_serves_each_its_own_weights(
    base, loras
):
    """``remove_lora`` frees an id while requests of its adapter still run (their next step
    reads it again); the id may then name another adapter. The workers found weights by id
    alone, so the new adapter's request ran with the old one's weights (or the old one's
    with the new ones'); every request now gets the tokens its adapter gives alone."""
    one, two, *_ = loras
    llm = lora_llm(base, max_loras=2)
    engine = llm.llm_engine
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        alone = {
            "old": llm.generate([PROMPT], long, use_tqdm=False, lora_request=one),
            "new": llm.generate([PROMPT], long, use_tqdm=False, lora_request=two),
        }
        alone = {key: list(out[0].outputs[0].token_ids) for key, out in alone.items()}
        assert alone["old"] != alone["new"]
        engine.add_request("old", PROMPT, long, lora_request=one)
        engine.step()
        engine.step()
        assert engine.remove_lora(1)
        moved = LoRARequest("moved", 1, two.lora_path)  # id 1 now names adapter two's files
        engine.add_request("new", PROMPT, long, lora_request=moved)
        outputs: dict[str, list[int]] = {}
        _run_to_end(engine, outputs)
        assert outputs == alone
    finally:
        engine.shutdown()
