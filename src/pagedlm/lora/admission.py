"""The engine core's side of LoRA: the workers read an adapter before the first request
that names it enters the scheduler.

The front end checks an adapter's config and safetensors header; its tensors are read by
the workers. Read at the first step that needs them, an adapter that cannot be read (files
deleted or damaged since the check, an engine core fed without a front end) failed that
whole step, the requests beside it included. Read here, it fails its own request with a
``ValueError`` (a 400 on a server) before the request holds any block.

An adapter is its ``adapter_key`` (id, path), as on the workers. Each is read once: a later
read (the workers dropped it from their host cache) happens at a step, where an adapter
that cannot be read fails only the requests that name it (``LoRAManager.prepare_step``).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedlm.lora.request import LoRARequest


class AdapterAdmission:
    """``read``: has every worker read an adapter into its host cache (``add_lora``),
    raising ValueError if one cannot."""

    def __init__(self, read: Callable[[LoRARequest], bool]) -> None:
        self._read = read
        self._read_once: set[tuple[int, str]] = set()
        """Adapters the workers have read since their id was last removed."""

    def admit(self, lora: LoRARequest | None) -> None:
        """Before ``lora``'s request enters the scheduler: the workers read the adapter
        unless they have read it before; ValueError (the request is refused) if they
        cannot."""
        if lora is not None and lora.adapter_key not in self._read_once:
            self.add(lora)

    def add(self, lora: LoRARequest) -> bool:
        """vLLM's ``add_lora``: the workers read (or touch) the adapter."""
        added = self._read(lora)
        self._read_once.add(lora.adapter_key)
        return added

    def remove(self, lora_id: int) -> None:
        """``remove_lora``: the workers forgot every adapter under ``lora_id``."""
        self._read_once = {key for key in self._read_once if key[0] != lora_id}
