"""``LoRARequest``: which adapter a request runs with (vLLM's fields and checks).

A leaf module (standard library only): the step protocol carries it to the workers, so it
must stay plain, msgspec-serializable data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter, named for users by ``lora_name`` and for the engine by ``lora_int_id``.

    Invariant: ``lora_int_id >= 1`` identifies the adapter's weights everywhere (device
    slots, host cache, prefix-cache keys): two requests with the same id must mean the same
    files. The server hands out a fresh id for every load, so reloading a name never hits
    a stale cache entry.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    """A local PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    base_model_name: str | None = None
    """The model the adapter was listed under (the server's ``parent`` in /v1/models)."""

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}.")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}.")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")
        if not self.lora_path:
            raise ValueError(
                f"LoRARequest {self.lora_name!r} has no lora_path; pass the adapter's "
                "directory (adapter_config.json + adapter_model.safetensors)."
            )
