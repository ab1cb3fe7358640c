"""What the scheduler does for speculative decoding, in one place.

A decoding request's drafts go round like this:

1. A step in which the request samples asks its workers' proposer for up to ``q`` drafts
   for the request's next step (``SchedulerOutput.num_drafts_to_propose``; the policy
   below picks ``q``). A proposer that keeps its own KV (draft model, EAGLE) writes it
   for the draft positions, so the request holds ``q`` slots ahead.
2. The drafts come back with that step's output (``ModelRunnerOutput.draft_token_ids``)
   into ``request.spec_token_ids``; the next step verifies them: the request is scheduled
   ``1 + k`` tokens (its last sampled token and ``k`` drafts, within the token budget and
   the length limits), counted as ``1 + k`` output placeholders, and
   ``num_computed_tokens`` advances by ``1 + k`` as if all were accepted.
   Under asynchronous scheduling the next step is scheduled while the proposing step
   still runs: it verifies ``k = q`` placeholders (``-1``) that the workers hold on the
   device, and ``SchedulerOutput.num_drafts_in_flight`` tells the workers that the
   request's start assumed the in-flight step accepted all of its drafts.
3. ``update_from_output`` gets ``1 + accepted`` tokens; ``num_computed_tokens`` drops by
   the ``k - accepted`` rejected drafts, whose slots the next step reuses (blocks are
   only hashed over ``all_token_ids``, which never holds a draft).

Never-hurts policy (on by default; ``disable_by_batch_size`` and ``min_acceptance_rate``
of the speculative config):

- in a step with more running requests than ``disable_by_batch_size`` no request proposes:
  a large batch is compute-bound, and verifying drafts there costs more than it saves;
- each request keeps a running mean of the fraction of its verified drafts that were
  accepted; below ``min_acceptance_rate`` it stops proposing, except for one probe every
  ``PROBE_INTERVAL`` sampling steps, so a request whose text turns repetitive resumes;
- under asynchronous scheduling, a request whose last collected proposal found nothing
  verifies no placeholders (the proposal in flight most likely found nothing too), and
  after ``EMPTY_PROPOSALS_BEFORE_PROBING`` empty proposals in a row it only probes, until
  a probe finds drafts (``min_acceptance_rate`` 0 turns these rules off with the one
  above: every step asks and verifies);
- drafts never cause a preemption: when the slots for them do not fit, the request is
  scheduled without them (``Scheduler`` falls back to a plain decode step first).

Metrics (vLLM's names): drafts (verification steps with at least one draft), drafted and
accepted tokens, accepted tokens per draft position; the mean acceptance length
``1 + accepted / drafts`` is logged every ``LOG_INTERVAL_S`` seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagedlm.config import SpeculativeConfig
from pagedlm.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)

PROBE_INTERVAL = 16
"""A request the acceptance rule keeps from proposing still proposes once every this
many sampling steps."""
EMPTY_PROPOSALS_BEFORE_PROBING = 4
"""Under asynchronous scheduling, proposals in a row that found nothing after which a
request only probes (the never-hurts policy)."""
ACCEPTANCE_WEIGHT = 0.3
"""Weight of the latest verification in a request's running acceptance rate."""
LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class SpecDecodingStats:
    """Cumulative counts since the engine started (``SchedulerStats.spec_decoding``)."""

    num_drafts: int = 0
    """Verification steps that verified at least one draft."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    """Entry ``j``: how often the draft at position ``j`` of a verification was accepted."""

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: the sampled one plus the accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class StepDrafts:
    """The drafts of one ``schedule()``, as the ``SchedulerOutput`` carries them."""

    def __init__(self) -> None:
        self.drafts: dict[str, list[int]] = {}
        self.to_propose: dict[str, int] = {}
        self.in_flight: dict[str, int] = {}

    def record(self, request: Request, drafts: list[int], num_proposals: int) -> None:
        """``request`` is scheduled with ``drafts`` and asks for ``num_proposals``."""
        request_id = request.request_id
        if request.num_output_placeholders and request.num_scheduled_drafts:
            # Its start counts the in-flight step's drafts as accepted.
            self.in_flight[request_id] = request.num_scheduled_drafts
        request.num_scheduled_drafts = len(drafts)
        request.num_requested_drafts = num_proposals
        if drafts:
            self.drafts[request_id] = drafts
        if num_proposals:
            self.to_propose[request_id] = num_proposals

    def withdraw_proposals(self, requests: list[Request]) -> None:
        """No request of the step asks for drafts after all (the slots held for them
        stay unused)."""
        for request in requests:
            if request.request_id in self.to_propose:
                request.num_requested_drafts = 0
        self.to_propose.clear()

    def discard(self, request: Request) -> None:
        """``request`` preempted itself after ``record``: it is not in the step."""
        for entries in (self.drafts, self.to_propose, self.in_flight):
            entries.pop(request.request_id, None)
        request.num_scheduled_drafts = request.num_requested_drafts = 0


class Speculation:
    """The scheduler's speculative-decoding component; with ``config`` None every method
    schedules nothing extra."""

    def __init__(
        self, config: SpeculativeConfig | None, max_model_len: int, async_scheduling: bool = False
    ) -> None:
        self.config = config
        self.skips_after_empty = bool(
            async_scheduling and config is not None and config.min_acceptance_rate > 0
        )
        """The empty-proposal rules (module docstring) apply: under asynchronous scheduling,
        unless ``min_acceptance_rate`` 0 asks for drafts at every step."""
        self.enabled = config is not None
        self.max_model_len = max_model_len
        self.num_lookahead_slots = config.proposer_writes_kv if config else False
        self._proposing = False
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted = 0
        self._accepted_per_pos = [0] * (config.num_speculative_tokens if config else 0)
        self._last_log = time.monotonic()

    # ---- schedule -------------------------------------------------------------------

    def begin_step(self, num_running: int) -> None:
        """Called once per ``schedule()``: whether this step's requests may propose."""
        if self.config is None:
            return
        self._proposing = not self.too_many_to_propose(num_running)

    def too_many_to_propose(self, num_running: int) -> bool:
        """Whether a step of ``num_running`` requests is past ``disable_by_batch_size``
        (``begin_step`` judged the requests running before admissions)."""
        limit = self.config.disable_by_batch_size if self.config else None
        return limit is not None and num_running > limit

    def _room(self, request: Request, num_tokens: int) -> int:
        """How many more tokens than one a step may emit for ``request`` when it has
        ``num_tokens`` tokens (known and in flight) before it."""
        outputs = num_tokens - request.num_prompt_tokens
        return min(request.max_tokens - outputs, self.max_model_len - num_tokens) - 1

    def drafts_to_verify(self, request: Request, budget: int) -> list[int]:
        """The drafts a decoding request (one token left to feed) verifies this step, at
        most ``budget``: host-known ids, or placeholders while its last step is in flight."""
        if self.config is None or budget <= 0:
            return []
        room = self._room(request, request.num_tokens + request.num_output_placeholders)
        if request.num_output_placeholders:
            if request.num_empty_proposals and self.skips_after_empty:
                # The last proposal the host has seen found nothing; the one in flight, from
                # the same text a token later, most likely too: no placeholders for it.
                return []
            num_drafts = min(request.num_requested_drafts, room, budget)
            return [-1] * num_drafts if num_drafts > 0 else []
        drafts = request.spec_token_ids
        num_drafts = min(len(drafts), room, budget)
        return drafts[:num_drafts] if num_drafts > 0 else []

    def drafts_to_propose(self, request: Request, num_drafts: int) -> int:
        """How many drafts a request that samples this step (verifying ``num_drafts``) asks
        its proposer for, for its next step."""
        config = self.config
        if config is None or not self._proposing:
            return 0
        if request.spec_acceptance < config.min_acceptance_rate or (
            self.skips_after_empty and request.num_empty_proposals >= EMPTY_PROPOSALS_BEFORE_PROBING
        ):
            # Drafts mostly rejected, or (asynchronously) a proposer that keeps finding
            # nothing, prompt lookup in text that does not repeat: each proposal is work on
            # the device, for nothing. Scheduled synchronously, it keeps asking: an empty
            # proposal costs the next step nothing.
            request.num_steps_without_drafts += 1
            if request.num_steps_without_drafts < PROBE_INTERVAL:
                return 0
        request.num_steps_without_drafts = 0
        after = request.num_tokens + request.num_output_placeholders + num_drafts + 1
        return max(0, min(config.num_speculative_tokens, self._room(request, after)))

    def lookahead(self, num_proposals: int) -> int:
        """Slots to hold beyond the step's tokens for the drafts its proposer writes KV for."""
        return num_proposals if self.num_lookahead_slots else 0

    @staticmethod
    def known_drafts(request: Request, scheduled: list[int]) -> list[int]:
        """The ids of the drafts a step verifies, once the step before it was collected
        (placeholders resolve to what the proposer drafted); only those the workers
        verify (a proposer may draft fewer than were scheduled)."""
        if not scheduled or scheduled[0] >= 0:
            return scheduled
        return request.spec_token_ids[: len(scheduled)]

    # ---- update ---------------------------------------------------------------------

    def on_sampled(
        self,
        request: Request,
        num_drafts: int,
        num_sampled: int,
        proposals: list[int] | None,
        asked: bool = False,
    ) -> int:
        """Record a collected step that sampled ``num_sampled`` tokens for ``request`` after
        verifying ``num_drafts`` drafts, and the drafts proposed for its next step (it
        ``asked`` its proposer for some).

        Returns how many of its tokens ``num_computed_tokens`` must give back (the rejected
        drafts); 0 for a request preempted meanwhile (it recomputes from scratch anyway).
        """
        running = request.status is RequestStatus.RUNNING
        if asked:
            # (An empty proposal is not in the metrics: nothing was drafted.)
            request.num_empty_proposals = 0 if proposals else request.num_empty_proposals + 1
        rejected = 0
        if num_drafts:
            accepted = num_sampled - 1
            # The drafts this step verified are those its proposing step reported (held
            # until now): the workers verify no more than their proposer drafted.
            verified = min(num_drafts, len(request.spec_token_ids))
            if verified:
                self._observe(request, verified, min(accepted, verified))
            rejected = num_drafts - accepted if running else 0
        request.spec_token_ids = proposals if running and proposals else []
        return rejected

    def _observe(self, request: Request, verified: int, accepted: int) -> None:
        self._num_drafts += 1
        self._num_draft_tokens += verified
        self._num_accepted += accepted
        for position in range(accepted):
            self._accepted_per_pos[position] += 1
        rate = accepted / verified
        request.spec_acceptance += ACCEPTANCE_WEIGHT * (rate - request.spec_acceptance)
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL_S:
            self._last_log = now
            stats = self.stats()
            logger.info(
                "Speculative decoding: mean acceptance length %.2f, accepted %d of %d drafted "
                "tokens, per-position acceptance %s",
                stats.mean_acceptance_length,
                stats.num_accepted_tokens,
                stats.num_draft_tokens,
                [round(n / stats.num_drafts, 2) for n in stats.num_accepted_tokens_per_pos],
            )

    def on_preempted(self, request: Request) -> None:
        """A preempted request's drafts are gone with its worker state."""
        request.spec_token_ids = []

    def stats(self) -> SpecDecodingStats | None:
        if self.config is None:
            return None
        return SpecDecodingStats(
            self._num_drafts,
            self._num_draft_tokens,
            self._num_accepted,
            tuple(self._accepted_per_pos),
        )
