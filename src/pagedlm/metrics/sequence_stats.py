"""Per-sequence latency and size histograms, counted the way vLLM v1 counts them.

One user request with ``n`` samples is ``n`` engine-core sequences, and vLLM observes every
request-level histogram (time to first token, inter-token latency, end-to-end, queue,
prefill, decode, inference, prompt/generation tokens, ``max_tokens``) once per *sequence*,
the same unit as ``request_success_total``: an ``n=2`` request adds 2 to the success
counter and 2 observations to each latency histogram. Only ``request_params_n`` and
``request_max_num_generation_tokens`` (the most tokens any of its sequences generated) are
observed once per user request (when its last sequence finishes).

Times are ``time.monotonic()`` (the clock ``arrival_time`` uses, the machine's in every
process): a token's time is when the engine core's step ended, a finish's when the front
end handles it. Phases, as in vLLM's ``FinishedRequestStats``:

- queue:     arrival -> first scheduled (``EngineCoreOutput.queued_seconds``)
- prefill:   first scheduled -> first token
- decode:    first token -> last token
- inference: first scheduled -> last token
- request time per output token: decode / (generated tokens - 1); 0 for one token.

``inter_token_latency_seconds`` observes, once per step in which a sequence gets tokens
after its first, the time since its previous step's tokens (vLLM's: several tokens of one
step, speculative decoding's accepted drafts, are one observation). Token times are the
engine core's (``CoreOutputs.timestamp``), so a front end that handles several steps'
messages at once does not squeeze their gaps; TTFT and end-to-end latency are measured
when the front end handles the output, from the arrival time, as vLLM does.
(vLLM's older ``time_per_output_token_seconds`` is gone from vLLM, and from here.)

Everything is kept per engine (``EngineSeries``: vLLM's ``engine`` label, a data-parallel
replica's index, taken from ``EngineCoreOutput.engine_index``); a sequence's finish and
its user request's ``n`` count on the engine that ran it.

Pure Python (no prometheus_client): ``LLM.get_metrics()`` reports the same histograms as
``/metrics``; ``prometheus.py`` only renders them.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pagedlm.core.outputs import EngineCoreOutput

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's ``time_to_first_token_seconds`` buckets."""
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""vLLM's ``inter_token_latency_seconds`` and ``request_time_per_output_token_seconds``
buckets."""
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets for e2e, queue, prefill, decode and inference time."""
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""vLLM v1's ``iteration_tokens_total`` buckets (V0's ended at a mistyped 8096)."""
N_BUCKETS = (1, 2, 5, 10, 20)
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""vLLM's ``source`` labels of ``prompt_tokens_by_source``."""


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Histogram:
    """Cumulative Prometheus-style histogram: ``le`` upper bounds plus +Inf."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound falls in that bound's bucket (le semantics).
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: list[float]) -> None:
        """``observe`` each of ``values``, in order."""
        counts, bounds = self._counts, self.bounds
        total = self.sum
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1
            total += value
        self.sum = total

    @property
    def count(self) -> int:
        return sum(self._counts)

    def cumulative(self) -> tuple[tuple[float, int], ...]:
        """(upper bound, observations <= it) for every bound, then (inf, total)."""
        running, result = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self._counts):
            running += count
            result.append((bound, running))
        return tuple(result)


@dataclass
class _Sequence:
    parent_id: str
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens it did not compute (prefix-cache hits and loaded ones), as the core
    last reported them."""
    engine: int = 0
    """The engine of its latest output (a request runs on one replica)."""


@dataclass
class _Parent:
    """A user request: its ``n``, its sequences still running, and the most tokens one
    of its finished sequences generated."""

    n: int
    running: set[str]
    max_generation_tokens: int = 0


class EngineSeries:
    """One engine's counters and histograms (the series of one ``engine`` label value)."""

    def __init__(self, max_model_len: int) -> None:
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.histograms: dict[str, Histogram] = {
            "pagedlm:time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "pagedlm:inter_token_latency_seconds": Histogram(TPOT_BUCKETS),
            "pagedlm:request_time_per_output_token_seconds": Histogram(TPOT_BUCKETS),
            "pagedlm:e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_queue_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_prefill_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_decode_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_inference_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_prompt_tokens": Histogram(token_buckets),
            "pagedlm:request_prefill_kv_computed_tokens": Histogram(token_buckets),
            "pagedlm:request_generation_tokens": Histogram(token_buckets),
            "pagedlm:request_params_max_tokens": Histogram(token_buckets),
            "pagedlm:request_max_num_generation_tokens": Histogram(token_buckets),
            "pagedlm:request_params_n": Histogram(N_BUCKETS),
            "pagedlm:iteration_tokens_total": Histogram(ITERATION_TOKEN_BUCKETS),
        }
        self.num_prompt_tokens = 0
        """Prompt tokens of the sequences whose prefill is done (``prompt_tokens_total``):
        counted at a sequence's first token (or pooled vector), as vLLM counts them, so a
        request aborted before then adds nothing and a preempted one's recomputation
        nothing more."""
        self.num_cached_prompt_tokens = 0
        """Of those, the ones not computed: prefix-cache hits and tokens a KV connector
        loaded (vLLM's ``prompt_tokens_cached``)."""
        self.num_recomputed_prompt_tokens = 0
        """Prompts whose every token but the last was cached: that last one is computed
        again for its logits (vLLM's ``prompt_tokens_recomputed``, one per such prompt)."""
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
        """vLLM's ``prompt_tokens_by_source``, its way: "local_compute" the prompt tokens
        computed (a recomputed last token included), "external_kv_transfer" those a KV
        connector loaded, "local_cache_hit" the other cached ones plus a recomputed last
        token (so the three exceed ``num_prompt_tokens`` by the recomputed ones)."""
        self.num_generation_tokens = 0
        """Tokens generated for the sequences still tracked (``generation_tokens_total``;
        like vLLM, not those a step produced for a request its client had aborted)."""
        self.request_success: Counter[str] = Counter()
        """Finished sequences by finish reason. "abort" here is the engine core's own (a
        pause, a grammar that failed to compile): vLLM counts those like any finish; a
        client's abort was forgotten before its sequences could report anything."""

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)


class SequenceStats:
    """The request-level series, fed with every step's ``EngineCoreOutput`` list."""

    def __init__(
        self,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        num_engines: int = 1,
    ) -> None:
        self.clock = clock
        self.max_model_len = max_model_len
        self.engines = [EngineSeries(max_model_len) for _ in range(max(num_engines, 1))]
        """Indexed by engine (``EngineCoreOutput.engine_index``)."""
        self._sequences: dict[str, _Sequence] = {}
        self._parents: dict[str, _Parent] = {}

    def _engine(self, index: int) -> EngineSeries:
        engines = self.engines
        while index >= len(engines):  # more replicas than configured: series for them too
            engines.append(EngineSeries(self.max_model_len))
        return engines[index]

    def add_request(
        self,
        parent_id: str,
        child_ids: Sequence[str],
        arrival_time: float,
        num_prompt_tokens: int,
        max_tokens: int | None,
    ) -> None:
        for child_id in child_ids:
            self._sequences[child_id] = _Sequence(
                parent_id, arrival_time, num_prompt_tokens, max_tokens
            )
        self._parents[parent_id] = _Parent(len(child_ids), set(child_ids))

    def forget_request(self, parent_id: str) -> None:
        """An aborted or rejected request: nothing more is observed for it."""
        entry = self._parents.pop(parent_id, None)
        for child_id in entry.running if entry is not None else ():
            self._sequences.pop(child_id, None)

    def record_outputs(
        self, outputs: Iterable[EngineCoreOutput], timestamp: float | None = None
    ) -> None:
        """Fold one engine-core step in; ``timestamp``: the core's clock when the step
        ended (``CoreOutputs.timestamp``; None: now, for an engine core in this process)."""
        now = self.clock()
        token_time = now if timestamp is None else timestamp
        sequences = self._sequences
        engines = self.engines
        # Per engine: [tokens of the step, the step's inter-token latencies].
        steps: dict[int, list] = {}
        for output in outputs:
            sequence = sequences.get(output.req_id)
            if sequence is None:
                continue
            index = output.engine_index
            series = engines[index] if index < len(engines) else self._engine(index)
            sequence.engine = index
            if sequence.scheduled_time is None and output.queued_seconds is not None:
                sequence.scheduled_time = sequence.arrival_time + output.queued_seconds
            num_new = len(output.new_token_ids)
            if num_new:
                step = steps.get(index)
                if step is None:
                    step = steps[index] = [0, []]
                step[0] += num_new
                series.num_generation_tokens += num_new
                if sequence.first_token_time is not None:
                    # One observation per step, however many tokens it brought.
                    step[1].append(token_time - sequence.last_token_time)
                else:
                    sequence.first_token_time = token_time
                    series.observe(
                        "pagedlm:time_to_first_token_seconds", now - sequence.arrival_time
                    )
                    step[0] += sequence.num_prompt_tokens  # vLLM counts the prefill here
                    self._prefilled(series, sequence, output)
                sequence.last_token_time = token_time
                sequence.num_generation_tokens += num_new
            elif output.pooled is not None:  # a pooling request's only output
                self._prefilled(series, sequence, output)
            if output.finish_reason is not None:
                sequence.num_cached_tokens = output.num_cached_tokens
                self._record_finished(output.req_id, now, output.finish_reason)
        for index, (num_tokens, gaps) in steps.items():
            histograms = engines[index].histograms
            if gaps:
                histograms["pagedlm:inter_token_latency_seconds"].observe_many(gaps)
            histograms["pagedlm:iteration_tokens_total"].observe(num_tokens)

    @staticmethod
    def _prefilled(series: EngineSeries, sequence: _Sequence, output: EngineCoreOutput) -> None:
        """A sequence's prompt is done: its tokens counted, how many were cached, and
        where they came from."""
        num_prompt_tokens = sequence.num_prompt_tokens
        num_cached_tokens = output.num_cached_tokens
        num_external = output.num_external_computed_tokens
        recomputed = int(num_cached_tokens + 1 == num_prompt_tokens)
        series.num_prompt_tokens += num_prompt_tokens
        series.num_cached_prompt_tokens += num_cached_tokens
        series.num_recomputed_prompt_tokens += recomputed
        by_source = series.prompt_tokens_by_source
        by_source["local_compute"] += num_prompt_tokens - num_cached_tokens
        by_source["local_cache_hit"] += num_cached_tokens + recomputed - num_external
        by_source["external_kv_transfer"] += num_external
        sequence.num_cached_tokens = num_cached_tokens

    def record_stopped(self, child_ids: Iterable[str]) -> None:
        """Sequences a stop string finished (the front end saw it after the tokens)."""
        now = self.clock()
        for child_id in child_ids:
            if child_id in self._sequences:
                self._record_finished(child_id, now, "stop")

    def _record_finished(self, child_id: str, now: float, finish_reason: str) -> None:
        sequence = self._sequences.get(child_id)
        if sequence is None:
            return
        series = self._engine(sequence.engine)
        series.request_success[finish_reason] += 1
        arrival = sequence.arrival_time
        scheduled = sequence.scheduled_time if sequence.scheduled_time is not None else arrival
        first = sequence.first_token_time if sequence.first_token_time is not None else now
        last = sequence.last_token_time if sequence.first_token_time is not None else now
        decode = last - first
        observe = series.observe
        observe("pagedlm:e2e_request_latency_seconds", now - arrival)
        observe("pagedlm:request_queue_time_seconds", max(scheduled - arrival, 0.0))
        observe("pagedlm:request_prefill_time_seconds", max(first - scheduled, 0.0))
        observe("pagedlm:request_decode_time_seconds", max(decode, 0.0))
        observe("pagedlm:request_inference_time_seconds", max(last - scheduled, 0.0))
        observe("pagedlm:request_prompt_tokens", sequence.num_prompt_tokens)
        observe(
            "pagedlm:request_prefill_kv_computed_tokens",
            sequence.num_prompt_tokens - sequence.num_cached_tokens,
        )
        observe("pagedlm:request_generation_tokens", sequence.num_generation_tokens)
        if sequence.max_tokens is not None:
            observe("pagedlm:request_params_max_tokens", sequence.max_tokens)
        num_later_tokens = sequence.num_generation_tokens - 1
        observe(
            "pagedlm:request_time_per_output_token_seconds",
            max(decode, 0.0) / num_later_tokens if num_later_tokens > 0 else 0.0,
        )
        self._drop(child_id, series)

    def _drop(self, child_id: str, series: EngineSeries) -> None:
        """Forget a finished sequence; its request's ``n`` and the most tokens one of its
        sequences generated are observed (on ``series``, the engine of the last one) when
        the last of its sequences finishes."""
        sequence = self._sequences.pop(child_id, None)
        if sequence is None:
            return
        parent = self._parents.get(sequence.parent_id)
        if parent is None:
            return
        parent.running.discard(child_id)
        parent.max_generation_tokens = max(
            parent.max_generation_tokens, sequence.num_generation_tokens
        )
        if not parent.running:
            del self._parents[sequence.parent_id]
            series.observe("pagedlm:request_params_n", parent.n)
            series.observe(
                "pagedlm:request_max_num_generation_tokens", parent.max_generation_tokens
            )
