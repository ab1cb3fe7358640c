"""A worker's paged KV cache as whole blocks, in one layout for every attention backend.

Connectors move blocks as ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``
tensors in the cache's dtype, whatever the backend's own layout: the views come from
``AttentionBackend.kv_block_view``. Reads are copies (the cache may be overwritten by later
steps); writes go through the views into the cache, queued on the device's stream like the
step's kernels, so the next forward sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedlm.attention import AttentionBackend
from pagedlm.kv_cache.interface import KVCache


class KVCacheBlocks:
    """Block views of the layers one worker holds.

    Invariants: ``layers`` lists this worker's global layer indices in order, and the views
    of layer ``layers[i]`` are ``keys[i]`` / ``values[i]``, each ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` over the cache's own memory. ``pin_host_memory`` is the
    platform's answer to whether host buffers that blocks are copied through should be
    pinned (only where the device reads pinned memory); ``empty_host`` allocates them.
    ``shares_values``: every layer's keys are its values (a latent cache, one tensor per
    layer): ``values`` is ``keys``, and reads and writes touch the tensor once."""

    def __init__(
        self,
        cache: KVCache,
        backend_cls: type[AttentionBackend],
        layers: Sequence[int],
        num_kv_heads: int,
        head_dim: int,
        pin_host_memory: bool = False,
        empty_host: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.layers = list(layers)
        self.pin_host_memory = pin_host_memory
        self.empty_host = empty_host or (
            lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pin_host_memory)
        )
        """Allocates host buffers blocks are copied through (``Platform.empty_host``)."""
        self.block_size = cache.block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        caches = [cache.layer(layer) for layer in self.layers]
        self.shares_values = all(key is value for key, value in caches)
        for key_cache, value_cache in caches:
            args = (self.block_size, num_kv_heads, head_dim)
            self.keys.append(backend_cls.kv_block_view(key_cache, *args))
            if not self.shares_values:
                self.values.append(backend_cls.kv_block_view(value_cache, *args))
        if self.shares_values:
            self.values = self.keys
        self.dtype = self.keys[0].dtype
        self.device = self.keys[0].device

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """One block of every layer: ``[num_layers, block_size, num_kv_heads, head_dim]``."""
        return (len(self.layers), self.block_size, self.num_kv_heads, self.head_dim)

    def read(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the blocks' keys and values, each ``[num_layers, len(block_ids),
        block_size, num_kv_heads, head_dim]``, on the cache's device."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        keys = torch.stack([view.index_select(0, index) for view in self.keys])
        if self.shares_values:
            return keys, keys
        values = torch.stack([view.index_select(0, index) for view in self.values])
        return keys, values

    def write(self, block_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` (``read``'s shapes, any device) into the blocks."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        keys = keys.to(self.device, self.dtype)
        values = values.to(self.device, self.dtype)
        for layer, (key_view, value_view) in enumerate(zip(self.keys, self.values, strict=True)):
            as_bits(key_view).index_copy_(0, index, as_bits(keys[layer]))
            if not self.shares_values:
                as_bits(value_view).index_copy_(0, index, as_bits(values[layer]))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's width: a copy moves bits, and works for
    dtypes whose copy kernels a device lacks (float8 on CPU)."""
    return tensor.view(_BITS[tensor.element_size()])
