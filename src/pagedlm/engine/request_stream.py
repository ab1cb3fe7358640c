"""The hand-off between the output task and one ``AsyncLLM.generate`` consumer."""

from __future__ import annotations

import asyncio
from collections import deque

from pagedlm.outputs import CompletionOutput, RequestOutput
from pagedlm.sampling_params import RequestOutputKind

StreamItem = RequestOutput | BaseException | None
"""An output, an error to raise in the consumer, or None: the request was aborted."""


class RequestStream:
    """Outputs of one user request, waiting for its consumer.

    Invariant: items come out in the order they went in, except that an output the
    consumer has not taken yet absorbs the next one. In CUMULATIVE mode the newer snapshot
    replaces it (each carries everything so far); in DELTA mode the two deltas are
    concatenated, so nothing is lost and a consumer that falls behind takes one output per
    wake-up instead of one per engine step: what a slow consumer (an SSE stream, say) pays
    per output then scales with its own pace, not with the number of tokens.
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
            isinstance(item, RequestOutput)
            and items
            and isinstance(items[-1], RequestOutput)
            and not items[-1].finished
        ):
            if self.output_kind is RequestOutputKind.CUMULATIVE:
                items[-1] = item
                return
            if self.output_kind is RequestOutputKind.DELTA:
                merge_delta(items[-1], item)
                return
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


def merge_delta(pending: RequestOutput, newer: RequestOutput) -> None:
    """Fold DELTA output ``newer`` into ``pending`` (not yet seen by anyone), in place."""
    samples = {sample.index: sample for sample in pending.outputs}
    for sample in newer.outputs:
        old = samples.get(sample.index)
        samples[sample.index] = sample if old is None else _concat(old, sample)
    pending.outputs = [samples[index] for index in sorted(samples)]
    if pending.prompt_logprobs is None:
        pending.prompt_logprobs = newer.prompt_logprobs
    pending.finished = newer.finished
    pending.num_cached_tokens = newer.num_cached_tokens
    pending.metrics = newer.metrics


def _concat(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    logprobs = old.logprobs
    if logprobs is None:
        logprobs = new.logprobs
    elif new.logprobs is not None:
        logprobs = logprobs + new.logprobs
    return CompletionOutput(
        index=old.index,
        text=old.text + new.text,
        token_ids=old.token_ids + new.token_ids,
        cumulative_logprob=new.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=new.finish_reason,
        stop_reason=new.stop_reason,
        num_cached_tokens=max(old.num_cached_tokens, new.num_cached_tokens),
    )
