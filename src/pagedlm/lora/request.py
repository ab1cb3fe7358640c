"""``LoRARequest``: which adapter a request runs with (vLLM's fields and checks).

A leaf module (standard library only): the step protocol carries it to the workers, so it
must stay plain, msgspec-serializable data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter, named for users by ``lora_name`` and for the engine by ``lora_int_id``.

    ``lora_int_id >= 1`` names one adapter at a time: the front end refuses a second path
    under a loaded id until ``remove_lora`` frees it (vLLM asks ids to be unique and does
    not check). Below the front end an adapter is its ``adapter_key``, (id, path), in the
    workers' slots and host cache, the scheduler's count of adapters per step and the
    prefix-cache keys: requests of a removed adapter still running beside those of the
    next adapter under its id each get their own weights and cached blocks. The server
    hands out a fresh id for every load.
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

    @property
    def adapter_key(self) -> tuple[int, str]:
        """What identifies the adapter's weights below the front end: (id, path)."""
        return self.lora_int_id, self.lora_path
