"""The hand-off between the output task and one ``AsyncLLM.generate`` consumer."""

from __future__ import annotations

import asyncio
from collections import deque

from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import RequestOutputKind

StreamItem = RequestOutput | BaseException | None
"""An output, an error to raise in the consumer, or None: the request was aborted."""


class RequestStream:
    """Outputs of one user request, waiting for its consumer.

    Invariant: items come out in the order they went in, except that in CUMULATIVE mode a
    newer unfinished output replaces an older one the consumer has not taken yet (each
    carries everything so far, so a slow consumer skips stale snapshots instead of
    falling behind). DELTA outputs are never merged or dropped.
    """

    def __init__(self, output_kind: RequestOutputKind, num_prompt_tokens: int) -> None:
        self.output_kind = output_kind
        self.num_prompt_tokens = num_prompt_tokens
        """Prompt tokens counted in the metrics for this request (all ``n`` samples)."""
        self._items: deque[StreamItem] = deque()
        self._ready = asyncio.Event()

    def put(self, item: StreamItem) -> None:
        items = self._items
        if (
            self.output_kind is RequestOutputKind.CUMULATIVE
            and isinstance(item, RequestOutput)
            and items
            and isinstance(items[-1], RequestOutput)
            and not items[-1].finished
        ):
            items[-1] = item
        else:
            items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | None:
        """The next output (None once aborted); raises an error put in the stream."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item
