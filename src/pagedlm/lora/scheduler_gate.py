"""The scheduler's side of LoRA: no more distinct adapters running than device slots.

The running requests' adapters are at most ``max_loras`` distinct adapters, each its
``adapter_key`` (id, path) as on the workers, so every step (a subset of the running
requests) finds a slot for each of its adapters. A waiting request
whose adapter would be one too many is skipped, and requests behind it may start (vLLM
does the same); it starts once a running adapter's requests have all finished.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pagedlm.core.request import Request


class LoRAGate:
    """``max_loras``: the device slots; None: LoRA is off (every request is admitted)."""

    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras

    def active(self, running: Iterable[Request]) -> set[tuple[int, str]]:
        """The adapters of ``running`` (empty when LoRA is off)."""
        if self.max_loras is None:
            return set()
        return {r.lora_request.adapter_key for r in running if r.lora_request is not None}

    def admits(self, request: Request, active: set[tuple[int, str]]) -> bool:
        """Whether ``request`` may start next to the adapters in ``active``; if so, its
        adapter is added to ``active``."""
        lora = request.lora_request
        if lora is None or lora.adapter_key in active:
            return True
        assert self.max_loras is not None, "requests name adapters only with enable_lora"
        if len(active) >= self.max_loras:
            return False
        active.add(lora.adapter_key)
        return True

    def count_names(self, requests: Iterable[Request]) -> dict[str, int]:
        """Adapter name -> how many of ``requests`` use it (for metrics)."""
        if self.max_loras is None:
            return {}
        return dict(Counter(r.lora_request.lora_name for r in requests if r.lora_request))
