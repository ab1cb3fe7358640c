"""The worker's adapters: ``max_loras`` device slots, LRU over a host cache.

An adapter is its ``LoRARequest.adapter_key``, (id, path): the requests of a removed
adapter still running beside those of the next adapter under its id each get their own
weights. Every step, ``prepare_step`` makes sure each adapter the step's requests name sits in a
device slot (from the host cache, else read from its directory), evicting the least
recently used adapter the step does not need, then writes each token's slot into the
fixed-address ``token_slots`` buffer every ``LoRALinear`` reads. An adapter that cannot be
read then (the engine core had it read before its first request, but the host cache let it
go and its files went too) fails the requests that name it, not the step: they run without
it, and the step reports them (``ModelRunnerOutput.failed``) for the scheduler to end.
Under tensor or pipeline parallelism each rank reads its shard itself and the ranks agree
on every read (``gather_from_every_rank``): one rank's failure fails the requests on every
rank, including the output rank, which alone reports the step.

vLLM's adapter management works on the host cache: ``add`` reads an adapter into it ahead
of its first request, ``remove`` forgets one, ``list_ids`` names what it holds, ``pin``
keeps one for good (never dropped from the host cache, and evicted from its device slot
only when a step needs more slots than the unpinned adapters free); these name adapters by
id (every path the id names). A new model runner
(level-2 wake-up, new weights) ``adopt``s the old one's ``host_state``.

Invariants:
- Every rank of an engine holds the same host cache and slots: they apply the same calls in
  the same order, and an adapter that one rank cannot read (a step's, or ``add``'s) is kept
  by none. So the ranks read from disk at the same points, where they agree.
- At most ``max_loras`` distinct adapters per step (the scheduler's ``LoRAGate`` admits no
  more), so a step's adapters always find slots (a pinned adapter gives its slot up when
  the step needs it).
- Weights are found by (id, path), never by id alone: a slot or host-cache entry of an id
  never serves another path's requests.
- A slot rewritten for step N+1 while step N is in flight is safe: the copies are queued
  on the device after step N's kernels, which read the old weights first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedlm.config import ArchConfig, EngineConfig, LoRAConfig
from pagedlm.distributed.parallel_state import gather_from_every_rank
from pagedlm.distributed.pipeline import this_stage_layers
from pagedlm.lora.layers import LoRALinear
from pagedlm.lora.ops import LoRAOps, LoRAStepState
from pagedlm.lora.peft_format import AdapterWeights, layer_index, load_adapter
from pagedlm.lora.request import LoRARequest
from pagedlm.lora.targets import LoRATarget, lora_targets
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.worker.host_to_device import HostToDevice

if TYPE_CHECKING:
    from pagedlm.platforms import Platform
    from pagedlm.worker.input_batch import RequestState

logger = logging.getLogger(__name__)


AdapterKey = tuple[int, str]
"""``LoRARequest.adapter_key``: (lora_int_id, lora_path)."""
HostState = tuple["OrderedDict[AdapterKey, AdapterWeights]", set[int]]
"""What outlives a model runner: the host cache (least recently used first) and the
pinned ids."""


class NoLoRA:
    """The component when ``enable_lora`` is off: nothing to prepare, nothing loaded."""

    graph_safe = True

    def prepare_step(
        self, states: list[RequestState], query_start_loc: np.ndarray, num_tokens: int
    ) -> dict[str, str]:
        return {}

    def add(self, lora: LoRARequest) -> bool:
        raise ValueError(
            f"LoRA adapter {lora.lora_name!r} cannot be added: LoRA is not enabled; start "
            "the engine with enable_lora=True (--enable-lora)."
        )

    def remove(self, lora_id: int) -> bool:
        return False

    def list_ids(self) -> set[int]:
        return set()

    def pin(self, lora_id: int) -> bool:
        return False

    def host_state(self) -> HostState | None:
        return None

    def adopt(self, state: HostState | None) -> None:
        pass


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        arch: ArchConfig,
        model: torch.nn.Module,
        max_num_tokens: int,
        ops: LoRAOps,
        dtype: torch.dtype,
        device: torch.device,
        model_impl: str = "vllm",
    ) -> None:
        self.config = config
        self.arch = arch
        self.model_impl = model_impl
        self.graph_safe = ops.graph_safe
        self._device = device
        self._token_slots = HostToDevice(max_num_tokens, torch.int32, device, fixed=True)
        self._token_slots.device.fill_(-1)
        self._clean_rows = max_num_tokens
        """Leading rows of ``token_slots`` known to be -1 (a step without adapters that
        fits them writes nothing)."""
        self.state = LoRAStepState(self._token_slots.device)
        self.targets: dict[str, LoRATarget] = lora_targets(model)
        self.layers: dict[str, LoRALinear] = {}
        modules = dict(model.named_modules())
        for target in self.targets.values():
            if target.module_name in self.layers:
                continue
            layer = modules[target.module_name]
            assert isinstance(layer, LinearBase)
            wrapper = LoRALinear(
                layer, config.max_loras, config.max_lora_rank, self.state, ops, dtype, device
            )
            layer.set_kernel(wrapper)
            self.layers[target.module_name] = wrapper
        self._host_cache: OrderedDict[AdapterKey, AdapterWeights] = OrderedDict()
        self._slot_of: OrderedDict[AdapterKey, int] = OrderedDict()
        """Adapter -> device slot, least recently used first."""
        self._free_slots = list(range(config.max_loras - 1, -1, -1))
        self._pinned: set[int] = set()
        """Adapter ids ``pin`` keeps (see the module's docstring)."""

    @property
    def slot_of(self) -> dict[AdapterKey, int]:
        return dict(self._slot_of)

    @property
    def cached_keys(self) -> list[AdapterKey]:
        """The adapters in the host cache, least recently used first."""
        return list(self._host_cache)

    def prepare_step(
        self, states: list[RequestState], query_start_loc: np.ndarray, num_tokens: int
    ) -> dict[str, str]:
        """Slots for the step's adapters and ``token_slots[:num_tokens]``; rows past the
        requests' (``query_start_loc[len(states)]``) are padding: -1. Returns request id ->
        message for the requests whose adapter could not be read (their rows are -1)."""
        wanted: dict[AdapterKey, LoRARequest] = {}
        for state in states:
            if state.lora_request is not None:
                wanted.setdefault(state.lora_request.adapter_key, state.lora_request)
        if not wanted and num_tokens <= self._clean_rows:
            self.state.groups = []
            return {}
        slots, unreadable = self._activate(wanted)
        req_slots = np.fromiter(
            (-1 if s.lora_request is None else slots[s.lora_request.adapter_key] for s in states),
            np.int64,
            len(states),
        )
        num_real = int(query_start_loc[len(states)])
        host = self._token_slots.host(num_tokens)
        host[:num_real] = np.repeat(req_slots, np.diff(query_start_loc[: len(states) + 1]))
        host[num_real:] = -1
        groups = []
        if not self.graph_safe:
            device = self.state.token_slots.device
            groups = [
                (slot, torch.from_numpy(np.flatnonzero(host[:num_tokens] == slot)).to(device))
                for slot in sorted(set(slots.values()) - {-1})
            ]
        self._token_slots.copy(num_tokens)
        self._clean_rows = 0 if wanted else num_tokens
        self.state.groups = groups
        if not unreadable:
            return {}
        return {
            s.req_id: unreadable[s.lora_request.adapter_key]
            for s in states
            if s.lora_request is not None and s.lora_request.adapter_key in unreadable
        }

    # ---- vLLM's add_lora / remove_lora / list_loras / pin_lora ----------------------

    def add(self, lora: LoRARequest) -> bool:
        """Read ``lora``'s weights into the host cache ahead of its first request (already
        there: marked recently used). True; ValueError if any rank cannot read it (then
        no rank keeps it)."""
        key = lora.adapter_key
        if key in self._host_cache:
            self._host_cache.move_to_end(key)
            return True
        _, unreadable = self._read_on_every_rank([lora])
        if unreadable:
            raise ValueError(unreadable[key])
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (under every path): host cache, device slot, pin.
        False if it was not loaded. A request still running with it reads it again at its
        next step."""
        found = False
        for key in [key for key in self._host_cache if key[0] == lora_id]:
            del self._host_cache[key]
            found = True
        for key in [key for key in self._slot_of if key[0] == lora_id]:
            self._free_slots.append(self._slot_of.pop(key))
            found = True
        self._pinned.discard(lora_id)
        return found

    def list_ids(self) -> set[int]:
        """The ids of the adapters loaded: in the host cache or a device slot."""
        return {key[0] for key in self._host_cache} | {key[0] for key in self._slot_of}

    def pin(self, lora_id: int) -> bool:
        """Keep adapter ``lora_id`` (see the module's docstring) and give it a device slot
        now, where one is free or held by an unpinned adapter. False if it is not loaded."""
        if lora_id not in self.list_ids():
            return False
        self._pinned.add(lora_id)
        for key in [key for key in self._host_cache if key[0] == lora_id]:
            if key not in self._slot_of:
                slot = self._take_slot(keep=set(), evict_pinned=False)
                if slot is None:
                    break
                self._load_into(slot, self._host_cache[key])
                self._slot_of[key] = slot
        return True

    def host_state(self) -> HostState:
        return self._host_cache, set(self._pinned)

    def adopt(self, state: HostState | None) -> None:
        """Take over another manager's host cache and pins (its device slots stay behind)."""
        if state is None:
            return
        host_cache, pinned = state
        self._host_cache = OrderedDict(host_cache)
        for lora_id in pinned:
            self.pin(lora_id)

    def _take_slot(self, keep: set[AdapterKey], evict_pinned: bool) -> int | None:
        """A free device slot, else the slot of the least recently used adapter outside
        ``keep``, unpinned first (pinned ones only if ``evict_pinned``); None if none."""
        if self._free_slots:
            return self._free_slots.pop()
        candidates = [key for key in self._slot_of if key not in keep]
        unpinned = [key for key in candidates if key[0] not in self._pinned]
        if unpinned or (candidates and evict_pinned):
            return self._slot_of.pop((unpinned or candidates)[0])
        return None

    def _activate(
        self, wanted: dict[AdapterKey, LoRARequest]
    ) -> tuple[dict[AdapterKey, int], dict[AdapterKey, str]]:
        """A device slot (-1 for none) for each wanted adapter, loading and evicting as
        needed; and the message of each that could not be read."""
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"a step uses {len(wanted)} adapters but max_loras={self.config.max_loras}; "
                "the scheduler must admit no more distinct adapters than slots"
            )
        for key in wanted:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
        needed = {key: lora for key, lora in wanted.items() if key not in self._slot_of}
        weights: dict[AdapterKey, AdapterWeights] = {}
        for key in needed:
            if key in self._host_cache:
                self._host_cache.move_to_end(key)
                weights[key] = self._host_cache[key]
        # Read first: a read that fails (files gone since the engine core's read) must not
        # cost a slot, or every later step finds one slot fewer.
        missing = [lora for key, lora in needed.items() if key not in weights]
        read, reasons = self._read_on_every_rank(missing)
        weights.update(read)
        unreadable: dict[AdapterKey, str] = {}
        for key, lora in needed.items():
            if key in reasons:
                unreadable[key] = (
                    f"LoRA adapter {lora.lora_name!r} (lora_int_id {lora.lora_int_id}) could "
                    f"not be read when its request needed it: {reasons[key]}"
                )
                logger.warning("%s", unreadable[key])
                continue
            slot = self._take_slot(keep=set(wanted), evict_pinned=True)
            assert slot is not None  # at most max_loras wanted: one is free or not wanted
            self._load_into(slot, weights[key])
            self._slot_of[key] = slot
        slots = {key: self._slot_of.get(key, -1) for key in wanted}
        return slots, unreadable

    def _read_on_every_rank(
        self, loras: list[LoRARequest]
    ) -> tuple[dict[AdapterKey, AdapterWeights], dict[AdapterKey, str]]:
        """Read ``loras`` (none in the host cache) into the host cache: their weights, and
        why each one that cannot be read failed. Each rank reads its shard itself, and an
        adapter that any rank cannot read is kept by none, every rank failing its requests
        alike (the output rank alone reports a step: a failure of another rank's own would
        leave the request running with the adapter on some ranks only, its tokens wrong).

        Ranks hold the same host cache and slots (they apply the same calls, and agree on
        every read here), so they call this at the same point with the same adapters: a
        collective exactly when ``loras`` is not empty."""
        if not loras:
            return {}, {}
        read: dict[AdapterKey, AdapterWeights] = {}
        errors: list[str | None] = []
        for lora in loras:
            try:
                read[lora.adapter_key] = load_adapter(
                    lora.lora_path, self.arch, self.config.max_lora_rank, self.model_impl
                )
                errors.append(None)
            except ValueError as error:
                errors.append(str(error) or type(error).__name__)
        every_rank = gather_from_every_rank(errors, self._device)
        reasons: dict[AdapterKey, str] = {}
        for index, lora in enumerate(loras):
            key = lora.adapter_key
            failing = [
                (rank, texts[index]) for rank, texts in enumerate(every_rank) if texts[index]
            ]
            if failing:
                rank, reason = failing[0]
                reasons[key] = reason if len(every_rank) == 1 else f"{reason} (worker rank {rank})"
                read.pop(key, None)
                continue
            logger.info("LoRA adapter %r (id %d) loaded", lora.lora_name, lora.lora_int_id)
            self._host_cache[key] = read[key]
            while len(self._host_cache) > self.config.host_cache_size:
                victim = next((k for k in self._host_cache if k[0] not in self._pinned), None)
                if victim is None or victim == key:
                    break  # the rest are pinned: the cache holds them all
                del self._host_cache[victim]
        return read, reasons

    def _load_into(self, slot: int, weights: AdapterWeights) -> None:
        for layer in self.layers.values():
            layer.clear(slot)
        for module, (lora_a, lora_b) in weights.modules.items():
            target = self.targets.get(module)
            if target is None:
                if self._on_this_stage(module):
                    raise ValueError(
                        f"LoRA module {module!r} has no layer in {self.arch.architecture} to "
                        "apply to; this architecture's layers do not take that adapter."
                    )
                continue  # a layer of another pipeline stage
            self.layers[target.module_name].write_module(slot, target.slices, lora_a, lora_b)

    def _on_this_stage(self, module: str) -> bool:
        layer = layer_index(module)
        start, end = this_stage_layers(self.arch.num_hidden_layers)
        return layer is None or start <= layer < end


def make_lora(
    config: EngineConfig, platform: Platform, model: torch.nn.Module
) -> LoRAManager | NoLoRA:
    """The model runner's LoRA component; call after ``platform.prepare_model`` (the
    wrappers wrap the kernels it installed)."""
    if config.lora is None:
        return NoLoRA()
    return LoRAManager(
        config.lora,
        config.model.arch,
        model,
        config.scheduler.max_num_batched_tokens,
        platform.lora_ops(),
        config.model.dtype,
        platform.device,
        config.model.model_impl,
    )
