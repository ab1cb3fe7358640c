"""Several engine requests of one caller, run together: each one's final output, and
every other one aborted as soon as one fails or the caller leaves.

Closing an engine request's output iterator aborts it (``AsyncLLM.generate``/``encode``),
and cancelling the task that reads it closes it; so cancelling the unfinished tasks is
how the rest are aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def final_output(outputs: AsyncIterator[T]) -> T | None:
    """The last item of ``outputs`` (None if there is none: the request was aborted)."""
    final = None
    async for output in outputs:
        final = output
    return final


async def gather_all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result, in order. When one raises (or the caller is cancelled) the others are
    cancelled and awaited before the error propagates, so none runs on unobserved."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
