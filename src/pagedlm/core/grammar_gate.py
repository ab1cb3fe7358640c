"""What the scheduler does for structured-output requests, in one place.

A constrained request waits with status ``WAITING_FOR_GRAMMAR`` while its grammar compiles
on the manager's thread, and is skipped (requests behind it are admitted) until it is
ready. Each step's sampling gets the allowed-token bitmask of the constrained requests that
sample, computed once the previous step's tokens have advanced their matchers.
Sampled tokens advance the request's matcher (those after its thought, where grammars
apply after the model's thought); a terminated grammar finishes the request
("stop"), a grammar that failed to compile aborts it with the compiler's message. Without a
``StructuredOutputManager`` every method is a no-op except ``add``, which refuses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedlm.core.request import Request, RequestStatus
from pagedlm.step import GrammarBitmask

if TYPE_CHECKING:
    from pagedlm.structured_output.manager import StructuredOutputManager

GRAMMAR_WAIT_S = 0.05
"""How long an idle step blocks for a compiling grammar before returning empty."""
GRAMMAR_DEAD_END = (
    "sampled a token the grammar does not allow: the request's allowed_token_ids, "
    "bad_words or logit_bias leave none of the tokens the grammar allows next; loosen them."
)
"""The stop reason of a constrained request whose sampled token broke its grammar."""


class GrammarGate:
    def __init__(self, manager: StructuredOutputManager | None) -> None:
        self.manager = manager
        self.compiling: set[str] = set()
        """Ids of the requests with status ``WAITING_FOR_GRAMMAR`` (from ``add`` until
        ``ready`` admits them or ``remove`` ends them)."""

    def add(self, request: Request) -> None:
        """Start compiling ``request``'s grammar; it waits until that is done."""
        if self.manager is None:
            raise ValueError(
                f"request {request.request_id!r} asks for structured outputs, but this "
                "scheduler was built without a StructuredOutputManager."
            )
        self.manager.add_request(request)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.compiling.add(request.request_id)

    def ready(self, request: Request) -> bool:
        """Whether a waiting request may be admitted (its grammar, if any, compiled)."""
        if request.status is not RequestStatus.WAITING_FOR_GRAMMAR:
            return True
        assert self.manager is not None
        if not self.manager.is_ready(request.request_id):
            return False
        request.status = RequestStatus.WAITING
        self.compiling.discard(request.request_id)
        return True

    def wait_while_idle(self, waiting: Iterable[Request]) -> None:
        """With nothing running and every waiting request compiling, block briefly on the
        compiler instead of spinning."""
        waiting = list(waiting)
        compiling = [r.request_id for r in waiting if r.status is RequestStatus.WAITING_FOR_GRAMMAR]
        if self.manager is not None and len(compiling) == len(waiting) > 0:
            self.manager.wait_for_any(compiling, GRAMMAR_WAIT_S)

    def bitmask(
        self, request_ids: Iterable[str], drafts: dict[str, list[int]] | None = None
    ) -> GrammarBitmask | None:
        """Masks for constrained requests that sample now (their matchers as they stand),
        one row per position for those verifying ``drafts``."""
        if self.manager is None:
            return None
        request_ids = list(request_ids)
        return self.manager.grammar_bitmask(request_ids, drafts) if request_ids else None

    def check_failed(self, request: Request, sampled: list[int]) -> list[int]:
        """``sampled``, or nothing if the request's grammar failed to compile (the request
        then ends with "abort" and the compiler's message)."""
        if self.manager is None or request.sampling_params.structured_outputs is None:
            return sampled
        error = self.manager.error(request.request_id)
        if error is None:
            return sampled
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = error
        return []

    def advance(self, request: Request, token_ids: list[int]) -> int:
        """Feed appended tokens to the request's matcher, those of its thought left out
        (grammars after the thought: the manager's ``answer_start``); finish it if the
        grammar ends.

        Returns how many of ``token_ids`` stay: tokens after the one that ended the grammar
        (several arrive at once with speculative decoding) are taken off the request."""
        if self.manager is None or request.sampling_params.structured_outputs is None:
            return len(token_ids)
        request_id = request.request_id
        for index in range(self.manager.answer_start(request_id, token_ids), len(token_ids)):
            token_id = token_ids[index]
            if not self.manager.accept_tokens(request_id, [token_id]):
                # The row had no token left that the grammar allows (its allowed_token_ids,
                # bad words or a -inf logit bias took them all): never emit text that
                # breaks the grammar, so the token and those after it are taken back.
                request.status = RequestStatus.FINISHED_ABORTED
                request.stop_reason = GRAMMAR_DEAD_END
                del request.all_token_ids[len(request.all_token_ids) - len(token_ids) + index :]
                return index
            if self.manager.is_terminated(request_id):
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = None
                extra = len(token_ids) - index - 1
                if extra:
                    del request.all_token_ids[-extra:]
                return index + 1
        return len(token_ids)

    def remove(self, request: Request) -> None:
        self.compiling.discard(request.request_id)
        if self.manager is not None:
            self.manager.remove(request.request_id)
