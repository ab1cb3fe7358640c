"""What every KV connector keeps between the engine's calls, the same whichever store it
talks to: the scheduler side's requests and block tables (``RequestTables``), the blocks a
request may load (``loadable_tokens``), a step's loads read in prompt order
(``read_loads``), the worker side's report of a step (``StepReport``), and the check of
``kv_connector_extra_config``'s keys (``check_extra_config_keys``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from pagedlm.kv_cache.hashing import update_block_hashes
from pagedlm.step.kv_transfer import BlockTransfer, KVConnectorOutput

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.core.request import Request
    from pagedlm.kv_cache.hashing import BlockHash
    from pagedlm.step import SchedulerOutput

T = TypeVar("T")


class RequestTables:
    """The scheduler side's requests and their block tables, as the connector has seen
    them (the scheduler's KV manager is not the connector's to read).

    A request is known from ``update_state_after_alloc`` (``add``) until
    ``request_finished`` (``finish``). Its table is rebuilt from the ``SchedulerOutput``s
    alone: after ``update(scheduler_output)``, ``table(req_id)`` of every request that
    step schedules is its whole block table (block ``i`` holds tokens ``[i * block_size,
    (i + 1) * block_size)``); a preempted or finished request has none until it is
    scheduled again as new, with its whole table."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._tables: dict[str, list[int]] = {}

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def table(self, req_id: str) -> list[int]:
        return self._tables[req_id]

    def update(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Follow one step's tables; returns the requests whose tables were dropped
        (preempted or finished), for whatever the caller keeps beside them."""
        dropped = list(scheduler_output.preempted_req_ids | scheduler_output.finished_req_ids)
        for req_id in dropped:
            self._tables.pop(req_id, None)  # a resumed request comes back with its table
        for new in scheduler_output.scheduled_new_reqs:
            self._tables[new.req_id] = list(new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_block_ids:
                self._tables.setdefault(req_id, []).extend(new_block_ids)
        return dropped

    def finish(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._tables.pop(req_id, None)


def loadable_tokens(
    request: Request,
    num_computed_tokens: int,
    block_size: int,
    is_stored: Callable[[BlockHash], bool],
) -> int:
    """``get_num_new_matched_tokens`` over a store: the tokens of the run of blocks after
    the local hit (``num_computed_tokens``, block-aligned) that ``is_stored``, up to the
    first that is not, never the block of the request's last token (the engine computes
    that one). 0 for requests that need every prompt position computed, as they hit no
    prefix cache either: prompt logprobs, token-wise pooling."""
    if request.sampling_params.prompt_logprobs is not None:
        return 0
    if request.pooling is not None and request.pooling.token_wise:
        return 0
    hashes = update_block_hashes(request, block_size)
    last = (request.num_tokens - 1) // block_size  # the last token is computed
    index = num_computed_tokens // block_size
    while index < min(last, len(hashes)) and is_stored(hashes[index]):
        index += 1
    return max(0, index * block_size - num_computed_tokens)


@dataclass(frozen=True)
class ReadLoads(Generic[T]):
    """A step's loads as read from a store: ``contents[i]`` goes into cache block
    ``block_ids[i]``; ``output`` reports every load finished and its unread blocks."""

    block_ids: list[int]
    contents: list[T]
    output: KVConnectorOutput


def read_loads(loads: Iterable[BlockTransfer], read: Callable[[str], T | None]) -> ReadLoads[T]:
    """Each load's blocks through ``read(key)`` (None: cannot be trusted), in prompt order:
    the first block that fails and every later one of its request are reported invalid and
    not read, so a request keeps only the run of blocks before its first failure."""
    finished: set[str] = set()
    invalid: set[int] = set()
    block_ids: list[int] = []
    contents: list[T] = []
    for transfer in loads:
        finished.add(transfer.req_id)
        for position, (block_id, key) in enumerate(
            zip(transfer.block_ids, transfer.keys, strict=True)
        ):
            content = read(key)
            if content is None:  # this block and every later one are computed instead
                invalid.update(transfer.block_ids[position:])
                break
            block_ids.append(block_id)
            contents.append(content)
    return ReadLoads(
        block_ids, contents, KVConnectorOutput(finished_recving=finished, invalid_block_ids=invalid)
    )


class StepReport:
    """The worker side's ``KVConnectorOutput`` of one step: what ``start_load_kv`` and
    ``wait_for_save`` report is merged until ``get_connector_output`` takes it."""

    def __init__(self) -> None:
        self._output: KVConnectorOutput | None = None

    def add(self, output: KVConnectorOutput) -> None:
        previous = self._output
        if previous is not None:
            output = KVConnectorOutput(
                previous.finished_recving | output.finished_recving,
                previous.invalid_block_ids | output.invalid_block_ids,
                previous.num_saved_blocks + output.num_saved_blocks,
                previous.num_failed_saves + output.num_failed_saves,
            )
        self._output = output

    def take(self) -> KVConnectorOutput | None:
        output, self._output = self._output, None
        return output


def check_extra_config_keys(config: EngineConfig, known: tuple[str, ...]) -> None:
    """ValueError naming the known keys for a ``kv_connector_extra_config`` key outside
    ``known``."""
    assert config.kv_transfer is not None
    unknown = sorted(set(config.kv_transfer.kv_connector_extra_config) - set(known))
    if unknown:
        raise ValueError(
            f"Unknown kv_connector_extra_config key(s) {unknown} for "
            f"{config.kv_transfer.kv_connector}; known: {list(known)}."
        )
