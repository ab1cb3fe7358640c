"""The KV connector interface: how an engine saves prompts' keys and values for other
engines and loads theirs instead of computing them (vLLM's ``KVConnectorBase_V1``).

One connector class, built twice: once beside the scheduler (``KVConnectorRole.SCHEDULER``),
once in every worker (``KVConnectorRole.WORKER``). The halves share no state; they talk
through two plain messages of the step protocol: the scheduler's half plans a step's
transfers (``KVConnectorMetadata``, in the ``SchedulerOutput``), the workers' half moves
the bytes and reports (``KVConnectorOutput``, in the ``ModelRunnerOutput``).

A step, seen from the connector:

1. Scheduler, admitting a waiting request after its local prefix-cache hits:
   ``get_num_new_matched_tokens`` says how many following tokens it can load. If any, the
   scheduler allocates blocks for the whole prompt, keeps the request waiting
   (``WAITING_FOR_REMOTE_KVS``) and calls ``update_state_after_alloc`` with the external
   count; every other admitted request gets the call with 0.
2. Scheduler, at the end of ``schedule()``: ``build_connector_meta`` returns the step's
   loads (blocks of waiting requests) and saves (blocks the step's forward fills).
3. Worker, before the forward: ``start_load_kv`` fills the loads' blocks; after the
   forward is queued: ``wait_for_save`` reads the saves' blocks out; then
   ``get_connector_output`` reports which loads ended and which blocks failed.
4. Scheduler, collecting the step: ``update_connector_output``; the scheduler counts each
   loading request's blocks up to its first failed one as computed (the rest are computed
   like any prompt) and admits it in a later step.
5. Scheduler: ``request_finished`` when a request ends or is aborted (a request that failed
   in a step, ``kv_untrusted``, may have had blocks saved whose keys and values are not what
   their digests promise: the connector must serve none of them later); ``reset_cache``
   when the engine's prefix cache is reset.

Differences from vLLM's interface, on purpose: loads always complete within one worker
step and the loading request joins a *later* step (vLLM's asynchronous loading), so a
block that fails to load is never read, whatever the scheduling mode; there is no per-layer
``wait_for_layer_load`` / ``save_kv_layer`` (transfers are whole steps, outside the forward
and its CUDA graphs); the metadata is one fixed, serializable shape (blocks and their
storage keys), not a connector-defined class; saving never delays freeing a request's
blocks (``request_finished`` returns nothing), because a save reads its blocks in the step
that writes them, before any later step can reuse them.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from pagedlm.core.request import RequestStatus
from pagedlm.step.kv_transfer import KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig, KVTransferConfig
    from pagedlm.core.request import Request
    from pagedlm.kv_transfer.kv_blocks import KVCacheBlocks
    from pagedlm.step import SchedulerOutput


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorBase(ABC):
    """A KV connector (module doc). Each method belongs to one role's instance.

    Invariants the engine keeps for the connector:
    - ``get_num_new_matched_tokens(request, n)`` is asked with ``n`` block-aligned (the
      request's local prefix-cache hit) and the answer must be a multiple of the block size
      that leaves the request's last token to compute (``n + answer < request.num_tokens``).
    - The blocks of a planned load belong to a request that is in no step's batch until the
      step carrying the load has been collected; the blocks of a planned save are written
      by the forward of the step that carries the save.
    - ``start_load_kv`` returns with the loads complete in stream order: the forward and
      every later step see the loaded contents. ``wait_for_save`` returns with the saves'
      contents copied out of the cache (later steps may overwrite those blocks).
    - A load's blocks are in prompt order: a block listed after a failed one is reported
      failed too, or not trusted by the scheduler anyway.
    """

    supports_weight_updates: bool = True
    """Whether the engine may replace its weights (``update_weights``) while this connector
    runs: ``reset_cache`` is called then, and must leave no KV of the old weights to load.
    A connector whose store other engines share under the old weights' name says False, and
    ``update_weights`` is refused naming the fix."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        assert config.kv_transfer is not None, "built only when kv_transfer_config is set"
        self.config = config
        self.role = role

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        assert self.config.kv_transfer is not None
        return self.config.kv_transfer

    @classmethod  # noqa: B027 - an optional hook
    def check_config(cls, config: EngineConfig) -> None:
        """Refuse, at start-up, options this connector cannot honour (ValueError naming the
        fix). Default: nothing to check."""

    # ---- scheduler side ------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after ``request``'s first ``num_computed_tokens`` (already in the local
        cache) whose KV this connector can load; 0 for none."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """``request`` was admitted, or (``num_external_tokens > 0``) given the blocks to load
        into: ``block_ids`` is its whole table; the external tokens follow its
        ``num_computed_tokens`` (its local hit)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's transfers (``scheduler_output`` as scheduled, before it is sent);
        the loads planned since the last call among them."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """What the workers reported for a collected step (counters). Default: nothing."""

    def request_finished(self, request: Request) -> None:  # noqa: B027 - optional hook
        """``request`` ended or was aborted; its blocks are being freed. If
        ``kv_untrusted(request)`` (it failed in a step), forget or remove every block saved
        for it, those of steps still in flight included: the engine takes its blocks out of
        its own prefix cache for the same reason. Default: nothing (a connector that saves
        must override it)."""

    def reset_cache(self) -> None:  # noqa: B027 - optional hook
        """The engine forgot its cached prefixes (``reset_prefix_cache``: asked for, or
        because the KV cache was released or the weights replaced): forget whatever this
        engine alone holds, so no request loads keys and values of other weights. Stores
        that other engines share are not this engine's to clear. Default: nothing."""

    # ---- worker side ---------------------------------------------------------------

    @abstractmethod
    def register_kv_caches(self, blocks: KVCacheBlocks | None) -> None:
        """The worker's cache, as whole-block views per layer; called again whenever the
        cache is allocated anew (after sleep), and with None when it is released (the
        connector must then drop every reference into it)."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Fill the step's loads' blocks, before the forward reads the cache."""

    @abstractmethod
    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """Copy the step's saves' blocks out, after the forward that writes them is queued."""

    @abstractmethod
    def get_connector_output(self) -> KVConnectorOutput | None:
        """What this step's ``start_load_kv`` and ``wait_for_save`` did (None: nothing);
        the connector forgets it."""


def kv_untrusted(request: Request) -> bool:
    """Whether the keys and values computed for a finished ``request`` may not be what its
    block digests promise: it failed in a step (finish reason "error"), and a step that
    could not read its LoRA adapter ran it without (a failing logits processor leaves them
    right, but the engine does not tell the two apart)."""
    return request.status == RequestStatus.FINISHED_ERROR


KVConnectorBase_V1 = KVConnectorBase
"""vLLM's name for the same interface."""
