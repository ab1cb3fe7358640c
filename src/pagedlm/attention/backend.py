"""The attention backend interface.

A step's batch is flattened: all scheduled tokens of all requests concatenated. Request
``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those rows are the
tokens at positions ``context_lens[i] .. seq_lens[i]-1`` of its sequence, and its K/V for
positions ``0 .. seq_lens[i]-1`` are read from the blocks in ``block_table[i]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class BatchLayout:
    """The shape of one step's flattened batch, in host lists (built by the model runner).

    ``slot_mapping[t] = block_id * block_size + offset`` is where token ``t``'s K/V go.
    """

    query_start_loc: list[int]
    """[num_reqs + 1] offsets into the flattened tokens."""
    seq_lens: list[int]
    """[num_reqs] context length after this step (computed before + scheduled now)."""
    block_tables: list[list[int]]
    """[num_reqs][num_blocks_i] the request's block ids (at least ceil(seq_len/block_size))."""
    slot_mapping: list[int]
    """[num_tokens] cache slot of every scheduled token."""
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]

    @property
    def context_lens(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens, self.query_lens)]


AttentionMetadata = Any
"""Whatever a backend's ``build_metadata`` returns; only that backend reads it."""


class AttentionBackend(ABC):
    """Computes causal attention over the paged KV cache for one flattened batch.

    Invariants:
    - ``build_metadata`` runs once per step, never per layer.
    - ``forward`` first writes the step's new K/V into the cache at ``slot_mapping``, then
      reads. A request may therefore read blocks that another request of the same step
      fills (prefix-cache hits on blocks scheduled in that step rely on this).
    - Query row ``t`` attends to key positions ``<= its own position`` of its request only;
      with a ``sliding_window`` of ``w``, only to the ``w`` positions ``> position - w``.

    Optional features a model may ask for per layer (``forward``'s keyword arguments); a
    backend that implements one sets the matching flag, and the attention layer refuses
    to call a backend without it rather than silently attending over the wrong keys.
    """

    name: ClassVar[str]
    supports_sliding_window: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache tensor."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """Turn the step's layout into whatever ``forward`` needs (device tensors, ...)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Attention for every scheduled token.

        query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads,
        head_dim]; returns [num_tokens, num_heads, head_dim]. ``num_heads`` is a multiple
        of ``num_kv_heads`` (grouped-query attention).

        ``sliding_window``: None, or ``w`` so that the query at position ``p`` sees keys at
        positions ``p - w + 1 .. p`` only (Mistral, Gemma 2/3 local layers). All positions'
        K/V are still written; which blocks may be freed early is the KV manager's concern.
        ``logits_soft_cap``: None, or ``c`` so that scores become ``c * tanh(scores / c)``
        before the softmax (Gemma 2). Only passed when set, and only to backends whose
        ``supports_*`` flag says so.
        """
