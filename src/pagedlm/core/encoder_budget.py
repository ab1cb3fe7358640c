"""The scheduler's side of multimodal encoding: which images a step encodes.

A request's prompt holds images as runs of placeholder tokens (``Request.mm_features``).
A step that feeds any placeholder of an image needs that image's embeddings: either in
the workers' encoder cache already, or encoded by the workers in this step. Encoding
runs under its own per-step budget, ``max_num_encoder_input_tokens`` embedding rows (the
decoder's ``max_num_batched_tokens`` still bounds the tokens fed); a chunk that would
reach an image the budget cannot pay for stops just before that image.

``EncoderCacheTracker`` mirrors the workers' cache, keyed by the images' content
identifiers, so chunked prefill, preemption and a second request with the same image
never encode it again while it is cached. Invariants:

- An identifier is in ``cached`` from the step that encodes it until a step's
  ``SchedulerOutput.free_encoder_mm_hashes`` names it; workers apply those frees before
  they encode or embed anything of that step, so ``cached`` is what they hold.
- An entry referenced by a request (one of its images whose placeholders are not all
  computed yet) is never freed. Unreferenced entries stay as an LRU until the cached rows
  exceed ``encoder_cache_size``; then the oldest go, at the start of the next schedule.
- An image larger than the whole budget is still encoded, alone in its step, so no
  request waits forever.
- A ``bidirectional`` image (Gemma 3: its tokens attend to each other both ways) is never
  split across chunks: a chunk that would end inside one stops before it (or feeds
  nothing this step, if it starts inside one), so every token of the image is in the
  step that computes the image's last token. ``Scheduler.add_request`` refuses one longer
  than ``max_num_batched_tokens``, which could never be scheduled.

Check-then-commit, like block allocation: ``plan`` changes nothing, ``commit`` records a
plan once the request's KV blocks are allocated too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.core.request import Request


@dataclass(frozen=True)
class EncoderPlan:
    """``num_new_tokens`` the request may feed, and the indices of its features to
    encode for them."""

    num_new_tokens: int
    to_encode: tuple[int, ...] = ()


@dataclass
class _StepState:
    budget: int
    scheduled: dict[str, list[int]] = field(default_factory=dict)
    identifiers: set[str] = field(default_factory=set)


class EncoderCacheTracker:
    def __init__(self, max_num_encoder_input_tokens: int, encoder_cache_size: int) -> None:
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        self.encoder_cache_size = encoder_cache_size
        self.cached: OrderedDict[str, int] = OrderedDict()
        """identifier -> embedding rows, oldest use first."""
        self.refs: dict[str, set[str]] = {}
        """identifier -> the ids of the requests that still need it."""
        self._step = _StepState(max_num_encoder_input_tokens)

    def begin_step(self) -> list[str]:
        """Start a schedule; returns the identifiers the workers free before its step."""
        self._step = _StepState(self.max_num_encoder_input_tokens)
        freed = []
        total = sum(self.cached.values())
        for identifier in list(self.cached):
            if total <= self.encoder_cache_size:
                break
            if self.refs.get(identifier):
                continue
            total -= self.cached.pop(identifier)
            self.refs.pop(identifier, None)
            freed.append(identifier)
        return freed

    def reset(self) -> None:
        """The workers' cache is empty (their model runner was built again): every image
        is encoded again when next reached. Only between steps, with no request part-way
        through an image (a weight update or a sleep has none running)."""
        self.cached.clear()
        self.refs.clear()

    def take_scheduled(self) -> dict[str, list[int]]:
        return self._step.scheduled

    def plan(self, request: Request, start: int, num_new_tokens: int) -> EncoderPlan:
        """How many of ``num_new_tokens`` tokens from ``start`` the request may feed this
        step, and which of its images that needs encoded (nothing is recorded)."""
        step = self._step
        budget = step.budget
        encoding_any = budget < self.max_num_encoder_input_tokens
        end = start + num_new_tokens
        to_encode: list[int] = []
        for index, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.end <= start:
                continue
            if feature.bidirectional and feature.end > end:
                # The chunk would end inside the image: stop before it, or wait for a
                # step with room for the rest of it.
                return EncoderPlan(max(feature.offset - start, 0), tuple(to_encode))
            identifier = feature.identifier
            if identifier in self.cached or identifier in step.identifiers:
                continue
            if feature.length > budget and (to_encode or encoding_any):
                return EncoderPlan(feature.offset - start, tuple(to_encode))
            budget -= feature.length
            to_encode.append(index)
            encoding_any = True
        return EncoderPlan(num_new_tokens, tuple(to_encode))

    def commit(self, request: Request, start: int, plan: EncoderPlan) -> None:
        """Record ``plan`` (the request feeds ``plan.num_new_tokens`` tokens from
        ``start``): its encodes, and references to every image it reaches and has not
        finished."""
        step = self._step
        if plan.to_encode:
            step.scheduled[request.request_id] = list(plan.to_encode)
        for index in plan.to_encode:
            feature = request.mm_features[index]
            step.budget -= feature.length
            step.identifiers.add(feature.identifier)
            self.cached[feature.identifier] = feature.length
        end = start + plan.num_new_tokens
        for feature in request.mm_features:
            if feature.offset >= end:
                break
            if feature.end <= start:
                continue
            self.cached.move_to_end(feature.identifier)
            users = self.refs.setdefault(feature.identifier, set())
            if feature.end > end:
                users.add(request.request_id)  # later chunks still read it
            else:
                users.discard(request.request_id)

    def release(self, request: Request) -> None:
        """The request finished or was preempted: it needs none of its images now (they
        stay cached, unreferenced, for its resume or another request)."""
        for feature in request.mm_features:
            users = self.refs.get(feature.identifier)
            if users is not None:
                users.discard(request.request_id)
