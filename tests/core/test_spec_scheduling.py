"""Speculative decoding in the scheduler, on the real engine core with a host-side model and
a host-side paged KV cache: drafts scheduled inside the budget, rejected ones rolled back,
and exactly the tokens of greedy decoding without speculation, through chunked prefill,
prefix hits, preemption, stops and asynchronous scheduling.

The executor plays a worker: it keeps each request's tokens (also those the scheduler has
not seen), holds the drafts its "proposer" made, writes every fed token into a slot of a
simulated KV cache through the request's block table, and checks before each step that
every earlier position's slot holds that position's real token. A rollback that is off by
one, a rejected draft left in the cache, or a prefix block hashed with a draft in it fails
that check.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedlm.config import (
    ArchConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedlm.core.engine_core import EngineCore
from pagedlm.core.request import Request
from pagedlm.executor import Executor
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import FinishedStep, ModelRunnerOutput, SchedulerOutput

VOCAB, EOS, BLOCK, JUNK = 50, 2, 4, 49


def next_token(tokens: list[int]) -> int:
    """A deterministic greedy 'model'."""
    value = len(tokens)
    for token in tokens[-6:]:
        value = (value * 131 + token * 7 + 11) % 1_000_003
    return value % VOCAB


class SpeculatingExecutor(Executor):
    """A worker with a greedy host model, a proposer that is right with probability
    ``accuracy`` (and sometimes drafts fewer tokens), and a simulated paged KV cache."""

    name = "speculating-host-model"

    def __init__(self, num_blocks: int, accuracy: float, seed: int = 0) -> None:
        self.num_blocks = num_blocks
        self.accuracy = accuracy
        self.rng = random.Random(seed)
        self.kv: dict[int, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.drafts: dict[str, list[int]] = {}
        self.rejected: dict[str, int] = {}
        self.last_drafts: dict[str, int] = {}
        self.forward: ModelRunnerOutput | None = None
        self.num_verified = 0

    def determine_num_kv_blocks(self) -> int:
        return self.num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def _slot(self, req_id: str, position: int) -> int:
        return self.tables[req_id][position // BLOCK] * BLOCK + position % BLOCK

    def _propose(self, tokens: list[int], count: int) -> list[int]:
        if self.rng.random() < 0.2:
            count = self.rng.randint(0, count)  # a proposer may find fewer
        drafts: list[int] = []
        for _ in range(count):
            right = next_token(tokens + drafts)
            drafts.append(right if self.rng.random() < self.accuracy else (right + 1) % VOCAB)
        return drafts

    def execute_model(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            for state in (self.tokens, self.tables, self.drafts, self.rejected):
                state.pop(req_id, None)
        for req_id in so.preempted_req_ids:  # a preempted request keeps only its tokens
            self.tables.pop(req_id, None)
            self.drafts.pop(req_id, None)
        for data in so.scheduled_new_reqs:
            if data.req_id in self.tokens:
                assert data.token_ids == self.tokens[data.req_id], "a resume lost tokens"
            self.tokens[data.req_id] = list(data.token_ids)
            self.tables[data.req_id] = list(data.block_ids)
            self.drafts[data.req_id] = []
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            self.tables[req_id] += new_blocks
        sampled, proposed = [], {}
        starts = dict(zip(so.req_ids, so.num_computed_tokens, strict=True))
        for req_id in so.req_ids:
            start = starts[req_id]
            if req_id in so.num_drafts_in_flight:
                assert so.num_drafts_in_flight[req_id] == self.last_drafts[req_id]
                start -= self.rejected[req_id]
            result = self._run(req_id, start, so)
            sampled.append(result)
            if result and req_id in so.num_drafts_to_propose:
                self.drafts[req_id] = self._propose(
                    self.tokens[req_id], so.num_drafts_to_propose[req_id]
                )
                proposed[req_id] = list(self.drafts[req_id])
            elif result:
                self.drafts[req_id] = []
        self.forward = ModelRunnerOutput(so.req_ids, sampled, draft_token_ids=proposed)

    def _run(self, req_id: str, start: int, so: SchedulerOutput) -> list[int]:
        tokens = self.tokens[req_id]
        scheduled = so.scheduled_spec_decode_tokens.get(req_id, [])
        num_drafts = len(scheduled)
        end = start + so.num_scheduled_tokens[req_id] - num_drafts
        assert end <= len(tokens), "fed a token that does not exist yet"
        held = self.drafts.get(req_id, [])
        for ids, held_id in zip(scheduled, held):
            assert ids in (-1, held_id), "the scheduler's draft ids are not the proposer's"
        drafts = [held[j] if j < len(held) else JUNK for j in range(num_drafts)]
        fed = tokens[start:end] + drafts
        for offset, token in enumerate(fed):
            self.kv[self._slot(req_id, start + offset)] = token
        for position in range(end):  # every position before the drafts holds its token
            assert self.kv[self._slot(req_id, position)] == tokens[position], (req_id, position)
        if end < len(tokens):
            return []  # a prefill chunk
        verified = min(num_drafts, len(held))
        accepted = 0
        while accepted < verified and drafts[accepted] == next_token(tokens + drafts[:accepted]):
            accepted += 1
        emitted = drafts[:accepted] + [next_token(tokens + drafts[:accepted])]
        tokens.extend(emitted)
        self.rejected[req_id] = num_drafts - accepted
        self.last_drafts[req_id] = num_drafts
        self.num_verified += verified
        return emitted

    def sample_tokens(self, grammar_bitmask) -> FinishedStep:
        output, self.forward = self.forward, None
        return FinishedStep(output or ModelRunnerOutput([], []))


def make_core(
    executor: Executor,
    async_scheduling: bool,
    speculative: SpeculativeConfig | None,
    num_blocks: int,
    budget: int = 16,
) -> EngineCore:
    arch = ArchConfig("LlamaForCausalLM", VOCAB, 8, 1, 2, 2, 4, 16)
    config = EngineConfig(
        ModelConfig("host-model", None, arch, torch.float32, 128),
        CacheConfig(block_size=BLOCK, num_kv_blocks=num_blocks),
        SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=budget,
            max_model_len=128,
            async_scheduling=async_scheduling,
        ),
        "cpu",
        speculative=speculative,
    )
    return EngineCore(config, platform=None, executor=executor)  # type: ignore[arg-type]


def make_requests(seed: int, count: int = 12) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(9)]
    requests = []
    for i in range(count):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:
            prompt = shared + prompt  # prefix-cache hits
        params = SamplingParams(
            max_tokens=rng.randint(3, 30),
            min_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=rng.choice([[], [rng.randrange(3, VOCAB)]]),
            ignore_eos=rng.random() < 0.2,
        )
        params.all_stop_token_ids = {EOS, *params.stop_token_ids}
        requests.append(Request(f"r{i}", prompt, params, {EOS}))
    return requests


def run(core: EngineCore, requests: list[Request]) -> dict[str, tuple]:
    results: dict[str, list] = {r.request_id: [[], None, None] for r in requests}
    pending = list(requests)
    steps = 0
    while pending or core.has_unfinished_requests():
        if pending:
            core.add_request(pending.pop(0))
        for out in core.step():
            assert results[out.req_id][1] is None, f"{out.req_id} reported after it finished"
            results[out.req_id][0] += out.new_token_ids
            if out.finished:
                results[out.req_id][1:] = [out.finish_reason, out.stop_reason]
        steps += 1
        assert steps < 3000, "the engine stopped making progress"
    scheduler = core.scheduler
    assert scheduler.kv_manager.num_free_blocks == scheduler.num_blocks, "blocks leaked"
    assert not scheduler.requests
    return {
        k: tuple(map(lambda v: tuple(v) if isinstance(v, list) else v, r))
        for k, r in results.items()
    }


def spec_config(method: str = "ngram", k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method, k, disable_by_batch_size=None, min_acceptance_rate=0.0)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])  # draft_model: slots ahead
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_blocks", [64, 18])
def test_greedy_tokens_are_those_without_speculation(
    method: str, async_scheduling: bool, num_blocks: int
) -> None:
    seed = num_blocks
    plain = make_core(SpeculatingExecutor(num_blocks, 0.0), False, None, num_blocks)
    expected = run(plain, make_requests(seed))
    executor = SpeculatingExecutor(num_blocks, accuracy=0.7, seed=seed)
    core = make_core(executor, async_scheduling, spec_config(method), num_blocks)
    assert run(core, make_requests(seed)) == expected
    stats = core.scheduler.make_stats().spec_decoding
    assert stats is not None and stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens <= executor.num_verified
    if not async_scheduling:  # (asynchronously, steps after a request's stop are dropped)
        assert stats.num_draft_tokens == executor.num_verified
    if num_blocks == 18:
        assert core.scheduler.num_preemptions > 0


def test_every_draft_right_takes_fewer_steps_and_all_are_accepted() -> None:
    requests = [
        Request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True), set())
        for i in range(2)
    ]
    executor = SpeculatingExecutor(64, accuracy=1.0)
    executor.rng = random.Random(1)
    executor.rng.random = lambda: 0.5  # type: ignore[method-assign]  # never draft fewer
    core = make_core(executor, False, spec_config(k=4), 64)
    steps = 0
    for request in requests:
        core.add_request(request)
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    stats = core.scheduler.make_stats().spec_decoding
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    per_position = stats.num_accepted_tokens_per_pos
    assert per_position[0] == stats.num_drafts and list(per_position) == sorted(per_position)[::-1]
    assert steps <= 1 + -(-39 // 5)  # the prefill's token, then 5 tokens per step


@pytest.mark.parametrize("method", ["ngram", "draft_model"])  # draft_model: slots ahead
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prompt_len", [3, 21])  # 21: a chunked prefill (budget 8)
def test_the_step_after_a_prefill_verifies_drafts(
    method: str, async_scheduling: bool, prompt_len: int
) -> None:
    """The step that ends a prompt asks for drafts, so a request's first decode step
    verifies them (not one plain step first); chunks before the last ask for none."""
    executor = SpeculatingExecutor(64, accuracy=1.0)
    executor.rng.random = lambda: 0.5  # type: ignore[method-assign]  # never draft fewer
    core = make_core(executor, async_scheduling, spec_config(method, k=4), 64, budget=8)
    prompt = [3 + i % 40 for i in range(prompt_len)]
    request = Request("r", prompt, SamplingParams(max_tokens=11, ignore_eos=True), set())
    steps: list[tuple[int, int, int]] = []  # (tokens scheduled, drafts verified, asked for)
    schedule = core.scheduler.schedule

    def recorded() -> SchedulerOutput:
        so = schedule()
        if so.num_scheduled_tokens:
            drafts = so.scheduled_spec_decode_tokens.get("r", [])
            steps.append(
                (so.num_scheduled_tokens["r"], len(drafts), so.num_drafts_to_propose.get("r", 0))
            )
        return so

    core.scheduler.schedule = recorded  # type: ignore[method-assign]
    outputs = run(core, [request])["r"][0]
    chunks = -(-prompt_len // 8)
    assert [asked for _, _, asked in steps[:chunks]] == [0] * (chunks - 1) + [4]
    assert steps[chunks] == (5, 4, 4)  # the first decode step: its token and 4 drafts
    assert len(steps) == chunks + 2  # 1 + 5 + 5 tokens
    tokens = list(prompt)
    for _ in range(11):
        tokens.append(next_token(tokens))
    assert list(outputs) == tokens[prompt_len:]


def test_drafts_stay_inside_the_budget_and_the_length_limits() -> None:
    executor = SpeculatingExecutor(64, accuracy=1.0)
    core = make_core(executor, False, spec_config(k=6), 64, budget=8)
    for i in range(3):
        params = SamplingParams(max_tokens=9 + i, ignore_eos=True)
        core.add_request(Request(f"r{i}", [3 + i] * 3, params, set()))
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        so = core.scheduler.schedule()
        assert so.total_num_scheduled_tokens <= 8
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            request = core.scheduler.requests[req_id]
            assert (
                request.num_tokens + len(drafts) - request.num_prompt_tokens <= request.max_tokens
            )
        core.executor.execute_model(so)
        result = core.executor.sample_tokens(None).result()
        for out in core.scheduler.update_from_output(so, result):
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert {r: len(t) for r, t in outputs.items()} == {"r0": 9, "r1": 10, "r2": 11}


def test_the_policy_stops_proposing_for_large_batches_and_low_acceptance() -> None:
    config = SpeculativeConfig("ngram", 3, disable_by_batch_size=2, min_acceptance_rate=0.5)
    executor = SpeculatingExecutor(64, accuracy=0.0)
    core = make_core(executor, False, config, 64)
    for i, max_tokens in enumerate([4, 60, 60]):  # two run on alone once the first is done
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        core.add_request(Request(f"r{i}", [3 + i] * 3, params, set()))
    proposing_steps = 0
    while core.has_unfinished_requests():
        so = core.scheduler.schedule()
        if so.num_drafts_to_propose:
            proposing_steps += 1
            assert len(core.scheduler.running) <= 2
        core.executor.execute_model(so)
        core.scheduler.update_from_output(so, core.executor.sample_tokens(None).result())
    # Never-right drafts: each request stops after a few verifications, then only probes.
    stats = core.scheduler.make_stats().spec_decoding
    assert stats.num_accepted_tokens == 0 and 0 < stats.num_drafts <= 2 * (3 + 60 // 16)
    assert proposing_steps < 20


class NothingFoundExecutor(SpeculatingExecutor):
    """A proposer that never finds drafts (prompt lookup in text that does not repeat)."""

    def _propose(self, tokens: list[int], count: int) -> list[int]:
        return []


class LateMatchExecutor(SpeculatingExecutor):
    """Prompt lookup that finds nothing until the output is 12 tokens long, then the right
    continuation every time (text that starts repeating itself)."""

    def _propose(self, tokens: list[int], count: int) -> list[int]:
        if len(tokens) < 3 + 12:
            return []
        drafts: list[int] = []
        for _ in range(count):
            drafts.append(next_token(tokens + drafts))
        return drafts


def test_scheduled_synchronously_a_request_asks_again_after_an_empty_proposal() -> None:
    """An empty proposal costs nothing when the next step is scheduled after it is known,
    so the request keeps asking and its drafts start with the first match, not at a probe."""
    executor = LateMatchExecutor(64, accuracy=1.0)
    core = make_core(executor, False, SpeculativeConfig("ngram", 4), 64)
    request = Request("r", [3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True), set())
    asked = []
    schedule = core.scheduler.schedule

    def recorded() -> SchedulerOutput:
        so = schedule()
        asked.append("r" in so.num_drafts_to_propose)
        return so

    core.scheduler.schedule = recorded  # type: ignore[method-assign]
    outputs = run(core, [request])["r"][0]
    tokens = [3, 4, 5]
    for _ in range(40):
        tokens.append(next_token(tokens))
    assert list(outputs) == tokens[3:]
    assert all(asked[:-1])  # every step but the last (no room left) asked for drafts
    # The prompt's step and 11 plain ones, then 28 tokens at 5 per step.
    assert len(asked) == 1 + 11 + -(-28 // 5)


def test_asynchronously_a_request_that_found_nothing_resumes_at_a_probe() -> None:
    """Asynchronously, empty proposals in a row make a request only probe, and then verify
    no placeholders; a probe that finds drafts brings its drafts back within a few steps."""
    executor = LateMatchExecutor(64, accuracy=1.0)
    core = make_core(executor, True, SpeculativeConfig("ngram", 4), 64)
    request = Request("r", [3, 4, 5], SamplingParams(max_tokens=80, ignore_eos=True), set())
    outputs = run(core, [request])["r"][0]
    tokens = [3, 4, 5]
    for _ in range(80):
        tokens.append(next_token(tokens))
    assert list(outputs) == tokens[3:]
    stats = core.scheduler.make_stats().spec_decoding
    # Matches from the 12th token on; the probe at the 16th step finds them: about 60
    # tokens are left by then, 4 of each 5 of them accepted drafts.
    assert stats.num_accepted_tokens == stats.num_draft_tokens >= 40


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_proposer_that_finds_nothing_costs_few_tokens(async_scheduling: bool) -> None:
    """Asynchronously, a step after a proposing one is scheduled with placeholders for
    the drafts before anyone knows there are none; the policy must stop asking after an
    empty proposal (probing now and then), or every step computes 1 + k tokens.
    Synchronously an empty proposal costs no token, and the request keeps asking."""

    def computed_tokens(config: SpeculativeConfig | None) -> tuple[int, dict]:
        executor = NothingFoundExecutor(64, accuracy=0.0)
        core = make_core(executor, async_scheduling, config, 64)
        total = 0
        execute = executor.execute_model

        def counting(so: SchedulerOutput) -> None:
            nonlocal total
            total += so.total_num_scheduled_tokens
            execute(so)

        executor.execute_model = counting  # type: ignore[method-assign]
        requests = [
            Request(f"r{i}", [3 + i] * 3, SamplingParams(max_tokens=80, ignore_eos=True), set())
            for i in range(3)
        ]
        outputs = run(core, requests)
        return total, outputs

    plain, expected = computed_tokens(None)
    config = SpeculativeConfig("ngram", 4, disable_by_batch_size=None)
    speculating, outputs = computed_tokens(config)
    assert outputs == expected
    if not async_scheduling:
        assert speculating == plain
        return
    # One wasted verification of 4 placeholders per request (scheduled before its first
    # proposal came back empty); after that no step verifies placeholders.
    assert speculating <= plain + 3 * 4
