"""Grammar compiles that cannot starve others: lanes, cancellation, write-off, limits."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.request import Request
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedlm.step import ModelRunnerOutput
from pagedlm.structured_output.backend import GrammarSpec, StructuredOutputBackend
from pagedlm.structured_output.compiler import SMALL_SPEC_CHARS, GrammarCompiler
from pagedlm.structured_output.manager import (
    GRAMMAR_FAILED,
    StructuredOutputManager,
    grammar_failure,
)
from pagedlm.structured_output.params import GrammarLimits, validate_structured_outputs

LARGE = "x" * (SMALL_SPEC_CHARS + 1)


class _GatedBackend(StructuredOutputBackend):
    """A spec compiles when its gate opens (specs without a gate compile at once)."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__(None, 64, [2])
        self.gates: dict[str, threading.Event] = {}
        self.started: list[str] = []
        self.compiled: list[str] = []

    def gate(self, text: str) -> threading.Event:
        return self.gates.setdefault(text, threading.Event())

    @staticmethod
    def validate(spec):
        pass

    def compile(self, spec):
        self.started.append(spec.spec)
        gate = self.gates.get(spec.spec)
        if gate is not None:
            assert gate.wait(10)
        self.compiled.append(spec.spec)
        return spec.spec

    def make_matcher(self, compiled):
        from test_scheduler_grammar import _SequenceMatcher

        return _SequenceMatcher([5])


def _spec(text: str) -> GrammarSpec:
    return GrammarSpec("regex", text)


def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_small_spec_never_waits_behind_a_large_one():
    backend = _GatedBackend()
    compiler = GrammarCompiler(lambda: backend, small_workers=1, large_workers=1)
    big, bigger = LARGE, LARGE + "y"
    backend.gate(big)
    backend.gate(bigger)
    first = compiler.acquire(_spec(big))
    second = compiler.acquire(_spec(bigger))
    small = compiler.acquire(_spec("a+"))
    assert small.result(5) == "a+"
    assert not first.done()
    assert bigger not in backend.started, "the large lane runs one compile at a time"
    _wait_until(lambda: compiler.running_s(_spec(big)) is not None)
    assert compiler.running_s(_spec(bigger)) is None
    backend.gates[big].set()
    backend.gates[bigger].set()
    assert (first.result(5), second.result(5)) == (big, bigger)
    compiler.shutdown()


def test_a_queued_compile_nobody_wants_is_cancelled():
    backend = _GatedBackend()
    compiler = GrammarCompiler(lambda: backend, large_workers=1)
    blocker, wanted_twice, abandoned = LARGE, LARGE + "2", LARGE + "3"
    backend.gate(blocker)
    running = compiler.acquire(_spec(blocker))
    shared = compiler.acquire(_spec(wanted_twice))
    assert compiler.acquire(_spec(wanted_twice)) is shared
    lonely = compiler.acquire(_spec(abandoned))
    compiler.release(_spec(abandoned), lonely)
    compiler.release(_spec(wanted_twice), shared)  # one of its two users is left
    compiler.release(_spec(blocker), running)  # running: it cannot be stopped
    assert lonely.cancelled()
    backend.gates[blocker].set()
    assert shared.result(5) == wanted_twice
    assert running.result(5) == blocker
    assert abandoned not in backend.started
    assert compiler.compile_now(_spec(blocker)) == blocker  # its result was kept
    assert backend.compiled.count(blocker) == 1
    compiler.shutdown()


def test_a_running_compile_nobody_wants_leaves_its_lane():
    backend = _GatedBackend()
    compiler = GrammarCompiler(lambda: backend, large_workers=1)
    abandoned, waiting = LARGE, LARGE + "2"
    backend.gate(abandoned)
    first = compiler.acquire(_spec(abandoned))
    second = compiler.acquire(_spec(waiting))
    _wait_until(lambda: backend.started == [abandoned])
    compiler.release(_spec(abandoned), first)  # its request was aborted mid-compile
    assert second.result(5) == waiting, "the lane moved on without waiting for it"
    again = compiler.acquire(_spec(abandoned))  # a retry joins the running compile
    assert again is first and not again.done()
    backend.gates[abandoned].set()
    assert again.result(5) == abandoned
    assert backend.started.count(abandoned) == 1
    compiler.shutdown()


def test_write_off_lets_the_lane_move_on_within_the_thread_cap():
    backend = _GatedBackend()
    compiler = GrammarCompiler(lambda: backend, large_workers=1, max_threads=2)
    stuck, next_one, third = LARGE, LARGE + "2", LARGE + "3"
    for text in (stuck, next_one, third):
        backend.gate(text)
    futures = [compiler.acquire(_spec(text)) for text in (stuck, next_one, third)]
    _wait_until(lambda: backend.started == [stuck])
    compiler.write_off(_spec(stuck))
    _wait_until(lambda: backend.started == [stuck, next_one])
    compiler.write_off(_spec(next_one))
    time.sleep(0.1)
    assert third not in backend.started, "two threads are the cap, written-off ones included"
    backend.gates[stuck].set()
    _wait_until(lambda: third in backend.started)
    backend.gates[next_one].set()
    backend.gates[third].set()
    assert [f.result(5) for f in futures] == [stuck, next_one, third]
    compiler.shutdown()


def _scheduler(
    backend: _GatedBackend, limits: GrammarLimits, small_workers: int
) -> OneBudgetScheduler:
    config = SimpleNamespace(
        structured_outputs_backend="gated",
        model=SimpleNamespace(arch=SimpleNamespace(vocab_size=64)),
        structured_outputs_reasoning=None,
    )
    manager = StructuredOutputManager(config)  # type: ignore[arg-type]
    manager.compiler = GrammarCompiler(lambda: backend, small_workers=small_workers)
    manager.set_limits(limits)
    return OneBudgetScheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(block_size=4),
        64,
        manager,
    )


def _request(request_id: str, grammar: str | None) -> Request:
    params = {"max_tokens": 3}
    if grammar is not None:
        params["structured_outputs"] = StructuredOutputsParams(regex=grammar)
    return Request(request_id, [10, 11, 12], SamplingParams(**params), {2})


def _step(scheduler: OneBudgetScheduler):
    output = scheduler.schedule()
    ids = output.req_ids
    return scheduler.update_from_output(output, ModelRunnerOutput(ids, [[5] for _ in ids]))


def test_a_compile_past_the_timeout_fails_its_request_and_frees_the_lane():
    backend = _GatedBackend()
    gate = backend.gate("slow")
    scheduler = _scheduler(backend, GrammarLimits(compile_timeout_s=0.2), small_workers=1)
    scheduler.add_request(_request("slow", "slow"))
    scheduler.add_request(_request("free", None))
    outputs = _step(scheduler)
    assert [o.req_id for o in outputs] == ["free"]
    _wait_until(lambda: backend.started == ["slow"])
    time.sleep(0.3)
    outputs = {o.req_id: o for o in _step(scheduler)}
    failed = outputs["slow"]
    assert failed.finish_reason == "abort" and failed.new_token_ids == []
    message = grammar_failure(failed.finish_reason, failed.stop_reason)
    assert message is not None and message.startswith(GRAMMAR_FAILED)
    assert "longer than 0.2 s" in message and "--structured-outputs-compile-timeout-s" in message
    assert grammar_failure("abort", "client went away") is None
    assert grammar_failure("stop", message) is None
    # The written-off compile no longer holds the one small-lane worker: the next starts.
    scheduler.add_request(_request("next", "5"))
    _wait_until(lambda: "5" in backend.compiled)
    gate.set()


def test_a_request_queued_behind_written_off_compiles_fails_after_the_timeout():
    backend = _GatedBackend()
    stuck = [backend.gate(name) for name in ("s1", "s2")]
    scheduler = _scheduler(backend, GrammarLimits(compile_timeout_s=0.2), small_workers=2)
    scheduler.grammars.manager.compiler._max_threads = 2
    for name in ("s1", "s2"):
        scheduler.add_request(_request(name, name))
    _wait_until(lambda: sorted(backend.started) == ["s1", "s2"])
    time.sleep(0.3)
    _step(scheduler)  # both fail their timeout and are written off; the cap stays reached
    scheduler.add_request(_request("late", "7"))
    _step(scheduler)
    assert "7" not in backend.started
    time.sleep(0.3)
    (failed,) = _step(scheduler)
    assert failed.req_id == "late" and "the compiler is busy" in failed.stop_reason
    for gate in stuck:
        gate.set()


def test_aborting_a_request_cancels_its_queued_compile():
    backend = _GatedBackend()
    backend.gate("a")
    backend.gate("b")
    scheduler = _scheduler(backend, GrammarLimits(), small_workers=2)
    for name in ("a", "b", "c"):  # two small-lane workers: "c" queues
        scheduler.add_request(_request(name, name))
    _wait_until(lambda: sorted(backend.started) == ["a", "b"])
    scheduler.abort_requests(["c"])
    backend.gates["a"].set()
    backend.gates["b"].set()
    _wait_until(lambda: sorted(backend.compiled) == ["a", "b"])
    time.sleep(0.1)
    assert "c" not in backend.started


def test_spec_size_limit_names_the_flag():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    params = StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError, match=r"more than the 100 .*--structured-outputs-max-spec"):
        validate_structured_outputs(params, "xgrammar", max_spec_chars=100)
    assert validate_structured_outputs(params, "xgrammar", max_spec_chars=0).kind == "json"
    assert validate_structured_outputs(params, "xgrammar").kind == "json"


def test_offline_engine_takes_the_limits_from_its_arguments(tiny_checkpoint):
    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        num_kv_blocks=8,
        structured_outputs_max_spec_chars=100,
        structured_outputs_compile_timeout_s=3.0,
    )
    engine = LLMEngine.from_engine_args(args)
    try:
        assert engine.input_processor.structured_outputs_max_spec_chars == 100
        assert engine.engine_core.structured_output.limits == GrammarLimits(100, 3.0)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout_s=-1"):
        EngineArgs(
            model="/nonexistent", structured_outputs_compile_timeout_s=-1
        ).create_engine_config()
