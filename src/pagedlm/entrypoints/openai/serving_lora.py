"""LoRA adapters over HTTP: ``--lora-modules``, adapters as ``model`` names, and loading
and unloading at run time (vLLM's routes, bodies, messages and status codes).

A request whose ``model`` is an adapter's name runs with that adapter; ``/v1/models`` lists
each adapter with its ``parent`` (the served model) and its path as ``root``. Loading
checks the adapter against the model (a 400 naming the problem); the worker reads the
weights with the first request that uses it. Every load gets a fresh adapter id, so a name
unloaded and loaded again never finds the old weights in a cache.

``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` answer 404 unless the server
runs with ``--enable-lora`` and runtime updating (``--allow-runtime-lora-updating``, or
vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any

from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.request_body import RequestModel
from pagedlm.lora.peft_format import NOT_FOUND
from pagedlm.lora.request import LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = ""
    lora_int_id: int | None = None


def add_lora_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve, as name=path or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (needs --enable-lora).',
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true"),
        help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs "
        f"--enable-lora; also ${RUNTIME_UPDATING_ENV}=true).",
    )


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """(name, path, base_model_name) of one ``--lora-modules`` entry."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return spec["name"], spec["path"], spec.get("base_model_name")
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                f"--lora-modules {text!r}: JSON entries need 'name' and 'path'."
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: use name=path.")
    return name, path, None


@dataclass
class LoRARegistry:
    """The adapters a server serves, by name. ``enabled``: the engine runs with
    ``enable_lora``; ``runtime_updating``: the load/unload routes are on."""

    base_model_name: str = ""
    enabled: bool = False
    runtime_updating: bool = False
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.adapters.get(name)

    async def load(self, engine: Any, name: str, path: str, base: str | None = None) -> LoRARequest:
        """Check the adapter with the engine and serve it under ``name`` (APIError 400)."""
        if not name or not path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.adapters:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        lora = LoRARequest(name, next(self._ids), path, base or self.base_model_name)
        try:
            await engine.add_lora(lora)
        except ValueError as error:
            # vLLM's statuses: nothing at the path is a 404, a bad adapter a 400.
            status = 404 if NOT_FOUND in str(error) else 400
            raise APIError(str(error), status=status, param="lora_path") from None
        self.adapters[name] = lora
        return lora

    def unload(self, name: str, lora_int_id: int | None = None) -> LoRARequest:
        """Forget ``name``; the adapter it named (which the engine may now drop too)."""
        if not name and lora_int_id is None:
            raise APIError("either 'lora_name' and 'lora_int_id' needs to be provided.")
        lora = self.adapters.get(name)
        if lora is None or lora_int_id not in (None, lora.lora_int_id):
            raise APIError(
                f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name"
            )
        del self.adapters[name]
        return lora

    def require_runtime_updating(self) -> None:
        if not (self.enabled and self.runtime_updating):
            raise APIError(
                "Loading and unloading LoRA adapters at run time is off; start the server "
                "with --enable-lora --allow-runtime-lora-updating.",
                status=404,
            )

    def model_cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagedlm",
                "root": lora.lora_path,
                "parent": lora.base_model_name,
                "max_model_len": max_model_len,
            }
            for name, lora in self.adapters.items()
        ]


async def registry_from_args(args: argparse.Namespace, engine: Any, base_name: str) -> LoRARegistry:
    """The registry with ``--lora-modules`` loaded; a bad entry is a ValueError (entries
    without ``--enable-lora`` were refused before the model loaded: ``check_serving_args``)."""
    enabled = getattr(engine.config, "lora", None) is not None
    registry = LoRARegistry(base_name, enabled, bool(args.allow_runtime_lora_updating))
    for text in args.lora_modules or ():
        name, path, base = parse_lora_module(text)
        try:
            await registry.load(engine, name, path, base)
        except APIError as error:
            raise ValueError(f"--lora-modules {text!r}: {error.message}") from None
    return registry
