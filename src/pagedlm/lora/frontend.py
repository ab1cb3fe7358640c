"""The front end's check of a request's adapter, before the request enters the engine.

A bad adapter (missing path, rank above ``max_lora_rank``, a module the model lacks, the
shapes of another base model) fails its own request with a ``ValueError`` (HTTP 400) and
never reaches a worker, where loading it would fail a whole step.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedlm.config import ArchConfig, LoRAConfig
from pagedlm.lora.peft_format import PeftAdapterConfig, check_adapter
from pagedlm.lora.request import LoRARequest

_MAX_REMEMBERED = 256
"""Adapters whose checked config is remembered (a check reads a config and a safetensors
header); every id's path is remembered for good, a string each."""


class AdapterChecker:
    """``config``: the engine's LoRA settings (None: ``enable_lora`` is off)."""

    def __init__(
        self, config: LoRAConfig | None, arch: ArchConfig, model_impl: str = "vllm"
    ) -> None:
        self.config = config
        self.arch = arch
        self.model_impl = model_impl
        self._paths: dict[int, str] = {}
        """Adapter id -> the path it names, until ``forget``: an id names one adapter
        (``LoRARequest``), however many adapters came between."""
        self._checked: OrderedDict[int, tuple[str, PeftAdapterConfig]] = OrderedDict()
        """Adapter id -> (its path, its checked config), oldest first."""

    def check(self, lora_request: LoRARequest | None) -> PeftAdapterConfig | None:
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a pagedlm.lora.request.LoRARequest, got "
                f"{type(lora_request).__name__}."
            )
        if self.config is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} was requested but LoRA is not "
                "enabled; start the engine with enable_lora=True (--enable-lora)."
            )
        lora_id, path = lora_request.lora_int_id, lora_request.lora_path
        named = self._paths.get(lora_id)
        if named is not None and named != path:
            # vLLM's contract (one adapter per id), checked: logs, metrics and ``list_loras``
            # name adapters by id.
            raise ValueError(
                f"lora_int_id {lora_id} already names the adapter at {named!r}, not "
                f"{path!r}; give every adapter its own lora_int_id."
            )
        remembered = self._checked.get(lora_id)
        if remembered is None:
            remembered = (
                path,
                check_adapter(path, self.arch, self.config.max_lora_rank, self.model_impl),
            )
            self._checked[lora_id] = remembered
            self._paths[lora_id] = path
            if len(self._checked) > _MAX_REMEMBERED:
                self._checked.popitem(last=False)
        return remembered[1]

    def forget(self, lora_id: int) -> None:
        """``remove_lora``: the id may name another adapter from now on."""
        self._checked.pop(lora_id, None)
        self._paths.pop(lora_id, None)
