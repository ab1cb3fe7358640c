"""The scheduler's side of a KV connector (``pagedlm.kv_transfer``): prompts whose KV
another engine stored are loaded into their blocks instead of computed.

Loading takes a step of its own, before the request joins any batch:

1. Admission (``start_load``): after a waiting request's local prefix-cache hit, the
   connector says how many following tokens it can load. If any, the request gets blocks
   for its whole prompt at once (so once loaded it needs no new block to be admitted),
   stays in ``waiting`` as ``WAITING_FOR_REMOTE_KVS`` and is skipped like a compiling
   grammar. The new blocks are not indexed in the prefix cache yet: no other request may
   hit a block before it is known to hold the right KV.
2. The step's ``SchedulerOutput`` carries the load; the workers run it before that step's
   forward (a step with loads and no tokens still runs).
3. Collecting that step (``finish_loads``): the blocks before the first one that failed
   count as computed and enter the prefix cache; the request waits again, holding its
   blocks, and the next admission schedules its remaining tokens (at least its last).

Under asynchronous scheduling the load is collected one step later than synchronously;
nothing else differs: the loaded blocks are written on the device stream before any step
that reads them. A loading or loaded request counts against ``max_num_seqs`` when another
load is started, so loads cannot fill the cache with requests that have no seat.

Progress: a loaded request waits in the queue behind requests that may need its blocks or
its seat (a preempted request goes back to the front). So loaded requests give their
blocks back (``release_loaded``) before a running request is preempted for blocks, and
whenever the head of the queue cannot be admitted or start its load; released blocks stay
in the prefix cache, so a released request usually finds them again as a local hit.
Loading requests keep theirs (a load in flight writes them, and its report must not be
taken for a later load's); they are loaded, and releasable, once their step is collected.
"""

from __future__ import annotations

from dataclasses import replace

from pagedlm.core.request import Request, RequestStatus
from pagedlm.kv_cache.manager import ComputedBlocks, KVCacheManager
from pagedlm.kv_transfer.base import KVConnectorBase
from pagedlm.step import KVConnectorOutput, SchedulerOutput


class ExternalKV:
    """Bookkeeping around one scheduler-side connector (module doc).

    Invariants: a request is in ``loading`` from ``start_load`` until its load step is
    collected, then in ``loaded`` until admitted, aborted or released; in both it holds
    blocks for its whole prompt and ``num_computed_tokens`` counts its local hit (then the
    loaded tokens too)."""

    def __init__(self, connector: KVConnectorBase, kv_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_manager = kv_manager
        self.block_size = kv_manager.block_size
        self.loading: dict[str, Request] = {}
        self.loaded: dict[str, Request] = {}
        self.num_loaded_tokens = 0
        """Tokens loaded and counted as computed (cumulative)."""
        self.num_failed_tokens = 0
        """Tokens planned for loading whose blocks failed and were computed (cumulative)."""
        self.prefix_cache_queries = 0
        """Tokens asked of the connector (vLLM's ``external_prefix_cache_queries``): each
        admission's prompt tokens past its local hit, counted once its blocks are held (a
        planned load, or the admission itself); resumed preemptions are left out, as
        vLLM leaves them out."""
        self.prefix_cache_hits = 0
        """Of those, tokens the connector had (planned for loading)."""
        self.prefix_cache_requests = 0
        """Admissions counted in ``prefix_cache_queries`` (cumulative)."""

    @property
    def num_holding(self) -> int:
        """Waiting requests that hold blocks for a load."""
        return len(self.loading) + len(self.loaded)

    def is_loaded(self, request: Request) -> bool:
        """Whether ``request`` waits holding the blocks its finished load filled."""
        return request.request_id in self.loaded

    def start_load(self, request: Request, computed: ComputedBlocks) -> bool | None:
        """Plan a load for a waiting ``request`` after its local hit ``computed``: True if
        planned (the request now waits for it), False if the connector has nothing for it,
        None if it has but the blocks do not fit (nothing changed)."""
        num_external = self.connector.get_num_new_matched_tokens(
            request, computed.num_computed_tokens
        )
        if num_external <= 0:
            return False
        num_prompt_slots = request.num_tokens - computed.num_computed_tokens
        if (
            self.kv_manager.allocate_slots(
                request, num_prompt_slots, computed, delay_cache_blocks=True
            )
            is None
        ):
            return None
        request.num_computed_tokens = computed.num_computed_tokens
        request.num_external_computed_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.connector.update_state_after_alloc(
            request, self.kv_manager.get_block_ids(request), num_external
        )
        self.loading[request.request_id] = request
        self._count_query(request, computed, num_external)
        return True

    def admitted(self, request: Request, computed: ComputedBlocks | None = None) -> None:
        """``request`` joins the step's batch (its external tokens, if any, loaded).
        ``computed``: its local hit, when the connector was just asked and had nothing."""
        if computed is not None:
            self._count_query(request, computed, 0)
        self.loaded.pop(request.request_id, None)
        self.connector.update_state_after_alloc(request, self.kv_manager.get_block_ids(request), 0)

    def _count_query(self, request: Request, computed: ComputedBlocks, num_hits: int) -> None:
        if not request.num_preemptions:
            self.prefix_cache_requests += 1
            self.prefix_cache_queries += request.num_tokens - computed.num_computed_tokens
            self.prefix_cache_hits += num_hits

    def attach_metadata(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        metadata = self.connector.build_connector_meta(scheduler_output)
        if not metadata:
            return scheduler_output
        return replace(scheduler_output, kv_connector_metadata=metadata)

    def finish_loads(self, output: KVConnectorOutput | None) -> None:
        """Fold a collected step's report in: each finished load keeps its blocks up to the
        first invalid one, and its request waits to be admitted."""
        if output is None:
            return
        self.connector.update_connector_output(output)
        for req_id in output.finished_recving:
            request = self.loading.pop(req_id, None)
            if request is None:
                continue  # aborted meanwhile; its blocks are free already
            block_ids = self.kv_manager.get_block_ids(request)
            first = request.num_computed_tokens // self.block_size
            end = first + request.num_external_computed_tokens // self.block_size
            valid = first
            while valid < end and block_ids[valid] not in output.invalid_block_ids:
                valid += 1
            num_loaded = (valid - first) * self.block_size
            self.num_loaded_tokens += num_loaded
            self.num_failed_tokens += request.num_external_computed_tokens - num_loaded
            request.num_external_computed_tokens = num_loaded
            request.num_computed_tokens += num_loaded
            self.kv_manager.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.WAITING
            self.loaded[req_id] = request

    def release_loaded(self, keep: Request | None = None) -> bool:
        """Free the blocks of loaded requests not admitted yet, but ``keep``'s (they wait as
        new ones: their blocks stay in the prefix cache, and what is gone loads again).
        Returns whether any was released. Afterwards no waiting request holds blocks but
        ``keep`` and loading ones."""
        released = [request for request in self.loaded.values() if request is not keep]
        for request in released:
            del self.loaded[request.request_id]
            self.kv_manager.free(request)
            request.num_computed_tokens = 0
            request.num_external_computed_tokens = 0
        return bool(released)

    def finished(self, request: Request) -> None:
        self.loading.pop(request.request_id, None)
        self.loaded.pop(request.request_id, None)
        self.connector.request_finished(request)
