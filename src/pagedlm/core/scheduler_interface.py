"""The Scheduler interface: decides, each step, which tokens of which requests run."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.speculation import SpecDecodingStats
from pagedlm.kv_cache.events import KVCacheEvent
from pagedlm.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics. Prefix-cache figures are token counts, cumulative."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    """Fraction of KV blocks held by requests, in [0, 1]."""
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decoding: SpecDecodingStats | None = None
    """Speculative decoding's counts (None when it is off)."""
    max_loras: int = 0
    """Device slots for LoRA adapters (0: LoRA is off)."""
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    """Adapter name -> running requests that use it (vLLM's ``lora_requests_info``)."""
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    external_prefix_cache_queries: int = 0
    """Tokens a KV connector was asked for: each admitted request's prompt tokens past
    its local prefix-cache hit, once, resumed preemptions left out (vLLM's)."""
    external_prefix_cache_hits: int = 0
    """Of those, tokens the connector had (to load)."""
    prefix_cache_requests: int = 0
    """Admitted requests whose prompt was looked up in the prefix cache (resumed
    preemptions left out, as from the queries): the unit of the log line's hit-rate
    window (``metrics/caching_window.py``)."""
    external_prefix_cache_requests: int = 0
    """Admitted requests whose prompt a KV connector was asked for."""
    prefix_cache_resets: int = 0
    """Times the prefix cache was emptied (``reset_prefix_cache``); the log line's
    window starts over, as vLLM's."""
    num_deferred_reqs: int = 0
    """Of the waiting requests, those a transient constraint holds back while requests
    behind them may start (a grammar compiling, a KV transfer, one LoRA adapter too many;
    ``core/waiting_reasons.py``): vLLM's "deferred" ``num_requests_waiting_by_reason``,
    the others its "capacity"."""
    engines: list[SchedulerStats] = field(default_factory=list)
    """Data parallelism: each replica's own stats, in engine-index order (the fields above
    are then their sums, the KV usage their mean); empty with one engine."""


class Scheduler(ABC):
    """Owns every unfinished request and the KV blocks they hold.

    Invariants:
    - ``schedule()`` never hands out more than ``max_num_batched_tokens`` tokens or more
      than ``max_num_seqs`` requests in one step.
    - A scheduled request holds blocks for every token it will have computed after the step.
    - ``update_from_output`` is called exactly once per non-empty ``schedule()`` result,
      with the runner's output for it, in the order they were scheduled. At most one
      step is in flight: step N is updated before step N+2 is scheduled (before N+1 is,
      under synchronous scheduling).
    - Once a request finishes or is aborted, all its blocks are released.
    """

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it can never fit in the KV cache."""

    @abstractmethod
    def abort_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """Finish the given requests (unknown ids are ignored) and free their blocks."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work under the token budget."""

    @abstractmethod
    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """The token masks for ``scheduler_output``'s sampling, asked for once every earlier
        step was updated (None when no sampling request is constrained)."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Record sampled tokens, apply token-level stops, free finished requests."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing changes) while requests hold
        blocks."""
        return False

    def reset_encoder_cache(self) -> None:  # noqa: B027 (optional; most keep none)
        """Forget every encoder output (image embeddings) the workers were known to hold:
        they built their model runner again (a weight update, a level-2 sleep), whose
        encoder cache starts empty, and the old outputs came from the old weights anyway
        (vLLM's ``reset_encoder_cache``)."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    def unfinished_request_ids(self) -> list[str]:
        """The ids of every waiting or running request (``pause_generation``'s abort)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its requests")

    def preempt_running(self) -> int:
        """Preempt every running request (blocks freed, KV recomputed when it runs again;
        the workers hear of it with the next ``schedule()``); only with no step in flight.
        Returns how many (``pause_generation(mode="keep")`` clearing the cache)."""
        raise NotImplementedError(f"{type(self).__name__} cannot preempt its requests")

    @abstractmethod
    def make_stats(self) -> SchedulerStats: ...

    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, oldest first (empty unless the
        scheduler was asked to record them)."""
        return []
