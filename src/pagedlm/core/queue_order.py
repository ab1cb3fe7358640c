"""Where a request goes in the scheduler's ``waiting`` and ``running`` lists.

"fcfs": arrival order. A preempted request goes back to the front of ``waiting``: it was
admitted before anything still waiting, and victims are taken newest first, so pushing
each to the front keeps admission order. "priority": both lists stay sorted by
``(priority, arrival_time)``, lower first, so the scheduler's unchanged passes serve the
most urgent requests first and preempt the least urgent (the back of ``running``).
"""

from __future__ import annotations

import bisect
from collections import deque

from pagedlm.core.request import Request


def rank(request: Request) -> tuple[int, float]:
    """Order under the priority policy: lower priority value, then earlier arrival."""
    return (request.priority, request.arrival_time)


class QueueOrder:
    def __init__(self, policy: str) -> None:
        self.by_priority = policy == "priority"

    def wait(self, waiting: deque[Request], request: Request, preempted: bool = False) -> None:
        """Queue ``request`` to wait (``preempted``: it ran before)."""
        if self.by_priority:
            waiting.insert(bisect.bisect_right([rank(r) for r in waiting], rank(request)), request)
        elif preempted:
            waiting.appendleft(request)
        else:
            waiting.append(request)

    def run(self, running: list[Request], request: Request) -> None:
        """Add an admitted ``request`` to ``running``."""
        if self.by_priority:
            running.insert(bisect.bisect_right([rank(r) for r in running], rank(request)), request)
        else:
            running.append(request)
