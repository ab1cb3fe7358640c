"""What every attention layer of one forward pass needs besides its own activations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedlm.attention.backend import AttentionBackend
from pagedlm.kv_cache.interface import KVCache


@dataclass(frozen=True)
class ForwardContext:
    """One step's attention state, built once by the model runner and passed down to layers.

    Invariant: ``attn_metadata`` is what ``attn_backend.build_metadata`` returned for this
    step's batch; it is shared by all layers and never rebuilt per layer.
    """

    attn_backend: AttentionBackend
    attn_metadata: Any
    kv_cache: KVCache
    """``kv_cache.layer(i)`` gives layer ``i``'s (key_cache, value_cache)."""
