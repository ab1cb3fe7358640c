"""Device storage for keys and values, in blocks of ``block_size`` token slots."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


class KVCache(ABC):
    """Per-layer key/value storage shared by all requests.

    Invariants:
    - Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``.
    - A block id names the same slot range in every layer; the scheduler's block tables
      are therefore valid for the whole model.
    - The cache never interprets block ownership: the KV-cache manager decides which
      request may read or write which block.
    """

    num_blocks: int
    block_size: int

    @abstractmethod
    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of one layer, in the attention backend's layout."""

    @property
    @abstractmethod
    def num_bytes(self) -> int:
        """Total device memory held."""


class TensorKVCache(KVCache):
    """One key and one value tensor per layer, allocated up front; with ``shares_values``
    (latent attention, whose keys are also its values) one tensor per layer, returned as
    both."""

    def __init__(
        self,
        shape: tuple[int, ...],
        num_layers: int,
        block_size: int,
        dtype: torch.dtype,
        zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
        first_layer: int = 0,
        shares_values: bool = False,
    ) -> None:
        """``zeros(shape, dtype)`` allocates a zeroed tensor on the device (``Platform.zeros``);
        the cache holds layers ``first_layer .. first_layer + num_layers - 1`` (a pipeline
        stage's), looked up by their global index."""
        self.num_blocks = shape[0]
        self.block_size = block_size
        self.first_layer = first_layer
        self.shares_values = shares_values
        self._layers = [
            _shared(zeros(shape, dtype))
            if shares_values
            else (zeros(shape, dtype), zeros(shape, dtype))
            for _ in range(num_layers)
        ]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[layer_idx - self.first_layer]

    @property
    def num_bytes(self) -> int:
        per_layer = 1 if self.shares_values else 2
        return sum(k.numel() * k.element_size() * per_layer for k, _ in self._layers)


def _shared(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tensor, tensor


def kv_bytes_per_block(
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    shares_values: bool = False,
) -> int:
    """Bytes one block takes across all layers, keys and values together (one tensor per
    layer where ``shares_values``)."""
    element = torch.empty((), dtype=dtype).element_size()
    tensors = 1 if shares_values else 2
    return tensors * num_layers * block_size * num_kv_heads * head_dim * element
