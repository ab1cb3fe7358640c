"""The shared-storage connector (vLLM's ``ExampleConnector``, formerly
``SharedStorageConnector``): prompts' KV as files in a directory every engine can read.

A producer writes each full block of a prompt that the directory lacks once a step of its
request has computed it or, for a block the request hit in the local prefix cache (an
earlier answer in a conversation's prompt, a block whose file went), once the request is
scheduled, as vLLM's connectors store a whole prompt and not only what it computes; one
safetensors file per block: ``<shared_storage_path>/pagedlm-<model>/<digest>.safetensors``,
where ``<digest>`` is the block's chained prefix digest (``kv_cache/hashing.py``: the
block's tokens, every token before it, and its adapter, cache salt, image and embedding
keys) and ``<model>`` a digest of what shapes the KV (``model_identity.py``: the weights,
named by their files' resolved path, names, sizes and modification times, or a dummy
model's seed; the checkpoint's config, dtypes, block size, quantization). A consumer whose prompt starts with stored blocks
loads the longest run of them after its local prefix-cache hit and computes the rest; a
prompt that shares only a prefix with a stored one therefore loads that prefix.

A file holds ``key`` and ``value``, ``[num_layers, block_size, num_kv_heads, head_dim]`` in
the cache's dtype (a latent cache, whose keys are its values, ``key`` alone), and in its
metadata the model digest, the block digest and a sha256 of
the tensors' bytes. A block whose file is missing, unreadable, of another shape or model,
or whose bytes do not match is reported failed and computed instead. Files are written to a
temporary name and renamed, so a reader never sees half a file; a block already stored is
not written again, and one whose write failed is written by a later step that computes it
(``stored_blocks.py``). A block that fails to load (its file removed or damaged since it
was found) is looked up on disk again, so the request that computes it instead writes it.
The files a request wrote are removed if it fails in a step (``kv_untrusted``): their keys
and values may not be what their digests promise.

Differences from vLLM's ``ExampleConnector``: files per block (vLLM: per request and layer,
under a digest of the whole prompt, so only a prompt whose every block matches loads
anything); ``kv_producer`` only saves and ``kv_consumer`` only loads (vLLM's saves and
loads whatever the role); only prompt tokens are saved, as vLLM's; requests with a LoRA
adapter neither save nor load (an adapter's id and path name it only within one engine:
another engine may run other weights under them).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedlm.kv_cache.hashing import update_block_hashes
from pagedlm.kv_transfer.base import KVConnectorBase, KVConnectorRole, kv_untrusted
from pagedlm.kv_transfer.bookkeeping import (
    RequestTables,
    StepReport,
    check_extra_config_keys,
    loadable_tokens,
    read_loads,
)
from pagedlm.kv_transfer.model_identity import FORMAT_VERSION, model_digest
from pagedlm.kv_transfer.stored_blocks import StoredBlocks
from pagedlm.step.kv_transfer import BlockTransfer, KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.core.request import Request
    from pagedlm.kv_transfer.kv_blocks import KVCacheBlocks
    from pagedlm.step import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_STORAGE_PATH = "/tmp"
"""vLLM's default ``shared_storage_path``."""
EXTRA_CONFIG_KEYS = ("shared_storage_path",)


def storage_dir(config: EngineConfig) -> Path:
    """Where this model's blocks live under the configured ``shared_storage_path``."""
    assert config.kv_transfer is not None
    root = config.kv_transfer.get_from_extra_config("shared_storage_path", DEFAULT_STORAGE_PATH)
    return Path(root) / f"pagedlm-{model_digest(config)}"


def _tensor_digest(key: torch.Tensor, value: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in (key, value):
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class SharedStorageConnector(KVConnectorBase):
    """Blocks of prompts' KV in a shared directory (module doc)."""

    supports_weight_updates = False  # the directory is named for the starting weights

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.block_size = config.cache.block_size
        self.model_digest = model_digest(config)
        self.directory = storage_dir(config)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(
                f"kv_connector_extra_config shared_storage_path: cannot create {self.directory} "
                f"({error}); give a writable directory."
            ) from None
        transfer = self.kv_transfer_config
        self.saves = transfer.is_kv_producer
        self.loads = transfer.is_kv_consumer
        # Scheduler side.
        self._requests = RequestTables()
        self._planned_loads: list[BlockTransfer] = []
        self._loads_in_flight: dict[str, BlockTransfer] = {}
        """Per request loading, its load (its failed blocks are looked up on disk again)."""
        self._stored = StoredBlocks(lambda key: self.path(key).is_file(), self._remove_file)
        self._saved_by: dict[str, list[str]] = {}
        """Per request, the blocks it was planned to write (removed if it fails)."""
        self.num_loaded_blocks = 0
        self.num_failed_loads = 0
        self.num_saved_blocks = 0
        self.num_failed_saves = 0
        # Worker side.
        self._blocks: KVCacheBlocks | None = None
        self._report = StepReport()

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        check_extra_config_keys(config, EXTRA_CONFIG_KEYS)
        assert config.kv_transfer is not None
        extra = config.kv_transfer.kv_connector_extra_config
        path = extra.get("shared_storage_path", DEFAULT_STORAGE_PATH)
        if not isinstance(path, str) or not path:
            raise ValueError(
                f"kv_connector_extra_config shared_storage_path must be a directory path, got "
                f"{path!r}."
            )

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def _remove_file(self, key: str) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as error:
            logger.warning("KV block %s not removed: %s", self.path(key), error)

    # ---- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.loads or not _is_shared(request):
            return 0
        return loadable_tokens(
            request,
            num_computed_tokens,
            self.block_size,
            lambda block_hash: self._stored.is_stored(block_hash.hex()),
        )

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self._requests.add(request)
        if not num_external_tokens:
            return
        first = request.num_computed_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        hashes = request.block_hashes
        transfer = BlockTransfer(
            request.request_id,
            list(block_ids[first:end]),
            [block_hash.hex() for block_hash in hashes[first:end]],
        )
        self._planned_loads.append(transfer)
        self._loads_in_flight[request.request_id] = transfer

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        loads, self._planned_loads = self._planned_loads, []
        saves: list[BlockTransfer] = []
        self._requests.update(scheduler_output)
        if self.saves:
            new_req_ids = {new.req_id for new in scheduler_output.scheduled_new_reqs}
            for req_id, start in zip(
                scheduler_output.req_ids, scheduler_output.num_computed_tokens, strict=True
            ):
                # A request scheduled as new (first, or resumed) from its first block: the
                # blocks it hit in the prefix cache may be missing from the directory.
                first = 0 if req_id in new_req_ids else start // self.block_size
                transfer = self._blocks_to_save(req_id, first, start, scheduler_output)
                if transfer is not None:
                    saves.append(transfer)
            self._stored.end_step()
        return KVConnectorMetadata(loads=loads, saves=saves)

    def _blocks_to_save(
        self, req_id: str, first: int, start: int, scheduler_output: SchedulerOutput
    ) -> BlockTransfer | None:
        """The prompt blocks from block ``first`` to those that ``req_id``'s tokens of this
        step (from token ``start``) complete, not stored yet."""
        request = self._requests.get(req_id)
        if request is None or not _is_shared(request):
            return None
        end = min(start + scheduler_output.num_scheduled_tokens[req_id], request.num_prompt_tokens)
        last = end // self.block_size
        if first >= last:
            return None
        hashes = update_block_hashes(request, self.block_size)
        table = self._requests.table(req_id)
        block_ids, keys = [], []
        for index in range(first, last):
            key = hashes[index].hex()
            if self._stored.plan_save(key):  # one writer, and none for a stored block
                block_ids.append(table[index])
                keys.append(key)
        if not keys:
            return None
        self._saved_by.setdefault(req_id, []).extend(keys)
        return BlockTransfer(req_id, block_ids, keys)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving:
            transfer = self._loads_in_flight.pop(req_id, None)
            if transfer is not None and output.invalid_block_ids:
                self._stored.forget(
                    key
                    for block_id, key in zip(transfer.block_ids, transfer.keys, strict=True)
                    if block_id in output.invalid_block_ids
                )
        self.num_saved_blocks += output.num_saved_blocks
        self.num_failed_saves += output.num_failed_saves
        if output.num_saved_blocks or output.num_failed_saves:
            self._stored.saved(output.num_failed_saves)  # failed blocks are planned again

    def reset_cache(self) -> None:
        self._stored.forget()  # files may be gone; they are looked up again

    def request_finished(self, request: Request) -> None:
        self._requests.finish(request.request_id)
        self._loads_in_flight.pop(request.request_id, None)
        keys = self._saved_by.pop(request.request_id, None)
        if keys and kv_untrusted(request):
            self._stored.invalidate(keys)

    # ---- worker side ---------------------------------------------------------------

    def register_kv_caches(self, blocks: KVCacheBlocks | None) -> None:
        self._blocks = blocks

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not metadata.loads:
            return
        assert self._blocks is not None, "register_kv_caches must run first"
        read = read_loads(metadata.loads, self._read_block)
        if read.block_ids:
            keys = torch.stack([key for key, _ in read.contents], 1)
            if self._blocks.shares_values:
                values = keys
            else:
                values = torch.stack([value for _, value in read.contents], 1)
            self._blocks.write(read.block_ids, keys, values)
        self._report.add(read.output)

    def _read_block(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A stored block's ``(key, value)`` on the host, or None if it cannot be trusted."""
        from safetensors import safe_open

        assert self._blocks is not None
        path = self.path(key)
        try:
            with safe_open(str(path), framework="pt") as file:
                meta = file.metadata() or {}
                keys = file.get_tensor("key")
                # A latent cache's keys are its values: its files hold them once.
                shared = self._blocks.shares_values
                values = keys if shared else file.get_tensor("value")
        except Exception as error:
            logger.warning(
                "KV block %s not loaded (%s: %s); computing it", path, type(error).__name__, error
            )
            return None
        expected = self._blocks.block_shape
        problem = None
        if meta.get("model") != self.model_digest or meta.get("block") != key:
            problem = "written for another model or block"
        elif tuple(keys.shape) != expected or tuple(values.shape) != expected:
            problem = f"shape {tuple(keys.shape)}, expected {expected}"
        elif keys.dtype != self._blocks.dtype or values.dtype != self._blocks.dtype:
            problem = f"dtype {keys.dtype}, expected {self._blocks.dtype}"
        elif meta.get("sha256") != _tensor_digest(keys, values):
            problem = "its bytes do not match their digest"
        if problem is not None:
            logger.warning("KV block %s not loaded (%s); computing it", path, problem)
            return None
        return keys, values

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        if not metadata.saves:
            return
        assert self._blocks is not None, "register_kv_caches must run first"
        from safetensors.torch import save_file

        block_ids = [block_id for transfer in metadata.saves for block_id in transfer.block_ids]
        names = [key for transfer in metadata.saves for key in transfer.keys]
        keys, values = self._blocks.read(block_ids)
        keys, values = keys.cpu(), values.cpu()  # waits for the step that writes them
        saved = failed = 0
        for index, name in enumerate(names):
            key, value = keys[:, index].contiguous(), values[:, index].contiguous()
            meta = {
                "format": FORMAT_VERSION,
                "model": self.model_digest,
                "block": name,
                "sha256": _tensor_digest(key, value),
            }
            target = self.path(name)
            temporary = None
            try:
                handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
                os.close(handle)
                tensors = (
                    {"key": key} if self._blocks.shares_values else {"key": key, "value": value}
                )
                save_file(tensors, temporary, metadata=meta)
                os.replace(temporary, target)
                saved += 1
            except OSError as error:
                logger.warning("KV block %s not saved: %s", target, error)
                failed += 1
                if temporary is not None:
                    Path(temporary).unlink(missing_ok=True)
        self._report.add(KVConnectorOutput(num_saved_blocks=saved, num_failed_saves=failed))

    def get_connector_output(self) -> KVConnectorOutput | None:
        return self._report.take()


def _is_shared(request: Request) -> bool:
    """Whether ``request``'s blocks may be stored for, and loaded from, other engines: not
    with a LoRA adapter, whose id and path name it only inside one engine."""
    return request.lora_request is None
