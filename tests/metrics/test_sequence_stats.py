"""Per-sequence histograms (vLLM v1's semantics) on hand-made engine-core outputs: per
sequence, per engine (vLLM's ``engine`` label), inter-token latency once per step."""

from __future__ import annotations

import pytest

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.metrics.sequence_stats import Histogram, SequenceStats, build_1_2_5_buckets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def count(stats: SequenceStats, name: str, engine: int = 0) -> int:
    return stats.engines[engine].histograms[f"pagedlm:{name}"].count


def total(stats: SequenceStats, name: str, engine: int = 0) -> float:
    return stats.engines[engine].histograms[f"pagedlm:{name}"].sum


def test_buckets_and_cumulative_counts():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    histogram = Histogram((1, 2))
    for value in (0.5, 1.0, 1.5, 3.0):
        histogram.observe(value)
    assert histogram.cumulative() == ((1.0, 2), (2.0, 3), (float("inf"), 4))
    assert histogram.sum == pytest.approx(6.0)


def test_n2_request_counts_two_sequences_and_one_n():
    clock = Clock()
    stats = SequenceStats(max_model_len=512, clock=clock)
    stats.add_request("r", ["r-0", "r-1"], 99.0, num_prompt_tokens=10, max_tokens=3)
    clock.now = 100.0  # scheduled at 99.5, first tokens at 100
    first = [EngineCoreOutput(f"r-{i}", [5], queued_seconds=0.5) for i in range(2)]
    stats.record_outputs(first)
    clock.now = 100.2
    stats.record_outputs([EngineCoreOutput("r-0", [6, 7], finish_reason="length")])
    assert count(stats, "request_params_n") == 0  # r-1 still runs
    clock.now = 101.0
    stats.record_outputs([EngineCoreOutput("r-1", [8], finish_reason="stop")])
    assert stats.engines[0].request_success == {"length": 1, "stop": 1}

    for name in (
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_max_tokens",
        "request_time_per_output_token_seconds",
        "time_to_first_token_seconds",
    ):
        assert count(stats, name) == 2, name
    assert count(stats, "request_params_n") == 1
    assert total(stats, "request_params_n") == 2
    assert total(stats, "time_to_first_token_seconds") == pytest.approx(2 * 1.0)
    assert total(stats, "request_queue_time_seconds") == pytest.approx(2 * 0.5)
    assert total(stats, "request_prefill_time_seconds") == pytest.approx(2 * 0.5)
    assert total(stats, "request_decode_time_seconds") == pytest.approx(0.2 + 1.0)
    assert total(stats, "request_inference_time_seconds") == pytest.approx(0.7 + 1.5)
    assert total(stats, "e2e_request_latency_seconds") == pytest.approx(1.2 + 2.0)
    assert total(stats, "request_generation_tokens") == 3 + 2
    assert total(stats, "request_prompt_tokens") == 20
    # r-0: 0.2 s over 2 later tokens; r-1: 1.0 s over 1 later token.
    assert total(stats, "request_time_per_output_token_seconds") == pytest.approx(0.1 + 1.0)
    # Once per step after the first: r-0's two tokens came in one step 0.2 s later, r-1's
    # one 1.0 s later.
    assert count(stats, "inter_token_latency_seconds") == 2
    assert total(stats, "inter_token_latency_seconds") == pytest.approx(0.2 + 1.0)
    assert "pagedlm:time_per_output_token_seconds" not in stats.engines[0].histograms
    assert count(stats, "request_max_num_generation_tokens") == 1  # once per user request
    assert total(stats, "request_max_num_generation_tokens") == 3  # r-0's 3 tokens, not r-1's 2
    # Step 1: two prefills of 10 tokens plus 2 tokens; then 2; then 1.
    assert count(stats, "iteration_tokens_total") == 3
    assert total(stats, "iteration_tokens_total") == 22 + 2 + 1


def test_stop_string_finish_and_abort():
    clock = Clock()
    stats = SequenceStats(max_model_len=64, clock=clock)
    stats.add_request("a", ["a-0"], 99.0, 4, None)
    stats.add_request("b", ["b-0"], 99.0, 4, 8)
    stats.record_outputs([EngineCoreOutput("a-0", [1]), EngineCoreOutput("b-0", [1])])
    stats.record_stopped(["a-0"])
    assert count(stats, "e2e_request_latency_seconds") == 1
    assert count(stats, "request_params_max_tokens") == 0  # a had no max_tokens
    stats.forget_request("b")  # aborted by its client: nothing more is observed
    stats.record_outputs([EngineCoreOutput("b-0", [2], finish_reason="length")])
    assert count(stats, "e2e_request_latency_seconds") == 1
    assert count(stats, "request_params_n") == 1
    assert stats.engines[0].num_prompt_tokens == 8  # a and b reached their first token
    assert stats.engines[0].num_generation_tokens == 2  # not b's token after its abort
    assert stats.engines[0].request_success == {"stop": 1}
    stats.add_request("c", ["c-0", "c-1"], 99.0, 4, 8)
    stats.forget_request("c")  # aborted before any token: its prompt was never processed
    assert stats.engines[0].num_prompt_tokens == 8


def test_inter_token_latency_is_one_observation_per_step():
    """vLLM observes a sequence's inter-token latency once per engine step, the time since
    its previous step's tokens: a verification step that accepts drafts (several tokens)
    is one observation, and so is the first step's (none: it is the first token)."""
    clock = Clock()
    stats = SequenceStats(max_model_len=64, clock=clock)
    stats.add_request("s", ["s-0"], 99.0, 4, 16)
    stats.record_outputs([EngineCoreOutput("s-0", [1, 2])])  # first token and a draft
    assert count(stats, "inter_token_latency_seconds") == 0
    for now, tokens in ((100.1, [3, 4, 5, 6]), (100.3, [7]), (100.6, [8, 9])):
        clock.now = now
        stats.record_outputs([EngineCoreOutput("s-0", tokens)])
    assert count(stats, "inter_token_latency_seconds") == 3
    assert total(stats, "inter_token_latency_seconds") == pytest.approx(0.6)
    clock.now = 101.0
    stats.record_outputs([EngineCoreOutput("s-0", [], finish_reason="abort")])  # a pause
    assert count(stats, "inter_token_latency_seconds") == 3  # no tokens, no latency
    # The per-sequence mean spreads the decode time over every later token.
    assert total(stats, "request_time_per_output_token_seconds") == pytest.approx(0.6 / 8)


def test_token_times_are_the_engine_cores():
    """Two steps whose messages the front end handles at the same moment: their tokens
    are timed by the core's clock at each step's end (``CoreOutputs.timestamp``), as vLLM
    times them, so the gap is the steps' and not zero; TTFT and e2e are the front end's."""
    clock = Clock()
    stats = SequenceStats(max_model_len=64, clock=clock)
    stats.add_request("s", ["s-0"], 99.0, 4, 16)
    clock.now = 101.0  # the front end got round to both messages late
    stats.record_outputs([EngineCoreOutput("s-0", [1], queued_seconds=0.5)], timestamp=100.0)
    stats.record_outputs([EngineCoreOutput("s-0", [2])], timestamp=100.25)
    stats.record_outputs([EngineCoreOutput("s-0", [3], finish_reason="length")], timestamp=100.75)
    assert total(stats, "inter_token_latency_seconds") == pytest.approx(0.25 + 0.5)
    assert total(stats, "time_to_first_token_seconds") == pytest.approx(2.0)
    assert total(stats, "request_prefill_time_seconds") == pytest.approx(0.5)
    assert total(stats, "request_decode_time_seconds") == pytest.approx(0.75)
    assert total(stats, "e2e_request_latency_seconds") == pytest.approx(2.0)


def test_each_engine_counts_its_own_sequences():
    """With data parallelism a sequence counts on the replica that ran it (vLLM's
    ``engine`` label); a user request's ``n`` on the engine of its last sequence."""
    clock = Clock()
    stats = SequenceStats(max_model_len=64, clock=clock, num_engines=2)
    stats.add_request("r", ["r-0", "r-1"], 99.0, 4, 8)
    stats.record_outputs(
        [EngineCoreOutput("r-0", [1]), EngineCoreOutput("r-1", [1], engine_index=1)]
    )
    clock.now = 100.5
    stats.record_outputs(
        [
            EngineCoreOutput("r-0", [2, 3], finish_reason="length"),
            EngineCoreOutput("r-1", [2], engine_index=1),
        ]
    )
    stats.record_outputs([EngineCoreOutput("r-1", [3], finish_reason="stop", engine_index=1)])
    zero, one = stats.engines
    assert (zero.num_prompt_tokens, one.num_prompt_tokens) == (4, 4)
    assert (zero.num_generation_tokens, one.num_generation_tokens) == (3, 3)
    assert zero.request_success == {"length": 1} and one.request_success == {"stop": 1}
    for engine in (0, 1):
        assert count(stats, "time_to_first_token_seconds", engine) == 1
        assert count(stats, "e2e_request_latency_seconds", engine) == 1
    assert count(stats, "inter_token_latency_seconds", 0) == 1
    assert count(stats, "inter_token_latency_seconds", 1) == 2
    # One observation of the step's tokens per engine that ran tokens in it.
    assert count(stats, "iteration_tokens_total", 0) == 2
    assert count(stats, "iteration_tokens_total", 1) == 3
    assert total(stats, "iteration_tokens_total", 0) == 4 + 1 + 2
    assert (count(stats, "request_params_n", 0), count(stats, "request_params_n", 1)) == (0, 1)


def test_cached_prompt_tokens_and_the_prefill_each_sequence_computed():
    """vLLM's ``prompt_tokens_cached`` and ``prompt_tokens_recomputed`` (counted when a
    sequence's prefill is done) and ``request_prefill_kv_computed_tokens`` (per finished
    sequence: its prompt less its cached tokens)."""
    stats = SequenceStats(max_model_len=64, clock=Clock())
    stats.add_request("a", ["a-0"], 99.0, 17, 4)  # 16 of 17 cached: the last recomputed
    stats.add_request("b", ["b-0"], 99.0, 10, 4)
    stats.add_request("c", ["c-0"], 99.0, 9, 4)  # a pause ends it before its prefill
    stats.record_outputs(
        [
            EngineCoreOutput("a-0", [1], num_cached_tokens=16),
            EngineCoreOutput("b-0", [1], num_cached_tokens=4),
        ]
    )
    stats.record_outputs(
        [
            EngineCoreOutput("a-0", [2], "length", num_cached_tokens=16),
            EngineCoreOutput("c-0", [], "abort"),
        ]
    )
    stats.record_stopped(["b-0"])
    series = stats.engines[0]
    assert (series.num_cached_prompt_tokens, series.num_recomputed_prompt_tokens) == (20, 1)
    assert series.num_prompt_tokens == 17 + 10
    assert count(stats, "request_prefill_kv_computed_tokens") == 3
    assert total(stats, "request_prefill_kv_computed_tokens") == 1 + 6 + 9


def test_prompt_tokens_by_source_as_vllm_splits_them():
    """vLLM's ``prompt_tokens_by_source``: computed tokens ("local_compute"), loaded ones
    ("external_kv_transfer") and the rest of the cached ones ("local_cache_hit"), counted
    when a sequence's prefill is done, a pooled one's included; a whole cached prompt's
    recomputed last token counts as computed and as a local hit, so the three sources
    exceed the prompt tokens by the recomputed ones (vLLM's invariant)."""
    stats = SequenceStats(max_model_len=64, clock=Clock())
    stats.add_request("a", ["a-0"], 99.0, 17, 4)  # 8 loaded, 8 hit locally, last recomputed
    stats.add_request("b", ["b-0"], 99.0, 10, 4)  # 4 loaded, 6 computed
    stats.add_request("c", ["c-0"], 99.0, 12, 1)  # pooled: 8 hit locally, 4 computed
    stats.add_request("d", ["d-0"], 99.0, 9, 4)  # aborted before its prefill: nothing
    stats.record_outputs(
        [
            EngineCoreOutput("a-0", [1], num_cached_tokens=16, num_external_computed_tokens=8),
            EngineCoreOutput("b-0", [1], num_cached_tokens=4, num_external_computed_tokens=4),
            EngineCoreOutput("c-0", [], "stop", num_cached_tokens=8, pooled=[0.5]),
            EngineCoreOutput("d-0", [], "abort"),
        ]
    )
    stats.record_outputs([EngineCoreOutput("a-0", [2], num_cached_tokens=16)])  # counted once
    series = stats.engines[0]
    by_source = series.prompt_tokens_by_source
    assert by_source == {
        "local_compute": 1 + 6 + 4,
        "local_cache_hit": (8 + 1) + 0 + 8,
        "external_kv_transfer": 8 + 4,
    }
    assert sum(by_source.values()) - series.num_recomputed_prompt_tokens == 17 + 10 + 12
    assert by_source["local_cache_hit"] + by_source["external_kv_transfer"] == (
        series.num_cached_prompt_tokens + series.num_recomputed_prompt_tokens
    )
