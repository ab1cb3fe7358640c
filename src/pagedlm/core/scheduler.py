"""The one-budget scheduler.

Scheduling model
----------------
There are no prefill and decode phases. Every request has ``num_tokens`` (prompt plus
outputs so far) and ``num_computed_tokens`` (tokens whose K/V are in the cache); a step
feeds each scheduled request some of its ``num_tokens - num_computed_tokens`` missing
tokens. One step hands out one token budget, ``max_num_batched_tokens``:

1. Running requests first, in admission order. Each gets
   ``min(num_tokens - num_computed_tokens, remaining budget)`` tokens: normally 1 in
   decode, the rest of its prompt if it is still being prefilled, more than 1 once
   speculative decoding proposes drafts.
2. Then waiting requests, first come first served, while fewer than ``max_num_seqs``
   run: each first takes its longest cached prefix (prefix caching), then gets
   ``min(uncached tokens, remaining budget)`` tokens. A prompt longer than the budget is
   therefore chunked over several steps with no special case.

KV memory is ``num_blocks`` blocks of ``block_size`` slots. Allocation is
check-then-commit. If a running request cannot get its blocks, the *last* running
request is preempted: its blocks are freed, ``num_computed_tokens`` drops to 0 and it
goes to the front of the waiting queue, to be recomputed (usually largely from the
prefix cache) when memory allows. If the victim is the request itself, the running pass
stops. Waiting requests never cause preemption; they are admitted only while free blocks
last, and not at all in a step that preempted (memory is short then). FCFS is strict:
when the head of the queue does not fit, nothing behind it is admitted either.

Structured outputs (optional component, ``StructuredOutputManager``, driven through
``grammar_gate.GrammarGate``): a constrained request waits with status
``WAITING_FOR_GRAMMAR`` while its grammar compiles on a thread; it is skipped, and requests
behind it are admitted. The allowed-token bitmask of the constrained requests that sample
goes with each step's sampling (see below); ``update_from_output`` advances their
matchers by the appended tokens and finishes a request whose grammar has terminated.
Matchers are not touched by preemption.

LoRA (optional component, ``LoRAGate``): the running requests use at most ``max_loras``
distinct adapters, so every step's adapters fit the workers' device slots; a waiting
request whose adapter would be one too many is skipped like a compiling one.

Asynchronous scheduling (one step in flight): ``schedule()`` may run while the previous
step still computes, before its sampled tokens reach the host. Each request counts the
tokens sampled by launched but uncollected steps in ``num_output_placeholders``: the
next step feeds them (the workers hold their values on the device), so a decoding
request is scheduled one token as usual. A request whose in-flight token is its last by
length (``max_tokens``, ``max_model_len``) is not scheduled again. ``update_from_output``
resolves the placeholders into real tokens and applies stops; a request that stops on a
token of the step in flight has the next step's token dropped (it is no longer known), as
has a request aborted with its step in flight, even once its id names a new request.
Blocks freed then are handed out only by later schedules, whose steps run on the device
after every launched step that may still write them. Synchronous scheduling is the same
code with every step collected before the next is scheduled (no placeholder survives).

Pipeline parallelism (``disjoint_steps``, vLLM's batch queue): the engine keeps up to one
step per stage in flight, and steps in flight share no request. A request whose step was
launched but not collected is skipped by both passes (a preempted one stays in ``waiting``
until then), so it is never scheduled with a placeholder, and its blocks, if it is
preempted or aborted meanwhile, are rewritten only by later steps, which every stage runs
after the earlier ones. Stages before the last never see sampled ids: each scheduled
cached request carries its output tokens among the fed ones (``new_token_ids``).

Structured outputs in that order: the bitmask of step N+1 needs step N's tokens in the
matchers, so it is asked for after ``update_from_output`` of step N
(``get_grammar_bitmask``) and travels with the step's sampling, not its schedule.

Multimodal prompts (``encoder_budget.py``): a chunk that reaches an image's placeholder
tokens has the image encoded in the same step, under the per-step encoder budget, unless
the workers' encoder cache holds it; a chunk reaching an image the budget cannot pay for
this step stops just before it.

KV transfer (optional component, ``ExternalKV``, around a KV connector): a waiting request
whose prompt continues, after its local prefix-cache hit, with blocks another engine stored
first has them loaded in a step of its own (it waits as ``WAITING_FOR_REMOTE_KVS``, holding
blocks for its whole prompt); the collected load counts its good blocks as computed, like
prefix-cache hits, and the request is admitted in a later step (``core/external_kv.py``).
Loaded requests waiting for admission give their blocks back before a running request is
preempted, and when the head of the queue cannot be admitted, so they never stall it.
Every step's ``SchedulerOutput`` carries the connector's loads and saves.

Priority policy (``scheduling_policy="priority"``, vLLM's): ``waiting`` and ``running``
are kept in ``(priority, arrival_time)`` order instead of arrival/admission order
(``queue_order.py``), so the same passes serve lower priority values first and
preemption from the back of ``running`` takes the least urgent request.

A request that could never fit (``prompt + max_tokens`` tokens need more than
``num_blocks`` blocks) is rejected in ``add_request`` instead of waiting forever.

Pooling (the pooling runner): with ``whole_prompts`` (poolers that need the whole prompt
in one step: mean or CLS pooling, bidirectional encoders) a waiting prompt is admitted only
when all of it fits the step's remaining budget, so it is never chunked; otherwise (last
token or token-wise pooling) it is chunked as any prompt. The step that feeds its last
token returns its vector (or a token-wise task's rows) in
``ModelRunnerOutput.pooler_output`` instead of a token, and ``update_from_output`` finishes
it (finish reason "stop") with that.

Progress bookkeeping: ``schedule()`` advances ``num_computed_tokens`` of every scheduled
request by its scheduled count as soon as the request's step data is recorded (which
carries the value *before* the step). ``update_from_output`` then only appends
sampled tokens and applies stops. A request whose prompt is still partially prefilled
has ``num_computed_tokens < num_tokens`` and samples nothing.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedlm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedlm.core.encoder_budget import EncoderCacheTracker, EncoderPlan
from pagedlm.core.external_kv import ExternalKV
from pagedlm.core.grammar_gate import GrammarGate
from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.queue_order import QueueOrder
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.scheduler_interface import Scheduler, SchedulerStats
from pagedlm.core.speculation import Speculation, StepDrafts
from pagedlm.core.stop_checker import append_token_ids, check_stop
from pagedlm.core.waiting_reasons import count_deferred
from pagedlm.kv_cache.events import EventLog, KVCacheEvent
from pagedlm.kv_cache.manager import ComputedBlocks, KVCacheManager
from pagedlm.lora.scheduler_gate import LoRAGate
from pagedlm.step import (
    CachedRequestData,
    GrammarBitmask,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from pagedlm.kv_transfer.base import KVConnectorBase
    from pagedlm.structured_output.manager import StructuredOutputManager


class OneBudgetScheduler(Scheduler):
    """Running-first, then FCFS-waiting, under one token budget per step (see module doc)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        record_kv_cache_events: bool = False,
        max_loras: int | None = None,
        disjoint_steps: bool = False,
        consecutive_blocks: bool = False,
        kv_connector: KVConnectorBase | None = None,
    ) -> None:
        """``max_loras``: distinct adapters that may run at once (None: LoRA is off).
        ``disjoint_steps``: the pipeline-parallel batch queue (see the module doc).
        ``consecutive_blocks``: the platform's ``prefers_consecutive_blocks``.
        ``kv_connector``: a KV connector's scheduler side (``core/external_kv.py``)."""
        self.config = scheduler_config
        self._prefill_cap = scheduler_config.long_prefill_token_threshold or sys.maxsize
        """The most tokens one request computes per step (decodes feed one anyway)."""
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.kv_manager = KVCacheManager(
            cache_config.block_size,
            num_blocks,
            cache_config.enable_prefix_caching,
            consecutive_blocks=consecutive_blocks,
            hits_end_a_block_early=speculative_config is not None
            and speculative_config.proposer_kv_reads_next_token,
        )
        if record_kv_cache_events:
            self.kv_manager.pool.event_log = EventLog()
        self.external = None if kv_connector is None else ExternalKV(kv_connector, self.kv_manager)
        """Loads of prompts' KV through a KV connector (None: no connector)."""
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.grammars = GrammarGate(structured_output)
        self.loras = LoRAGate(max_loras)
        self._finished_req_ids: set[str] = set()
        """Requests that ended since the last ``schedule()``; reported to the workers."""
        self._preempted_req_ids: set[str] = set()
        """Requests ``preempt_running`` preempted since the last ``schedule()``; likewise."""
        self.order = QueueOrder(scheduler_config.scheduling_policy)
        self.num_model_steps = 0
        """Non-empty steps scheduled so far."""
        self.speculation = Speculation(
            speculative_config, scheduler_config.max_model_len, scheduler_config.async_scheduling
        )
        self.disjoint_steps = disjoint_steps
        self._in_flight_req_ids: set[str] = set()
        """``disjoint_steps``: requests of the launched steps not collected yet."""
        self._last_step: dict[str, int] = {}
        """The last step's ``num_scheduled_tokens`` until it is collected: outside
        ``disjoint_steps`` at most one step is in flight, and this is it."""
        self._ended_in_flight: dict[str, Request] = {}
        """Requests that ended while a launched step held them, by id: that step's entries
        for their ids are dropped when it is collected, whatever request has the id by then
        (one aborted and added again before its step was collected); a failure it reports
        for one still takes that request's blocks out of the prefix cache."""
        budget = scheduler_config.max_num_encoder_input_tokens
        self.encoder = EncoderCacheTracker(
            budget or scheduler_config.max_num_batched_tokens,
            scheduler_config.encoder_cache_size
            or budget
            or scheduler_config.max_num_batched_tokens,
        )

    # ----------------------------------------------------------------- requests in / out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(
                f"request id {request.request_id!r} is already in use; give every "
                "request a unique id."
            )
        num_tokens = request.num_prompt_tokens + request.max_tokens
        num_blocks_needed = -(-num_tokens // self.block_size)
        if num_blocks_needed > self.num_blocks:
            capacity = self.num_blocks * self.block_size
            raise ValueError(
                f"request {request.request_id!r} can never fit in the KV cache: "
                f"{request.num_prompt_tokens} prompt tokens + max_tokens={request.max_tokens} "
                f"need {num_blocks_needed} blocks of {self.block_size} tokens, but the cache "
                f"has {self.num_blocks} blocks ({capacity} tokens). Lower max_tokens or "
                f"shorten the prompt, or raise num_kv_blocks (or the KV-cache memory)."
            )
        limit = self.config.max_num_batched_tokens
        for feature in request.mm_features:
            if feature.bidirectional and feature.length > limit:
                raise ValueError(
                    f"an image of request {request.request_id!r} takes {feature.length} "
                    f"tokens, which must be fed in one step, but max_num_batched_tokens="
                    f"{limit}; raise max_num_batched_tokens to at least {feature.length}."
                )
        request.status = RequestStatus.WAITING
        if request.sampling_params.structured_outputs is not None:
            self.grammars.add(request)
        self.requests[request.request_id] = request
        self.order.wait(self.waiting, request)

    def abort_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        if not status.is_finished:
            raise ValueError(f"abort status must be a finished status, got {status.name}.")
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._remove_from_queues(request)
            request.status = status
            self._finish(request)
            aborted.append(request)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def preempt_running(self) -> int:
        num = len(self.running)
        while self.running:  # from the back, so they wait in their running order
            request = self.running.pop()
            self._preempt(request)
            self._preempted_req_ids.add(request.request_id)
        if self.external is not None:
            self.external.release_loaded()  # waiting requests holding loaded blocks
        return num

    def reset_prefix_cache(self) -> bool:
        reset = self.kv_manager.reset_prefix_cache()
        if reset and self.external is not None:
            self.external.connector.reset_cache()  # a host pool's copies go too
        return reset

    def reset_encoder_cache(self) -> None:
        self.encoder.reset()

    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        log = self.kv_manager.pool.event_log
        return [] if log is None else log.take()

    def make_stats(self) -> SchedulerStats:
        external = self.external
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_deferred_reqs=count_deferred(
                self.waiting,
                self.running,
                self.loras,
                self._in_flight_req_ids,
                len(self.grammars.compiling) + (len(external.loading) if external else 0),
            ),
            kv_cache_usage=self.kv_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            spec_decoding=self.speculation.stats(),
            max_loras=self.loras.max_loras or 0,
            running_lora_adapters=self.loras.count_names(self.running),
            waiting_lora_adapters=self.loras.count_names(self.waiting),
            external_prefix_cache_queries=external.prefix_cache_queries if external else 0,
            external_prefix_cache_hits=external.prefix_cache_hits if external else 0,
            prefix_cache_requests=self.kv_manager.prefix_cache_requests,
            external_prefix_cache_requests=external.prefix_cache_requests if external else 0,
            prefix_cache_resets=self.kv_manager.prefix_cache_resets,
        )

    # ------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached_reqs = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted: list[Request] = []
        constrained: list[str] = []
        spec = StepDrafts()
        if not self.running:
            self.grammars.wait_while_idle(self.waiting)
        self.speculation.begin_step(len(self.running))
        freed_encoder_entries = self.encoder.begin_step()

        # The running pass is the per-request hot loop of every step: locals, no helpers
        # on the common path (a decode whose blocks already hold its next slot).
        running, allocate_slots = self.running, self.kv_manager.allocate_slots
        cached_ids, cached_blocks, cached_computed = (
            cached_reqs.req_ids,
            cached_reqs.new_block_ids,
            cached_reqs.num_computed_tokens,
        )
        speculating = self.speculation.enabled
        in_flight = self._in_flight_req_ids  # empty unless disjoint_steps
        new_token_ids = cached_reqs.new_token_ids if self.disjoint_steps else None
        max_model_len = self.config.max_model_len
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            index += 1
            if in_flight and request.request_id in in_flight:
                continue
            placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + placeholders
            if placeholders and (
                num_tokens - request.num_prompt_tokens >= request.max_tokens
                or num_tokens >= max_model_len
            ):
                # The token in flight is its last by length: scheduling it again would only
                # compute a token to drop.
                continue
            computed = request.num_computed_tokens
            num_new_tokens = min(num_tokens - computed, budget, self._prefill_cap)
            plan = None
            if request.mm_features:
                plan = self.encoder.plan(request, computed, num_new_tokens)
                num_new_tokens = plan.num_new_tokens
            if num_new_tokens <= 0:
                continue
            if speculating:
                new_block_ids = self._allocate_with_drafts(request, num_new_tokens, budget, spec)
            else:
                new_block_ids = allocate_slots(request, num_new_tokens)
            if new_block_ids is None:
                new_block_ids = self._allocate_or_preempt(request, num_new_tokens, preempted)
                if new_block_ids is None:
                    spec.discard(request)
                    break  # the request preempted itself; everything after it is gone too
            if plan is not None:
                self.encoder.commit(request, computed, plan)
            request_id = request.request_id
            cached_ids.append(request_id)
            cached_blocks.append(new_block_ids)
            cached_computed.append(computed)
            if new_token_ids is not None:
                first_output = max(computed, request.num_prompt_tokens)
                new_token_ids.append(
                    request.all_token_ids[first_output : computed + num_new_tokens]
                )
            num_drafts = request.num_scheduled_drafts  # 0 unless speculating
            num_scheduled[request_id] = num_new_tokens + num_drafts
            budget -= num_new_tokens + num_drafts
            request.num_computed_tokens = computed + num_new_tokens + num_drafts
            if computed + num_new_tokens >= num_tokens:
                # This step samples its next token, and as many more as drafts it accepts:
                # placeholders until update_from_output.
                request.num_output_placeholders = placeholders + 1 + num_drafts
                if request.sampling_params.structured_outputs is not None:
                    constrained.append(request_id)

        skipped: list[Request] = []  # grammars compiling, one adapter too many, in flight
        active_loras = self.loras.active(self.running) if self.waiting else set()
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if (
                not self.grammars.ready(request)
                or not self.loras.admits(request, active_loras)
                or (in_flight and request.request_id in in_flight)
                or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            ):
                skipped.append(self.waiting.popleft())
                continue
            computed = None
            if self.external is not None and not self.external.is_loaded(request):
                computed = self.kv_manager.get_computed_blocks(request)
                loading = self._start_external_load(request, computed)
                if loading is None:
                    if self.external.release_loaded(keep=request):
                        continue  # the head again, with the blocks and seats they held
                    break
                if loading:
                    skipped.append(self.waiting.popleft())
                    continue
            num_new_tokens = self._admit(request, budget, spec, computed)
            if num_new_tokens is None:
                if self.external is not None and self.external.release_loaded(keep=request):
                    continue  # loaded requests behind it must not hold the queue up
                break
            self.waiting.popleft()
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_manager.get_block_ids(request),
                    num_computed_tokens=request.num_computed_tokens,
                    lora_request=request.lora_request,
                    mm_features=request.mm_features,
                    pooling=request.pooling,
                    prompt_embeds=request.prompt_embeds,
                )
            )
            num_scheduled[request.request_id] = num_new_tokens
            budget -= num_new_tokens
            self._advance(request, num_new_tokens, constrained)
        self.waiting.extendleft(reversed(skipped))
        if spec.to_propose and self.speculation.too_many_to_propose(len(self.running)):
            spec.withdraw_proposals(self.running)  # the admitted requests made it too many

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids={request.request_id for request in preempted}
            | self._preempted_req_ids,
            structured_output_req_ids=constrained,
            num_drafts_to_propose=spec.to_propose,
            num_drafts_in_flight=spec.in_flight,
            scheduled_spec_decode_tokens=spec.drafts,
            scheduled_encoder_inputs=self.encoder.take_scheduled(),
            free_encoder_mm_hashes=freed_encoder_entries,
        )
        if self.external is not None:
            output = self.external.attach_metadata(output)
        self._finished_req_ids = set()
        self._preempted_req_ids = set()
        self._last_step = num_scheduled
        if num_scheduled:
            self.num_model_steps += 1
            if self.disjoint_steps:
                in_flight.update(num_scheduled)
        return output

    @staticmethod
    def _advance(request: Request, num_new_tokens: int, constrained: list[str]) -> None:
        """Count an admitted request's tokens as computed (its step data already carries
        where they start); if the step samples its next token, that token is a
        placeholder until ``update_from_output``. (The running pass inlines this.)"""
        request.num_computed_tokens += num_new_tokens
        if (
            request.num_computed_tokens
            >= len(request.all_token_ids) + request.num_output_placeholders
        ):
            request.num_output_placeholders += 1
            if request.sampling_params.structured_outputs is not None:
                constrained.append(request.request_id)

    def _allocate_with_drafts(
        self, request: Request, num_new_tokens: int, budget: int, spec: StepDrafts
    ) -> list[int] | None:
        """Slots for a running request's tokens, plus the drafts it verifies and the slots
        its proposer writes ahead when they fit too (drafts never cost a preemption);
        records the drafts in ``spec``. None: even the tokens alone do not fit."""
        drafts: list[int] = []
        num_proposals = 0
        if num_new_tokens == 1:  # decoding: only its last sampled token is left to feed
            drafts = self.speculation.drafts_to_verify(request, budget - 1)
            num_proposals = self.speculation.drafts_to_propose(request, len(drafts))
        elif request.num_computed_tokens + num_new_tokens >= request.num_tokens + (
            request.num_output_placeholders
        ):  # the last chunk of a prefill: it samples, so its next step may verify drafts
            num_proposals = self.speculation.drafts_to_propose(request, 0)
        extra = len(drafts) + self.speculation.lookahead(num_proposals)
        new_block_ids = self.kv_manager.allocate_slots(request, num_new_tokens + extra)
        if new_block_ids is None and extra:
            drafts, num_proposals = [], 0
            new_block_ids = self.kv_manager.allocate_slots(request, num_new_tokens)
        spec.record(request, drafts, num_proposals)
        return new_block_ids

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """Token masks for the step's constrained requests that sample, from their matchers
        as they are now: ask after ``update_from_output`` of the step before. A request
        that verifies drafts gets a mask per position (its drafts resolved by now)."""
        request_ids = [
            request_id
            for request_id in scheduler_output.structured_output_req_ids
            if request_id in self.requests
        ]
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        drafts = {}
        for request_id in request_ids:
            if request_id in scheduled:
                request = self.requests[request_id]
                known = Speculation.known_drafts(request, scheduled[request_id])
                drafts[request_id] = known + [-1] * (len(scheduled[request_id]) - len(known))
        return self.grammars.bitmask(request_ids, drafts)

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, preempted: list[Request]
    ) -> list[int] | None:
        """Blocks for a running request, preempting from the back until they fit.

        Returns the new block ids, or None if ``request`` itself had to be preempted.
        Victims come from after ``request`` in ``running``: earlier requests are
        already scheduled this step and keep their blocks.
        """
        while True:
            new_block_ids = self.kv_manager.allocate_slots(request, num_new_tokens)
            if new_block_ids is not None:
                return new_block_ids
            if self.external is not None and self.external.release_loaded():
                continue  # waiting requests' loaded blocks go before any running request
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        self.encoder.release(request)
        self.speculation.on_preempted(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.order.wait(self.waiting, request, preempted=True)

    def _start_external_load(self, request: Request, computed: ComputedBlocks) -> bool | None:
        """Have the KV connector load what it holds of ``request``'s prompt after its local
        hit (``core/external_kv.py``): True if a load was planned (the request waits for
        it), False if there is nothing to load, None if it must wait: no seat (running and
        block-holding waiting requests fill ``max_num_seqs``) or no blocks."""
        assert self.external is not None
        if len(self.running) + self.external.num_holding >= self.config.max_num_seqs:
            num_external = self.external.connector.get_num_new_matched_tokens(
                request, computed.num_computed_tokens
            )
            return None if num_external > 0 else False
        return self.external.start_load(request, computed)

    def _admit(
        self,
        request: Request,
        budget: int,
        spec: StepDrafts,
        computed: ComputedBlocks | None = None,
    ) -> int | None:
        """Try to move the head of the waiting queue to running. A request whose whole
        prompt is scheduled samples this step, and when speculating asks its proposer for
        drafts right away (recorded in ``spec``), so its first decode step verifies them.
        ``computed``: its prefix-cache hit, if already looked up. A request whose KV a
        connector loaded already holds its blocks, and starts at its ``num_computed_tokens``.

        Returns the number of tokens scheduled for it, or None (nothing changed) if its
        blocks do not fit.
        """
        assert request.num_output_placeholders == 0, "admitted only once its tokens are known"
        if self.external is not None and self.external.is_loaded(request):
            computed, start = None, request.num_computed_tokens
        else:
            if computed is None:
                computed = self.kv_manager.get_computed_blocks(request)
            start = computed.num_computed_tokens
        num_new_tokens = min(request.num_tokens - start, budget, self._prefill_cap)
        if self.config.whole_prompts and start + num_new_tokens < request.num_tokens:
            return None  # not chunked: it waits for a step with room for all of it
        plan: EncoderPlan | None = None
        if request.mm_features:
            plan = self.encoder.plan(request, start, num_new_tokens)
            num_new_tokens = plan.num_new_tokens
            if num_new_tokens <= 0:
                return None  # the step's encoder budget is spent; next step
        num_proposals = 0
        if self.speculation.enabled and start + num_new_tokens >= request.num_tokens:
            num_proposals = self.speculation.drafts_to_propose(request, 0)
        extra = self.speculation.lookahead(num_proposals)
        if self.kv_manager.allocate_slots(request, num_new_tokens + extra, computed) is None:
            if (
                not extra
                or self.kv_manager.allocate_slots(request, num_new_tokens, computed) is None
            ):
                return None
            num_proposals = 0  # drafts never keep a request waiting
        if self.speculation.enabled:
            spec.record(request, [], num_proposals)  # also clears a resumed one's draft counts
        if plan is not None:
            self.encoder.commit(request, start, plan)
        request.num_computed_tokens = start
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = start
            request.num_external_cached_tokens = request.num_external_computed_tokens
            request.queued_seconds = time.monotonic() - request.arrival_time
        request.status = RequestStatus.RUNNING
        self.order.run(self.running, request)
        if self.external is not None:
            self.external.admitted(request, computed)
        return num_new_tokens

    # --------------------------------------------------------------- update from output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        max_model_len = self.config.max_model_len
        scheduled = scheduler_output.num_scheduled_tokens
        speculating = self.speculation.enabled
        all_logprobs = runner_output.logprobs
        all_prompt_logprobs = runner_output.prompt_logprobs
        if self._in_flight_req_ids:
            self._in_flight_req_ids.difference_update(scheduled)
        if scheduled is self._last_step:
            self._last_step = {}
        stale = None
        if self._ended_in_flight:
            ended = self._ended_in_flight
            stale = {req_id: ended.pop(req_id) for req_id in scheduled if req_id in ended}
        if self.external is not None:
            self.external.finish_loads(runner_output.kv_connector_output)
        pooled_outputs = runner_output.pooler_output
        failed = runner_output.failed
        requests = self.requests
        # The common output, taken without the general path's lookups: one token sampled
        # for an unconstrained request, no logprobs, nothing pooled, not finished by it
        # (a request left in ``requests`` is never finished before its token is appended).
        plain = not (speculating or all_logprobs or all_prompt_logprobs or pooled_outputs)
        for req_id, sampled in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            if stale and req_id in stale:
                if failed and req_id in failed:
                    # Ended (aborted) before the step that failed it was collected: its
                    # blocks, freed still hashed, may hold K/V its hashes do not promise.
                    self.kv_manager.uncache(stale[req_id])
                continue  # its request ended after this step was scheduled
            request = requests.get(req_id)
            if request is None or req_id not in scheduled:
                continue  # finished or aborted after this step was scheduled
            if failed and req_id in failed:
                outputs.append(self._fail(request, failed[req_id]))
                continue
            if plain and len(sampled) == 1 and request.sampling_params.structured_outputs is None:
                request.num_output_placeholders -= 1
                request.all_token_ids.append(sampled[0])
                if not check_stop(request, max_model_len):
                    outputs.append(
                        EngineCoreOutput(
                            req_id,
                            sampled,
                            None,
                            None,
                            None,
                            None,
                            max(request.num_cached_tokens, 0),
                            request.queued_seconds,
                            None,
                            0,
                            request.num_external_cached_tokens,
                        )
                    )
                    continue
                new_token_ids = sampled
            else:
                new_token_ids = self._new_token_ids(
                    request, sampled, scheduler_output, runner_output
                )
            pooled = pooled_outputs.get(req_id) if pooled_outputs else None
            prompt_logprobs = None
            if all_prompt_logprobs and req_id in all_prompt_logprobs:
                prompt_logprobs = _unreported_prompt_logprobs(
                    request, scheduler_output, all_prompt_logprobs[req_id]
                )
            finished = request.status >= RequestStatus.FINISHED_STOPPED
            if not new_token_ids and not finished and prompt_logprobs is None:
                continue
            logprobs = all_logprobs.get(req_id) if all_logprobs else None
            if logprobs is not None and len(new_token_ids) < len(logprobs.token_ids):
                logprobs = _truncate(logprobs, len(new_token_ids))
            if finished:
                self._remove_from_queues(request)
                self._finish(request)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    request.status.finish_reason,
                    request.stop_reason,
                    logprobs,
                    prompt_logprobs,
                    max(request.num_cached_tokens, 0),
                    request.queued_seconds,
                    pooled,
                    0,
                    request.num_external_cached_tokens,
                )
            )
        return outputs

    def _new_token_ids(
        self,
        request: Request,
        sampled: list[int],
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
    ) -> list[int]:
        """Fold one request's sampled tokens (drafts accepted, a grammar advanced, a pooled
        vector) into it; returns the tokens appended."""
        req_id = request.request_id
        max_model_len = self.config.max_model_len
        pooled_outputs = runner_output.pooler_output
        if pooled_outputs and pooled_outputs.get(req_id) is not None:
            # A pooling request ends with its prompt: the vector is its whole output.
            request.num_output_placeholders -= 1
            request.status = RequestStatus.FINISHED_STOPPED
        if not sampled:
            return []
        if self.speculation.enabled:
            num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            request.num_output_placeholders -= 1 + num_drafts
            request.num_computed_tokens -= self.speculation.on_sampled(
                request,
                num_drafts,
                len(sampled),
                runner_output.draft_token_ids.get(req_id),
                req_id in scheduler_output.num_drafts_to_propose,
            )
        else:
            request.num_output_placeholders -= 1
        if request.sampling_params.structured_outputs is None:
            return append_token_ids(request, sampled, max_model_len)
        return self._append_constrained(request, sampled, max_model_len)

    def _append_constrained(
        self, request: Request, sampled: list[int], max_model_len: int
    ) -> list[int]:
        """Append a structured-output request's tokens and advance its grammar."""
        sampled = self.grammars.check_failed(request, sampled)
        new_token_ids = append_token_ids(request, sampled, max_model_len) if sampled else []
        if new_token_ids and not request.is_finished:
            # Tokens after one that ends the grammar (an accepted run of drafts) are dropped.
            del new_token_ids[self.grammars.advance(request, new_token_ids) :]
        return new_token_ids

    def _fail(self, request: Request, message: str) -> EngineCoreOutput:
        """End ``request`` with "error" and ``message``: a callable of its own failed in
        the step collected, or its LoRA adapter could not be read for it; its tokens of
        that step are dropped (the next step's too, if one is in flight, as for any request
        that ends then), and its blocks leave the prefix cache (a step that could not read
        its adapter ran it without, so their K/V are not what their hashes promise; after a
        callable's failure this only costs later hits)."""
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = message
        self._remove_from_queues(request)
        self.kv_manager.uncache(request)
        self._finish(request)
        return EngineCoreOutput(
            request.request_id,
            [],
            request.status.finish_reason,
            message,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            queued_seconds=request.queued_seconds,
            num_external_computed_tokens=request.num_external_cached_tokens,
        )

    def _remove_from_queues(self, request: Request) -> None:
        """Take ``request`` out of ``running``, or of ``waiting`` where a schedule made while
        its last step was in flight preempted it."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def _finish(self, request: Request) -> None:
        """Release a request that has left ``running``/``waiting`` with a finished status."""
        request_id = request.request_id
        if request_id in self._last_step or request_id in self._in_flight_req_ids:
            self._ended_in_flight[request_id] = request
        self.grammars.remove(request)
        self.kv_manager.free(request)
        self.encoder.release(request)
        if self.external is not None:
            self.external.finished(request)
        del self.requests[request_id]
        self._finished_req_ids.add(request_id)


def _unreported_prompt_logprobs(
    request: Request, scheduler_output: SchedulerOutput, logprobs: LogprobsLists
) -> LogprobsLists | None:
    """The rows of a chunk's prompt logprobs not reported before: a request preempted
    after part of its prompt ran computes that part again (row ``i`` of a chunk starting at
    position ``start`` is the logprob of prompt token ``start + 1 + i``)."""
    batch_row = scheduler_output.req_ids.index(request.request_id)
    start = scheduler_output.num_computed_tokens[batch_row]
    skip = max(0, request.num_prompt_logprobs_reported - start)
    request.num_prompt_logprobs_reported = max(
        request.num_prompt_logprobs_reported, start + len(logprobs.token_ids)
    )
    if skip >= len(logprobs.token_ids):
        return None
    if skip == 0:
        return logprobs
    return LogprobsLists(
        token_ids=logprobs.token_ids[skip:],
        logprobs=logprobs.logprobs[skip:],
        ranks=logprobs.ranks[skip:],
    )


def _truncate(logprobs: LogprobsLists, num_rows: int) -> LogprobsLists:
    """Keep the rows of the tokens that were appended (the rest followed a stop)."""
    return LogprobsLists(
        token_ids=logprobs.token_ids[:num_rows],
        logprobs=logprobs.logprobs[:num_rows],
        ranks=logprobs.ranks[:num_rows],
    )
