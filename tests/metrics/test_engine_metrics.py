"""The engine's metrics against vLLM's: bucket boundaries, and values after aborts,
preemption, n > 1 and rejected requests, driven through ``LLMEngine`` on a tiny
checkpoint (CPU)."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.metrics import EngineMetrics
from pagedlm.metrics.sequence_stats import SequenceStats
from pagedlm.outputs import RequestOutput

VLLM_TPOT_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
VLLM_BUCKETS = {
    "time_to_first_token_seconds": [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
        2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ],
    "inter_token_latency_seconds": VLLM_TPOT_BUCKETS,
    "request_time_per_output_token_seconds": VLLM_TPOT_BUCKETS,
    "e2e_request_latency_seconds": [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
        40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
    ],
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_params_n": [1, 2, 5, 10, 20],
    "request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
    "request_max_num_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000],
}  # fmt: skip
"""vLLM v1's ``PrometheusStatLogger`` buckets (token counts for max_model_len=2048)."""
LATENCY_PHASES = ("queue", "prefill", "decode", "inference")


def test_histogram_buckets_are_vllms():
    histograms = SequenceStats(max_model_len=2048).engines[0].histograms
    for name, bounds in VLLM_BUCKETS.items():
        assert list(histograms[f"pagedlm:{name}"].bounds) == bounds, name
    # Removed from vLLM after its deprecation (inter_token_latency_seconds replaced it).
    assert "pagedlm:time_per_output_token_seconds" not in histograms
    for phase in LATENCY_PHASES:
        assert histograms[f"pagedlm:request_{phase}_time_seconds"].bounds == tuple(
            VLLM_BUCKETS["e2e_request_latency_seconds"]
        )


def _snapshot(engine_metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0)
    return {
        (metric.name, tuple(sorted(metric.labels.items()))): metric.value
        for metric in engine_metrics.snapshot(stats)
    }


def test_request_the_core_aborted_is_counted_under_abort():
    """vLLM counts a request the engine core ends with "abort" (a pause, a grammar that
    failed to compile) in ``request_success{finished_reason="abort"}``; a client's abort
    is not counted. Every reason vLLM can report here is exported, 0 included."""
    metrics = EngineMetrics(max_model_len=64)
    for request_id in ("paused", "client"):
        child = SimpleNamespace(
            request_id=f"{request_id}-0",
            prompt_token_ids=[1, 2, 3],
            arrival_time=0.0,
            sampling_params=SimpleNamespace(max_tokens=8),
        )
        metrics.record_request(request_id, [child])
    metrics.record_outputs([EngineCoreOutput("paused-0", [5]), EngineCoreOutput("client-0", [5])])
    metrics.forget_request("client")
    metrics.record_outputs(
        [
            EngineCoreOutput("paused-0", [6], finish_reason="abort"),
            EngineCoreOutput("client-0", [], finish_reason="abort"),
        ]
    )
    values = _snapshot(metrics)
    success = "pagedlm:request_success"
    reasons = {"abort": 1, "stop": 0, "length": 0, "error": 0, "repetition": 0}
    for reason, expected in reasons.items():  # vLLM's FinishReason values, each exported
        assert values[(success, (("engine", "0"), ("finished_reason", reason)))] == expected
    histograms = metrics.sequences.engines[0].histograms
    assert histograms["pagedlm:e2e_request_latency_seconds"].count == 1
    assert histograms["pagedlm:request_params_n"].count == 1
    assert values[("pagedlm:prompt_tokens", (("engine", "0"),))] == 6  # both prefills finished


def _values(llm: LLM) -> dict[str, float]:
    """Counter and gauge values by name (summed over labels); histograms' counts."""
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = metric.buckets[-1][1] if metric.kind == "histogram" else metric.value
        values[metric.name] = values.get(metric.name, 0.0) + value
    return values


def _drain(llm: LLM, on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
    engine = llm.llm_engine
    while engine.has_unfinished_requests():
        outputs = engine.step()
        values = _values(llm)
        assert 0.0 <= values["pagedlm:kv_cache_usage_perc"] <= 1.0
        # vLLM's reasons (capacity, deferred) add up to the waiting requests.
        waiting = values["pagedlm:num_requests_waiting"]
        assert values["pagedlm:num_requests_waiting_by_reason"] == waiting
        if on_step is not None:
            on_step(outputs)


def _assert_idle(values: dict[str, float]) -> None:
    assert values["pagedlm:num_requests_running"] == 0
    assert values["pagedlm:num_requests_waiting"] == 0
    assert values["pagedlm:kv_cache_usage_perc"] == 0.0


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


def test_preemption_aborts_and_n_through_the_engine(llama):
    # 12 blocks of 16 cannot hold four 80-token sequences: the scheduler preempts.
    llm = LLM(
        llama,
        skip_tokenizer_init=True,
        num_kv_blocks=12,
        block_size=16,
        max_model_len=128,
        disable_log_stats=False,
    )
    engine = llm.llm_engine
    rng = random.Random(0)

    def prompt(length: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(384) for _ in range(length)]}

    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"long-{i}", prompt(40), long)
    n3 = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=3, ignore_eos=True)
    engine.add_request("n3", prompt(20), n3)
    engine.add_request("never-scheduled", prompt(10), long)
    engine.abort_request(["never-scheduled"])
    # Aborted mid-decode: its prompt was processed, but it never finishes.
    engine.add_request("mid-decode", prompt(10), long)

    def abort_mid_decode(outputs) -> None:
        if any(out.request_id == "mid-decode" for out in outputs):
            engine.abort_request(["mid-decode"])

    _drain(llm, abort_mid_decode)
    values = _values(llm)
    _assert_idle(values)
    assert values["pagedlm:num_preemptions"] > 0
    # Prefill tokens processed, once each: a preempted request's recomputation and the
    # request aborted before it was scheduled add nothing.
    assert values["pagedlm:prompt_tokens"] == 4 * 40 + 3 * 20 + 10
    # vLLM's split of them (summed over its sources): each token once, a recomputed last
    # token twice (computed and hit).
    assert values["pagedlm:prompt_tokens_by_source"] == (
        values["pagedlm:prompt_tokens"] + values["pagedlm:prompt_tokens_recomputed"]
    )
    # Queried once per sequence, when first admitted (vLLM leaves a resumed request's
    # lookup out); distinct random prompts hit nothing, the n=3 siblings at most their
    # shared first block.
    assert values["pagedlm:prefix_cache_queries"] == 4 * 40 + 3 * 20 + 10
    assert values["pagedlm:prefix_cache_hits"] <= 2 * 16
    assert values["pagedlm:request_success"] == 4 + 3  # per sequence; aborts excluded
    assert values["pagedlm:time_to_first_token_seconds"] == 4 + 3 + 1  # once per sequence
    assert values["pagedlm:e2e_request_latency_seconds"] == 4 + 3
    assert values["pagedlm:request_params_n"] == 4 + 1  # once per user request
    assert values["pagedlm:request_max_num_generation_tokens"] == 4 + 1
    generated = values["pagedlm:generation_tokens"]
    assert generated >= 4 * 40 + 3 * 3
    # Every token after a sequence's first is one inter-token latency.
    assert values["pagedlm:inter_token_latency_seconds"] == generated - (4 + 3 + 1)


def test_rejected_requests_leave_no_trace(llama):
    llm = LLM(
        llama,
        skip_tokenizer_init=True,
        num_kv_blocks=4,
        block_size=16,
        max_model_len=128,
        disable_log_stats=False,
    )
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match="max_model_len"):  # refused at validation
        engine.add_request("too-long", {"prompt_token_ids": [1] * 200}, params)
    with pytest.raises(ValueError):  # refused by the core: 100 tokens need 7 of 4 blocks
        engine.add_request("no-room", {"prompt_token_ids": [1] * 100}, params)
    values = _values(llm)
    _assert_idle(values)
    assert values["pagedlm:prompt_tokens"] == 0
    assert values["pagedlm:prefix_cache_queries"] == 0
    engine.add_request("fits", {"prompt_token_ids": [3] * 20}, params)
    _drain(llm)
    values = _values(llm)
    _assert_idle(values)
    assert values["pagedlm:prompt_tokens"] == 20
    assert values["pagedlm:request_success"] == 1
    assert values["pagedlm:request_params_n"] == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_inter_token_latency_once_per_step_under_speculation(llama, async_scheduling):
    """A verification step that accepts drafts brings several tokens: vLLM observes the
    sequence's inter-token latency once for it (the time since its previous step), not
    once per token. The target drafting for itself accepts every draft."""
    speculative = {"method": "draft_model", "model": llama, "num_speculative_tokens": 3}
    llm = LLM(
        llama,
        skip_tokenizer_init=True,
        num_kv_blocks=32,
        max_model_len=128,
        speculative_config=speculative,
        async_scheduling=async_scheduling,
        disable_log_stats=False,
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"s-{i}", {"prompt_token_ids": [5 + i, 6, 7, 8]}, params)
    steps_with_tokens: dict[str, int] = {}
    try:
        while engine.has_unfinished_requests():
            outputs = engine.engine_core.step()
            for output in outputs:
                if output.new_token_ids:
                    steps_with_tokens[output.req_id] = steps_with_tokens.get(output.req_id, 0) + 1
            engine.metrics.record_outputs(outputs)
            engine.output_processor.process_outputs(outputs)
    finally:
        engine.shutdown()
    values = _values(llm)
    assert values["pagedlm:generation_tokens"] == 2 * 16
    assert sum(steps_with_tokens.values()) < 2 * 16  # drafts were accepted
    later_steps = sum(steps - 1 for steps in steps_with_tokens.values())
    assert values["pagedlm:inter_token_latency_seconds"] == later_steps


def test_every_series_is_per_engine_as_vllms():
    """vLLM labels every series with ``engine`` (a data-parallel replica's index), but
    ``lora_requests_info`` (no engine, no model) and ``cache_config_info`` (per engine);
    ``engine_sleep_state`` says awake / weights_offloaded (level 1) / discard_all (2)."""
    from pagedlm.engine.data_parallel import sum_stats

    metrics = EngineMetrics(max_model_len=64, cache_info={"block_size": "16"}, num_engines=2)
    replicas = [
        SchedulerStats(2, 1, 0.5, 3, 40, 16, external_prefix_cache_queries=24),
        SchedulerStats(1, 0, 0.25, 0, 8, 0, max_loras=2, running_lora_adapters={"sql": 1}),
    ]
    stats = sum_stats(replicas)
    snapshot = metrics.snapshot(stats, sleep_level=1)
    by_key = {(m.name, tuple(sorted(m.labels.items()))): m.value for m in snapshot}
    for metric in snapshot:
        if metric.name == "pagedlm:lora_requests_info":
            assert "engine" not in metric.labels and metric.labels["running_lora_adapters"] == "sql"
        else:
            assert metric.labels["engine"] in ("0", "1"), metric
    per_engine = {
        ("pagedlm:num_requests_running", "0"): 2,
        ("pagedlm:num_requests_running", "1"): 1,
        ("pagedlm:kv_cache_usage_perc", "1"): 0.25,
        ("pagedlm:num_preemptions", "0"): 3,
        ("pagedlm:prefix_cache_queries", "1"): 8,
        ("pagedlm:external_prefix_cache_queries", "0"): 24,
        ("pagedlm:external_prefix_cache_hits", "1"): 0,
    }
    for (name, engine), expected in per_engine.items():
        assert by_key[(name, (("engine", engine),))] == expected, name
    for engine in ("0", "1"):
        sleep = {
            state: by_key[
                ("pagedlm:engine_sleep_state", (("engine", engine), ("sleep_state", state)))
            ]
            for state in ("awake", "weights_offloaded", "discard_all")
        }
        assert sleep == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
        info = ("pagedlm:cache_config_info", (("block_size", "16"), ("engine", engine)))
        assert by_key[info] == 1
    asleep = {
        m.labels["sleep_state"]: m.value
        for m in metrics.snapshot(stats, sleep_level=2)
        if m.name == "pagedlm:engine_sleep_state" and m.labels["engine"] == "0"
    }
    assert asleep == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}


def test_llm_keeps_no_metrics_by_default_as_vllms(llama, monkeypatch):
    """``LLM(...)`` defaults ``disable_log_stats`` to True, as vLLM's: its steps spend
    nothing on metrics, and ``get_metrics`` says which flag brings them."""
    from pagedlm.metrics import EngineMetrics

    calls: list[str] = []
    for method in ("record_request", "record_outputs", "record_stopped", "forget_request"):
        original = getattr(EngineMetrics, method)

        def spy(self, *args, _name=method, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(EngineMetrics, method, spy)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    quiet = LLM(llama, skip_tokenizer_init=True, num_kv_blocks=16, max_model_len=128)
    quiet.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert calls == []
    with pytest.raises(ValueError, match=r"disable_log_stats=False"):
        quiet.get_metrics()
    counted = LLM(
        llama, skip_tokenizer_init=True, num_kv_blocks=16, max_model_len=128,
        disable_log_stats=False,
    )  # fmt: skip
    counted.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert {"record_request", "record_outputs"} <= set(calls)
    assert any(
        m.name == "pagedlm:generation_tokens" and m.value == 4 for m in counted.get_metrics()
    )
