"""Per-sequence latency and size histograms, counted the way vLLM v1 counts them.

One user request with ``n`` samples is ``n`` engine-core sequences, and vLLM observes every
request-level histogram (time to first token, inter-token latency, end-to-end, queue,
prefill, decode, inference, prompt/generation tokens, ``max_tokens``) once per *sequence*,
the same unit as ``request_success_total``: an ``n=2`` request adds 2 to the success
counter and 2 observations to each latency histogram. Only ``request_params_n`` and
``request_max_num_generation_tokens`` (the most tokens any of its sequences generated) are
observed once per user request (when its last sequence finishes).

Times are ``time.monotonic()`` (the clock ``arrival_time`` uses), taken when the front end
handles a step's outputs. Phases, as in vLLM's ``FinishedRequestStats``:

- queue:     arrival -> first scheduled (``EngineCoreOutput.queued_seconds``)
- prefill:   first scheduled -> first token
- decode:    first token -> last token
- inference: first scheduled -> last token
- request time per output token: decode / (generated tokens - 1); 0 for one token.

``inter_token_latency_seconds`` observes every token after a sequence's first: the time
since its previous token (tokens that arrive together share the gap).
``time_per_output_token_seconds`` is vLLM's older name for the same observations (vLLM
observes the same values under both names while it keeps the old one).

Pure Python (no prometheus_client): ``LLM.get_metrics()`` reports the same histograms as
``/metrics``; ``prometheus.py`` only renders them.
"""

from __future__ import annotations

import bisect
import time
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
"""vLLM's ``inter_token_latency_seconds`` and ``time_per_output_token_seconds`` buckets."""
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets for e2e, queue, prefill, decode and inference time."""
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""vLLM v1's ``iteration_tokens_total`` buckets (V0's ended at a mistyped 8096)."""
N_BUCKETS = (1, 2, 5, 10, 20)


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


@dataclass
class _Parent:
    """A user request: its ``n``, its sequences still running, and the most tokens one
    of its finished sequences generated."""

    n: int
    running: set[str]
    max_generation_tokens: int = 0


class SequenceStats:
    """The request-level histograms, fed with every step's ``EngineCoreOutput`` list."""

    def __init__(self, max_model_len: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.histograms: dict[str, Histogram] = {
            "pagedlm:time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "pagedlm:inter_token_latency_seconds": Histogram(TPOT_BUCKETS),
            "pagedlm:time_per_output_token_seconds": Histogram(TPOT_BUCKETS),
            "pagedlm:request_time_per_output_token_seconds": Histogram(TPOT_BUCKETS),
            "pagedlm:e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_queue_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_prefill_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_decode_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_inference_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "pagedlm:request_prompt_tokens": Histogram(token_buckets),
            "pagedlm:request_generation_tokens": Histogram(token_buckets),
            "pagedlm:request_params_max_tokens": Histogram(token_buckets),
            "pagedlm:request_max_num_generation_tokens": Histogram(token_buckets),
            "pagedlm:request_params_n": Histogram(N_BUCKETS),
            "pagedlm:iteration_tokens_total": Histogram(ITERATION_TOKEN_BUCKETS),
        }
        self._sequences: dict[str, _Sequence] = {}
        self._parents: dict[str, _Parent] = {}
        self.num_prompt_tokens = 0
        """Prompt tokens of the sequences whose prefill is done (``prompt_tokens_total``):
        counted at a sequence's first token (or pooled vector), as vLLM counts them, so a
        request aborted before then adds nothing and a preempted one's recomputation
        nothing more."""

    def _observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

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

    def record_outputs(self, outputs: Iterable[EngineCoreOutput]) -> list[str]:
        """Fold one step in; returns the finish reasons of the sequences it finished."""
        now = self.clock()
        step_tokens = 0
        finished: list[str] = []
        gaps: list[float] = []  # the step's inter-token latencies, observed together
        sequences = self._sequences
        for output in outputs:
            sequence = sequences.get(output.req_id)
            if sequence is None:
                continue
            if sequence.scheduled_time is None and output.queued_seconds is not None:
                sequence.scheduled_time = sequence.arrival_time + output.queued_seconds
            num_new = len(output.new_token_ids)
            if num_new:
                step_tokens += num_new
                if sequence.first_token_time is not None:
                    # Tokens that arrive together (one step, or several merged) share the gap.
                    gap = (now - sequence.last_token_time) / num_new
                    if num_new == 1:
                        gaps.append(gap)
                    else:
                        gaps += [gap] * num_new
                else:
                    sequence.first_token_time = now
                    self._observe(
                        "pagedlm:time_to_first_token_seconds", now - sequence.arrival_time
                    )
                    gaps += [0.0] * (num_new - 1)
                    step_tokens += sequence.num_prompt_tokens  # vLLM counts the prefill here
                    self.num_prompt_tokens += sequence.num_prompt_tokens
                sequence.last_token_time = now
                sequence.num_generation_tokens += num_new
            elif output.pooled is not None:  # a pooling request's only output
                self.num_prompt_tokens += sequence.num_prompt_tokens
            if output.finish_reason is not None:
                # "abort" here is the core's own (a pause, a grammar that failed to
                # compile): vLLM counts and observes those like any finish. A client's
                # abort was forgotten before its sequences could report anything.
                finished.append(output.finish_reason)
                self._record_finished(output.req_id, now)
        if gaps:
            self.histograms["pagedlm:inter_token_latency_seconds"].observe_many(gaps)
            self.histograms["pagedlm:time_per_output_token_seconds"].observe_many(gaps)
        if step_tokens:
            self._observe("pagedlm:iteration_tokens_total", step_tokens)
        return finished

    def record_stopped(self, child_ids: Iterable[str]) -> None:
        """Sequences a stop string finished (the front end saw it after the tokens)."""
        now = self.clock()
        for child_id in child_ids:
            if child_id in self._sequences:
                self._record_finished(child_id, now)

    def _record_finished(self, child_id: str, now: float) -> None:
        sequence = self._sequences.get(child_id)
        if sequence is None:
            return
        arrival = sequence.arrival_time
        scheduled = sequence.scheduled_time if sequence.scheduled_time is not None else arrival
        first = sequence.first_token_time if sequence.first_token_time is not None else now
        last = sequence.last_token_time if sequence.first_token_time is not None else now
        decode = last - first
        observe = self._observe
        observe("pagedlm:e2e_request_latency_seconds", now - arrival)
        observe("pagedlm:request_queue_time_seconds", max(scheduled - arrival, 0.0))
        observe("pagedlm:request_prefill_time_seconds", max(first - scheduled, 0.0))
        observe("pagedlm:request_decode_time_seconds", max(decode, 0.0))
        observe("pagedlm:request_inference_time_seconds", max(last - scheduled, 0.0))
        observe("pagedlm:request_prompt_tokens", sequence.num_prompt_tokens)
        observe("pagedlm:request_generation_tokens", sequence.num_generation_tokens)
        if sequence.max_tokens is not None:
            observe("pagedlm:request_params_max_tokens", sequence.max_tokens)
        num_later_tokens = sequence.num_generation_tokens - 1
        observe(
            "pagedlm:request_time_per_output_token_seconds",
            max(decode, 0.0) / num_later_tokens if num_later_tokens > 0 else 0.0,
        )
        self._drop(child_id)

    def _drop(self, child_id: str) -> None:
        """Forget a finished sequence; its request's ``n`` and the most tokens one of its
        sequences generated are observed when the last of its sequences finishes."""
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
            self._observe("pagedlm:request_params_n", parent.n)
            self._observe("pagedlm:request_max_num_generation_tokens", parent.max_generation_tokens)
