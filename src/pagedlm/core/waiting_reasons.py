"""Why a waiting request waits: vLLM's ``num_requests_waiting_by_reason``.

vLLM keeps two waiting queues and labels their lengths: "capacity" for ``waiting``
(requests the next step admits once the token budget, ``max_num_seqs`` and free KV blocks
allow) and "deferred" for ``skipped_waiting`` (requests a transient constraint holds back
while the ones behind them may start: a grammar still compiling, a KV transfer in
progress, a LoRA adapter that would be one too many, a preempted request whose step is
still in flight; vLLM moves a request there when it is first held back, and back when it
is admitted). This scheduler keeps one queue and skips such requests in it; each waiting
request is tested here, when the stats are taken, as the next ``schedule()`` tests it:

- ``WAITING_FOR_GRAMMAR``: its structured-output grammar compiles (``grammar_gate.py``;
  a grammar done meanwhile is noticed by the next ``schedule()``, as in vLLM);
- ``WAITING_FOR_REMOTE_KVS``: a KV connector loads part of its prompt (``external_kv.py``);
- its adapter would be one more than ``max_loras`` next to the running requests' and those
  ahead of it in the queue (``lora/scheduler_gate.py``);
- a launched step not collected yet holds it (the pipeline-parallel batch queue).

Every other waiting request waits for capacity, a loaded one (its KV transfer done)
included. The two counts add up to ``num_requests_waiting``, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from pagedlm.core.request import Request, RequestStatus
from pagedlm.lora.scheduler_gate import LoRAGate

_COMPILING = RequestStatus.WAITING_FOR_GRAMMAR
_LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS


def count_deferred(
    waiting: Collection[Request],
    running: Iterable[Request],
    loras: LoRAGate,
    in_flight: Collection[str] = (),
    num_held: int | None = None,
) -> int:
    """How many of ``waiting`` a transient constraint holds back (module doc), tested in
    queue order and in the order ``schedule()`` tests them, so a request ahead that takes
    the last adapter slot defers the ones behind it; ``in_flight``: the ids of requests
    held by launched steps; ``num_held``: how many requests compile a grammar or load
    from a KV connector (None: unknown), so that the common step, where none does, costs
    no walk over a long queue."""
    if not waiting:
        return 0
    if loras.max_loras is None and not in_flight:  # the common case, once per step
        if num_held == 0:
            return 0
        return sum(1 for r in waiting if r.status is _COMPILING or r.status is _LOADING)
    active = loras.active(running) if loras.max_loras is not None else None
    deferred = 0
    for request in waiting:
        status = request.status
        if (
            status is _COMPILING
            or (active is not None and not loras.admits(request, active))
            or (in_flight and request.request_id in in_flight)
            or status is _LOADING
        ):
            deferred += 1
    return deferred
