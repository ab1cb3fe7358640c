"""The scheduler with structured outputs, driven by a fake grammar backend and runner.

The fake grammar of a request is a fixed token sequence (given as a regex spec of
space-separated ids); the fake runner samples the lowest token the shipped bitmask allows
(an unconstrained request samples FILLER), so these tests check what the scheduler sends
and how it reacts, with no model and no grammar library.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from pagedlm.config import CacheConfig, ReasoningMarkers, SchedulerConfig
from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedlm.step import ModelRunnerOutput, SchedulerOutput
from pagedlm.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from pagedlm.structured_output.compiler import GrammarCompiler
from pagedlm.structured_output.manager import StructuredOutputManager

BLOCK = 4
EOS = 2
FILLER = 7
VOCAB = 64


class _SequenceMatcher(GrammarMatcher):
    def __init__(self, sequence: list[int]) -> None:
        self.sequence = sequence
        self.position = 0

    def accept_token(self, token_id: int) -> bool:
        if self.position >= len(self.sequence) or token_id != self.sequence[self.position]:
            return False
        self.position += 1
        return True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = 0
        if self.position < len(self.sequence):
            token = self.sequence[self.position]
            bitmask[row, token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))

    def is_terminated(self) -> bool:
        return self.position == len(self.sequence)

    def rollback(self, num_tokens: int) -> None:
        self.position -= num_tokens


class _SequenceBackend(StructuredOutputBackend):
    name = "sequence"

    def __init__(self) -> None:
        super().__init__(None, VOCAB, [EOS])
        self.release = threading.Event()
        self.release.set()

    @staticmethod
    def validate(spec):
        pass

    def compile(self, spec):
        assert self.release.wait(10)
        if spec.spec == "fail":
            raise RuntimeError("fake compiler error")
        return [int(t) for t in spec.spec.split()]

    def make_matcher(self, compiled):
        return _SequenceMatcher(compiled)


@pytest.fixture
def backend() -> _SequenceBackend:
    return _SequenceBackend()


def _scheduler(
    backend: _SequenceBackend, *, budget: int = 64, num_blocks: int = 64, reasoning=None
):
    """``reasoning``: a ``ReasoningMarkers`` (grammars after the thought), or None."""
    config = SimpleNamespace(
        structured_outputs_backend="sequence",
        model=SimpleNamespace(arch=SimpleNamespace(vocab_size=VOCAB)),
        structured_outputs_reasoning=reasoning,
    )
    manager = StructuredOutputManager(config)  # type: ignore[arg-type]
    manager.compiler = GrammarCompiler(lambda: backend)
    return OneBudgetScheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256),
        CacheConfig(block_size=BLOCK),
        num_blocks,
        manager,
    )


def _request(request_id: str, grammar: str | None, num_prompt: int = 5, **params) -> Request:
    params.setdefault("max_tokens", 6)
    if grammar is not None:
        params["structured_outputs"] = StructuredOutputsParams(regex=grammar)
    return Request(request_id, list(range(10, 10 + num_prompt)), SamplingParams(**params), {EOS})


def _lowest_allowed(bitmask: np.ndarray) -> int:
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    return int(np.flatnonzero(bits)[0])


def _step(scheduler, ignore_mask: bool = False) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    output = scheduler.schedule()
    req_ids = output.req_ids
    masks = {}
    bitmask = scheduler.get_grammar_bitmask(output)
    if bitmask is not None:
        for row, req_id in enumerate(bitmask.req_ids):
            masks[req_id] = bitmask.bitmask[row]
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens < request.num_tokens:
            assert req_id not in masks, "no mask for a partial prefill chunk"
            sampled.append([])
        elif req_id in masks and not ignore_mask:
            sampled.append([_lowest_allowed(masks[req_id])])
        else:
            sampled.append([FILLER])
    return output, scheduler.update_from_output(output, ModelRunnerOutput(req_ids, sampled))


def _run(scheduler, max_steps: int = 50) -> dict[str, EngineCoreOutput]:
    finished, tokens = {}, {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return {r: (tokens.get(r, []), out) for r, out in finished.items()}
        for out in _step(scheduler)[1]:
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.req_id] = out
    raise AssertionError("requests did not finish")


def test_waits_for_its_grammar_while_others_run(backend):
    scheduler = _scheduler(backend)
    backend.release.clear()
    scheduler.add_request(_request("json", "20 21 2"))
    scheduler.add_request(_request("plain", None))
    assert scheduler.requests["json"].status is RequestStatus.WAITING_FOR_GRAMMAR
    for _ in range(2):
        output, _ = _step(scheduler)
        assert set(output.num_scheduled_tokens) == {"plain"}
        assert scheduler.get_grammar_bitmask(output) is None
    assert [r.request_id for r in scheduler.waiting] == ["json"], "keeps its place in line"
    backend.release.set()
    results = _run(scheduler)
    assert results["json"][0] == [20, 21, EOS] and results["json"][1].finish_reason == "stop"
    assert results["plain"][0] == [FILLER] * 4  # plus the 2 sampled while "json" waited


def test_idle_engine_blocks_briefly_instead_of_spinning(backend):
    scheduler = _scheduler(backend)
    backend.release.clear()
    scheduler.add_request(_request("json", "20 2"))
    threading.Timer(0.01, backend.release.set).start()
    output = scheduler.schedule()  # waits for the compile, then admits the request
    assert set(output.num_scheduled_tokens) == {"json"}
    assert scheduler.get_grammar_bitmask(output) is not None


def test_bitmask_only_on_the_step_that_samples(backend):
    scheduler = _scheduler(backend, budget=3)  # a 7-token prompt takes 3 steps
    scheduler.add_request(_request("json", "30 31 2", num_prompt=7))
    shipped = []
    for _ in range(3):
        output, _ = _step(scheduler)
        shipped.append(output.structured_output_req_ids == ["json"])
    assert shipped == [False, False, True]
    output = scheduler.schedule()
    bitmask = scheduler.get_grammar_bitmask(output)
    assert bitmask is not None and bitmask.req_ids == ["json"]


def test_request_ends_when_its_grammar_terminates(backend):
    scheduler = _scheduler(backend)
    # ignore_eos: EOS does not stop it, so only the grammar's end can.
    scheduler.add_request(_request("json", "40 41", ignore_eos=True, max_tokens=10))
    tokens, out = _run(scheduler)["json"]
    assert tokens == [40, 41] and out.finish_reason == "stop" and out.stop_reason is None


def test_preemption_keeps_the_matcher_state(backend):
    scheduler = _scheduler(backend)
    scheduler.add_request(_request("json", "50 51 52 53 2", max_tokens=10))
    _step(scheduler)
    _step(scheduler)
    request = scheduler.requests["json"]
    assert request.output_token_ids == [50, 51]
    scheduler.running.remove(request)
    scheduler._preempt(request)  # what a memory-starved step does to the last request
    assert request.num_computed_tokens == 0
    output, _ = _step(scheduler)  # recompute prompt + outputs, then sample the next token
    assert output.scheduled_new_reqs[0].token_ids[-2:] == [50, 51]
    out = _run(scheduler)["json"][1]
    assert request.output_token_ids == [50, 51, 52, 53, EOS] and out.finish_reason == "stop"


def test_failed_compilation_aborts_only_that_request(backend):
    scheduler = _scheduler(backend)
    scheduler.add_request(_request("bad", "fail"))
    scheduler.add_request(_request("plain", None, max_tokens=2))
    results = _run(scheduler)
    tokens, out = results["bad"]
    assert tokens == [] and out.finish_reason == "abort"
    assert "grammar compilation failed: fake compiler error" in out.stop_reason
    assert results["plain"][0] == [FILLER, FILLER]
    assert not scheduler.grammars.manager._requests, "grammar state is released"


def test_token_outside_the_grammar_aborts(backend):
    scheduler = _scheduler(backend)
    scheduler.add_request(_request("json", "60 2"))
    _, outputs = _step(scheduler, ignore_mask=True)
    assert outputs[0].finish_reason == "abort"
    assert "does not allow" in outputs[0].stop_reason
    assert outputs[0].new_token_ids == [], "a token that breaks the grammar is not emitted"


def test_abort_while_compiling(backend):
    scheduler = _scheduler(backend)
    backend.release.clear()
    scheduler.add_request(_request("json", "20 2"))
    scheduler.abort_requests(["json"])
    backend.release.set()
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.grammars.manager._requests


def test_scheduler_without_manager_rejects_constrained_requests():
    scheduler = OneBudgetScheduler(SchedulerConfig(), CacheConfig(block_size=BLOCK), 16)
    with pytest.raises(ValueError, match="without a StructuredOutputManager"):
        scheduler.add_request(_request("json", "1 2"))


# -- grammars after the model's thought (structured_outputs_config.reasoning_parser) -----

THINK, END_THINK = 60, 61
MARKERS = ReasoningMarkers("qwen3", (THINK,), (END_THINK,))


def _bit(token: int) -> np.int32:
    return np.uint32(1 << (token % 32)).view(np.int32)


def _allows(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def _thinking(request_id: str, grammar: str, reasoning_ended, **params) -> Request:
    request = _request(request_id, grammar, **params)
    request.reasoning_ended = reasoning_ended
    return request


def _masks(scheduler, drafts: dict[str, list[int]] | None = None) -> dict[str, list[set[int]]]:
    """Each constrained request's rows (allowed tokens per position) for a step that
    samples them all, verifying ``drafts``."""
    manager = scheduler.grammars.manager
    for request_id in scheduler.requests:
        manager._requests[request_id].future.result(timeout=10)
        assert manager.is_ready(request_id)
    bitmask = manager.grammar_bitmask(list(scheduler.requests), drafts)
    if bitmask is None:
        return {}
    rows: dict[str, list[set[int]]] = {}
    for req_id, row in zip(bitmask.req_ids, bitmask.bitmask, strict=True):
        rows.setdefault(req_id, []).append(_allows(row))
    return rows


ALL = set(range(VOCAB))


def test_a_thought_is_free_and_its_end_starts_the_grammar(backend):
    scheduler = _scheduler(backend, reasoning=MARKERS)
    scheduler.add_request(_thinking("opened", "20 21 2", False, max_tokens=10))
    scheduler.add_request(_thinking("closed", "20 21 2", True, max_tokens=10))
    assert _masks(scheduler) == {"opened": [ALL], "closed": [{20}]}
    only_free = _scheduler(backend, reasoning=MARKERS)
    only_free.add_request(_thinking("opened", "20 21 2", False))
    _masks(only_free)
    assert only_free.grammars.manager.grammar_bitmask(["opened"]) is None, "no row restricts"
    # an engine without markers applies grammars from the first token, whatever the request
    without = _scheduler(backend)
    without.add_request(_thinking("opened", "20 21 2", False))
    assert _masks(without) == {"opened": [{20}]}

    # Two free tokens, the end marker and the grammar's first token arrive in one step.
    request = scheduler.requests["opened"]
    assert scheduler.grammars.advance(request, [FILLER, 33, END_THINK, 20]) == 4
    assert scheduler.grammars.manager._requests["opened"].matcher.position == 1
    assert _masks(scheduler)["opened"] == [{21}]
    # A token the grammar forbids after the thought still ends the request.
    assert scheduler.grammars.advance(request, [FILLER]) == 0
    assert request.status is RequestStatus.FINISHED_ABORTED


def test_the_first_token_decides_where_the_prompt_did_not(backend):
    """``reasoning_ended`` None (Qwen3's template left ``<think>`` to the model): the first
    row is the grammar's plus the start marker; a start marker opens a thought, any other
    token is the answer's first."""
    scheduler = _scheduler(backend, reasoning=MARKERS)
    scheduler.add_request(_thinking("thinks", "20 21 2", None))
    scheduler.add_request(_thinking("answers", "20 21 2", None))
    assert _masks(scheduler) == {"thinks": [{20, THINK}], "answers": [{20, THINK}]}
    scheduler.grammars.advance(scheduler.requests["thinks"], [THINK])
    scheduler.grammars.advance(scheduler.requests["answers"], [20])
    assert _masks(scheduler) == {"thinks": [ALL], "answers": [{21}]}
    # in the answer, a start or end marker is the grammar's to allow (here: not)
    scheduler.grammars.advance(scheduler.requests["thinks"], [END_THINK, 20])
    assert _masks(scheduler) == {"thinks": [{21}], "answers": [{21}]}


def test_leading_whitespace_leaves_the_first_token_to_decide(backend):
    """As the reasoning parsers skip leading whitespace before looking for the start
    marker, a whitespace token where the first token decides is free and unseen by the
    grammar: a start marker after it still opens a thought, and the grammar starts at the
    first other token."""
    space = 33
    markers = ReasoningMarkers("qwen3", (THINK,), (END_THINK,), frozenset({space}))
    scheduler = _scheduler(backend, reasoning=markers)
    scheduler.add_request(_thinking("thinks", "20 21 2", None))
    scheduler.add_request(_thinking("answers", "20 21 2", None))
    assert _masks(scheduler) == {"thinks": [{20, THINK}], "answers": [{20, THINK}]}
    assert scheduler.grammars.advance(scheduler.requests["thinks"], [space, THINK]) == 2
    assert scheduler.grammars.advance(scheduler.requests["answers"], [space, space, 20]) == 3
    assert _masks(scheduler) == {"thinks": [ALL], "answers": [{21}]}
    assert scheduler.grammars.manager._requests["answers"].matcher.position == 1
    # drafts: the rows after whitespace still let the next token decide
    drafted = _scheduler(backend, reasoning=markers)
    drafted.add_request(_thinking("r", "20 21 2", None))
    rows = [{20, THINK}, {20, THINK}, ALL, {20}]
    assert _masks(drafted, {"r": [space, THINK, END_THINK]}) == {"r": rows}


@pytest.mark.parametrize(
    ("reasoning_ended", "drafts", "rows"),
    [
        # the end marker among the drafts: the positions after it are the grammar's
        (False, [FILLER, END_THINK, 20, 21], [ALL, ALL, {20}, {21}, {2}]),
        # a draft the grammar rejects right after the end: the rest are never used
        (False, [END_THINK, 33, 20], [ALL, {20}, ALL, ALL]),
        # still thinking at the last draft
        (False, [FILLER, THINK, FILLER], [ALL, ALL, ALL, ALL]),
        # the first draft decides: a thought, then its end
        (None, [THINK, FILLER, END_THINK], [{20, THINK}, ALL, ALL, {20}]),
        # the first draft decides: the answer (the end marker is then the grammar's)
        (None, [20, END_THINK, 21], [{20, THINK}, {21}, ALL, ALL]),
        (True, [20, 21], [{20}, {21}, {2}]),
        # an unknown draft (-1): nothing is known after it
        (False, [END_THINK, -1, 21], [ALL, {20}, ALL, ALL]),
    ],
)
def test_rows_of_drafts_that_straddle_the_end_of_the_thought(
    backend, reasoning_ended, drafts, rows
):
    scheduler = _scheduler(backend, reasoning=MARKERS)
    scheduler.add_request(_thinking("r", "20 21 2", reasoning_ended))
    free = all(row == ALL for row in rows)  # no bitmask at all then
    assert _masks(scheduler, {"r": drafts}) == ({} if free else {"r": rows})
    state = scheduler.grammars.manager._requests["r"]
    assert state.matcher.position == 0 and state.reasoning == reasoning_ended, "rolled back"


def test_thinking_through_steps_preemption_and_samples(backend):
    """A scheduler run: the thought's tokens pass free, the answer follows the grammar; a
    preempted request recomputes and keeps its state; each of n samples has its own."""
    scheduler = _scheduler(backend, reasoning=MARKERS)
    for index in range(2):  # two samples of one prompt: the engine's n=2 children
        scheduler.add_request(_thinking(f"{index}_r", "20 21 2", False, max_tokens=12))
    script = {"0_r": [FILLER, END_THINK], "1_r": [FILLER, FILLER, FILLER, END_THINK]}
    tokens: dict[str, list[int]] = {}
    finished = {}
    for step in range(30):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        bitmask = scheduler.get_grammar_bitmask(output)
        masks = {}
        if bitmask is not None:
            masks = dict(zip(bitmask.req_ids, bitmask.bitmask, strict=True))
        sampled = []
        for req_id in output.req_ids:
            request = scheduler.requests[req_id]
            done = len(request.output_token_ids)
            if done < len(script[req_id]):
                assert req_id not in masks or _allows(masks[req_id]) == ALL
                sampled.append([script[req_id][done]])
            else:
                sampled.append([_lowest_allowed(masks[req_id])])
        for out in scheduler.update_from_output(output, ModelRunnerOutput(output.req_ids, sampled)):
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.req_id] = out
        if step == 2:
            request = scheduler.requests["1_r"]
            scheduler.running.remove(request)
            scheduler._preempt(request)
    assert tokens == {"0_r": [FILLER, END_THINK, 20, 21, 2], "1_r": [*script["1_r"], 20, 21, 2]}
    assert all(out.finish_reason == "stop" for out in finished.values())
    assert not scheduler.grammars.manager._requests
