"""The scheduler's view of structured outputs: compile futures, matchers, the bitmask.

Lifecycle of a constrained request:

1. ``add_request``: its spec is submitted to the :class:`GrammarCompiler` (a thread) and
   the request waits (status ``WAITING_FOR_GRAMMAR``); the scheduler admits others.
2. ``is_ready``: once the future is done, a fresh matcher is made (or the failure is
   recorded, and the scheduler finishes the request with "abort": the engine never
   crashes on a grammar). A compile running longer than ``GrammarLimits.compile_timeout_s``
   is a failure too (and is written off its compiler lane). Failure messages start with
   ``GRAMMAR_FAILED``, which ``grammar_failure`` recognizes in an output.
3. ``grammar_bitmask``: each step, the allowed next tokens of the constrained requests
   that sample, in one ``[M, ceil(vocab / 32)]`` int32 array shipped with the
   ``SchedulerOutput``.
4. ``accept_tokens`` on every token the scheduler appends; ``is_terminated`` ends the
   request when its grammar is complete. With ``ReasoningMarkers`` (grammars after the
   model's thought), ``answer_start`` first moves the request's thought state past the
   appended tokens, and only those after the thought reach the matcher; the bitmask rows of
   positions inside a thought allow everything (``reasoning.py``).
5. ``remove`` (finished or aborted): a compile that no other request waits for and that
   has not started is cancelled.

Matchers (and thought states) live here, keyed by request id, and are never reset by
preemption: a preempted request recomputes the same tokens, so its grammar state is still
right.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedlm.step import GrammarBitmask
from pagedlm.structured_output.backend import (
    GrammarMatcher,
    GrammarSpec,
    StructuredOutputBackend,
    backend_class,
    bitmask_width,
)
from pagedlm.structured_output.compiler import GrammarCompiler
from pagedlm.structured_output.params import GrammarLimits, backend_error, grammar_spec
from pagedlm.structured_output.reasoning import (
    ReasoningState,
    after_token,
    allow_tokens,
    answer_start,
)

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.core.request import Request

logger = logging.getLogger(__name__)


GRAMMAR_FAILED = "grammar compilation failed: "


def grammar_failure(finish_reason: str | None, stop_reason: int | str | None) -> str | None:
    """The message of an output that ended because its grammar failed, else None."""
    failed = (
        finish_reason == "abort"
        and isinstance(stop_reason, str)
        and stop_reason.startswith(GRAMMAR_FAILED)
    )
    return stop_reason if failed else None


@dataclass
class _RequestGrammar:
    spec: GrammarSpec
    future: Future[Any]
    added: float = field(default_factory=time.monotonic)
    matcher: GrammarMatcher | None = None
    error: str | None = None
    reasoning: ReasoningState = True
    """Where its output stands against the thought (``reasoning.py``); True: the grammar
    governs every token."""


class StructuredOutputManager:
    """Owns the compiler and one matcher per constrained request (see module doc)."""

    def __init__(self, config: EngineConfig) -> None:
        self.backend_name = config.structured_outputs_backend
        self.vocab_size = config.model.arch.vocab_size
        self._model_config = config.model
        self.compiler = GrammarCompiler(self._make_backend)
        self.limits = GrammarLimits()
        self.reasoning = config.structured_outputs_reasoning
        """The thought's markers when grammars apply after it, else None."""
        self._requests: dict[str, _RequestGrammar] = {}

    def set_limits(self, limits: GrammarLimits) -> None:
        """Replace the default limits (the engine-core process sets the configured ones)."""
        self.limits = limits

    def _make_backend(self) -> StructuredOutputBackend:
        from pagedlm.tokenizer import model_tokenizer

        model = self._model_config
        tokenizer = model_tokenizer(model)
        stop_ids = list(dict.fromkeys([tokenizer.eos_token_id, *model.arch.eos_token_ids]))
        stop_ids = [t for t in stop_ids if t is not None]
        return backend_class(self.backend_name)(tokenizer, self.vocab_size, stop_ids)

    # ---- per request ---------------------------------------------------------------

    def uses_grammar(self, request: Request) -> bool:
        return request.sampling_params.structured_outputs is not None

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        assert params is not None, "only constrained requests are added"
        spec = grammar_spec(params)
        state = _RequestGrammar(spec, self.compiler.acquire(spec))
        if self.reasoning is not None:
            state.reasoning = request.reasoning_ended
        self._requests[request.request_id] = state

    def is_ready(self, request_id: str) -> bool:
        """Compiled (or failed, or past the compile timeout): the request may be scheduled."""
        state = self._requests[request_id]
        if state.matcher is not None or state.error is not None:
            return True
        if not state.future.done():
            return self._check_timeout(request_id, state)
        try:
            state.matcher = self.compiler.backend.make_matcher(state.future.result())
        except Exception as exc:  # any backend failure ends this request, not the engine
            state.error = f"{GRAMMAR_FAILED}{backend_error(exc)}"
            logger.warning("request %s: %s", request_id, state.error)
        return True

    def _check_timeout(self, request_id: str, state: _RequestGrammar) -> bool:
        timeout_s = self.limits.compile_timeout_s
        if timeout_s <= 0:
            return False
        running_s = self.compiler.running_s(state.spec)
        if running_s is not None and running_s > timeout_s:
            self.compiler.write_off(state.spec)
            state.error = (
                f"{GRAMMAR_FAILED}it took longer than {timeout_s:g} s "
                "(--structured-outputs-compile-timeout-s); simplify the schema or grammar "
                "(fewer properties, alternatives or nesting levels) or raise the limit."
            )
        elif (
            running_s is None
            and self.compiler.at_thread_cap()
            and time.monotonic() - state.added > timeout_s
        ):
            # Every compile thread is busy with grammars that ran past the timeout: this
            # one could wait for hours.
            state.error = (
                f"{GRAMMAR_FAILED}the compiler is busy with grammars that ran past the "
                f"{timeout_s:g} s timeout; send the request again later."
            )
        else:
            return False
        logger.warning("request %s: %s", request_id, state.error)
        return True

    def error(self, request_id: str) -> str | None:
        state = self._requests.get(request_id)
        return None if state is None else state.error

    def wait_for_any(self, request_ids: list[str], timeout: float) -> None:
        """Block until one of these requests' grammars is compiled (idle engine only)."""
        pending = [
            self._requests[r].future
            for r in request_ids
            if r in self._requests and not self._requests[r].future.done()
        ]
        if pending:
            wait_futures(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def answer_start(self, request_id: str, token_ids: list[int]) -> int:
        """Move the request's thought state past ``token_ids`` (appended in this order);
        returns the index of the first of them its grammar governs (``len(token_ids)``:
        none, the thought goes on)."""
        state = self._requests[request_id]
        state.reasoning, start = answer_start(self.reasoning, state.reasoning, token_ids)
        return start

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the request's matcher; False if a token was not allowed."""
        matcher = self._requests[request_id].matcher
        assert matcher is not None, "a request samples only once its grammar is ready"
        return all(matcher.accept_token(t) for t in token_ids)

    def is_terminated(self, request_id: str) -> bool:
        matcher = self._requests[request_id].matcher
        return matcher is not None and matcher.is_terminated()

    def remove(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None and not state.future.done():
            self.compiler.release(state.spec, state.future)

    # ---- per step ------------------------------------------------------------------

    def grammar_bitmask(
        self, request_ids: list[str], drafts: dict[str, list[int]] | None = None
    ) -> GrammarBitmask | None:
        """Allowed next tokens for the given sampling requests that have a matcher; None
        where no row would restrict anything (every such position inside a thought).

        A request with ``drafts[request_id]`` (speculative decoding: the ``k`` drafts its
        step verifies, ``-1`` where unknown) gets ``1 + k`` rows: row ``j`` allows what may
        follow its first ``j`` drafts, a thought's end among them included (rows after an
        end marker are the grammar's). Past a draft the grammar rejects (or an unknown
        one), rows allow everything: that draft is rejected by its own row's mask, so
        the positions after it are never used."""
        drafts = drafts or {}
        requests = [r for r in request_ids if self._matcher_of(r) is not None]
        if not requests:
            return None
        num_rows = sum(1 + len(drafts.get(r, ())) for r in requests)
        bitmask = np.full((num_rows, bitmask_width(self.vocab_size)), -1, dtype=np.int32)
        rows: list[str] = []
        masked = False
        for request_id in requests:
            row = len(rows)
            request_drafts = drafts.get(request_id, ())
            rows.extend([request_id] * (1 + len(request_drafts)))
            masked |= self._fill_rows(request_id, request_drafts, bitmask, row)
        return GrammarBitmask(req_ids=rows, bitmask=bitmask) if masked else None

    def _fill_rows(self, request_id: str, drafts: list[int], bitmask: np.ndarray, row: int) -> bool:
        """Write a request's ``1 + len(drafts)`` rows from ``row`` on; whether any row
        restricts."""
        state = self._requests[request_id]
        matcher = state.matcher
        assert matcher is not None
        reasoning = state.reasoning
        masked = self._fill_row(matcher, reasoning, bitmask, row)
        accepted = 0
        for position, token_id in enumerate(drafts, start=1):
            if token_id < 0:
                break
            after, governed = True, True
            if self.reasoning is not None:
                after, governed = after_token(self.reasoning, reasoning, token_id)
            if governed:
                if matcher.is_terminated() or not matcher.accept_token(token_id):
                    break
                accepted += 1
            reasoning = after
            if not matcher.is_terminated():
                masked |= self._fill_row(matcher, reasoning, bitmask, row + position)
        if accepted:
            matcher.rollback(accepted)
        return masked

    def _fill_row(
        self, matcher: GrammarMatcher, reasoning: ReasoningState, bitmask: np.ndarray, row: int
    ) -> bool:
        """One position's row: the grammar's mask, all ones inside a thought, the grammar's
        and the start markers where the token decides; whether it restricts."""
        if reasoning is False:
            return False
        matcher.fill_bitmask(bitmask, row)
        if reasoning is None:
            assert self.reasoning is not None
            allow_tokens(bitmask, row, self.reasoning.start_token_ids)
        return True

    def _matcher_of(self, request_id: str) -> GrammarMatcher | None:
        state = self._requests.get(request_id)
        return None if state is None else state.matcher

    def shutdown(self) -> None:
        self.compiler.shutdown()
