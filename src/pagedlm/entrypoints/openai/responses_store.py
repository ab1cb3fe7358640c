"""Stored responses (``store=true``), for ``previous_response_id``, GET/DELETE and the
listing of their input items.

In memory and bounded: the least recently used response goes first once ``max_entries``
are held, so a long-running server never grows without limit (a client that needs a
response later keeps its own copy; OpenAI's store is durable, this one is not).

Every entry belongs to the API key that created it (``owner_of``: a hash of the
``Authorization`` header, so raw keys are never held): another key sees a 404, exactly
as for a response that does not exist, so ids leak nothing across keys.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    """The response body as GET returns it."""
    conversation: list[dict[str, Any]]
    """Chat messages of the whole exchange (input, then output; instructions excluded:
    a follow-up's own instructions apply, as OpenAI's)."""
    input_items: list[dict[str, Any]]
    """The input items, as ``GET .../input_items`` lists them: after
    ``previous_response_id`` the earlier responses' (``items_read``), then the request's
    own (no more than the conversation holds: the store's bound on entries bounds them
    too)."""

    def items_read(self) -> list[dict[str, Any]]:
        """What a follow-up's model reads before its own input: this response's input items
        and then its output items, as OpenAI lists a follow-up's input items."""
        return [*self.input_items, *self.response["output"]]


def owner_of(authorization: str | None) -> str:
    """The store namespace of a request's ``Authorization`` header (one per API key)."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}.")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, response_id: str, entry: StoredResponse) -> None:
        self._entries[(owner, response_id)] = entry
        self._entries.move_to_end((owner, response_id))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get((owner, response_id))
        if entry is not None:
            self._entries.move_to_end((owner, response_id))
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        return self._entries.pop((owner, response_id), None) is not None
