"""What a KV connector's two halves tell each other once per step (``pagedlm.kv_transfer``).

The scheduler's half plans, the workers' half moves bytes: the plan rides the
``SchedulerOutput`` (``KVConnectorMetadata``), the outcome rides the ``ModelRunnerOutput``
(``KVConnectorOutput``). Plain data, as the rest of the step protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to load or save: ``block_ids[i]`` is the cache block whose
    contents are stored under ``keys[i]`` (the connector's name for them: the shared-storage
    connector's is the block's chained prefix digest, in hex). Blocks are listed in prompt
    order, so a failed block invalidates the ones after it for that request."""

    req_id: str
    block_ids: list[int]
    keys: list[str]


@dataclass(frozen=True)
class KVConnectorMetadata:
    """One step's transfers. ``loads`` fill blocks of requests that are not in the step's
    batch (they wait for their KV); ``saves`` read blocks the step's forward writes."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass(frozen=True)
class KVConnectorOutput:
    """What the workers' half did in one step (vLLM's names).

    ``finished_recving``: the requests whose loads ended this step, successful or not;
    ``invalid_block_ids``: the blocks among them that did not load (a missing, truncated or
    corrupt stored block, one written for another model): the scheduler keeps each request's
    blocks before its first invalid one and has the rest computed.
    ``num_saved_blocks`` / ``num_failed_saves``: blocks written to storage, or not."""

    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    num_saved_blocks: int = 0
    num_failed_saves: int = 0
