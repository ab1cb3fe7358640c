"""The start-up heap frozen out of the garbage collector's passes (``pagedlm.gc_heap``),
and thawed again so that a discarded engine's reference cycles are still freed."""

from __future__ import annotations

import gc
import weakref

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.gc_heap import FREEZE_ENV, collect_garbage, freeze_startup_heap, thaw_heap


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def freezing(monkeypatch):
    monkeypatch.setenv(FREEZE_ENV, "1")
    yield
    gc.unfreeze()


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


def test_frozen_cycles_survive_collections_until_thawed(freezing):
    alive = _Node()
    freed_later = weakref.ref(alive)
    assert freeze_startup_heap("test") > 0
    del alive  # garbage now, but frozen: collections skip it
    gc.collect()
    assert freed_later() is not None
    thaw_heap()
    assert freed_later() is None
    assert gc.get_freeze_count() == 0


def test_collect_garbage_frees_frozen_cycles_and_refreezes(freezing):
    alive = _Node()
    freed = weakref.ref(alive)
    freeze_startup_heap("test")
    del alive
    collect_garbage()
    assert freed() is None
    assert gc.get_freeze_count() > 0


def test_objects_allocated_after_the_freeze_are_collected(freezing):
    freeze_startup_heap("test")
    later = _cycle()
    gc.collect()
    assert later() is None


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(FREEZE_ENV, "0")
    assert freeze_startup_heap("test") == 0
    assert gc.get_freeze_count() == 0


def test_an_engine_freezes_at_start_up_and_thaws_at_shutdown(freezing, tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, num_kv_blocks=16)
    assert gc.get_freeze_count() > 0
    engine_ref = weakref.ref(llm.llm_engine)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.llm_engine.shutdown()
    assert gc.get_freeze_count() == 0
    del llm, out
    gc.collect()
    assert engine_ref() is None  # nothing of the engine stays frozen or leaks
