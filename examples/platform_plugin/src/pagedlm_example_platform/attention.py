"""The example attention backend: paged attention with its own KV layout, one request at a
time in plain torch (written to be read, not to be fast).

KV layout, per layer and for keys and values alike: ``[num_blocks, num_kv_heads, head_dim,
block_size]``. The slot index is innermost, so a block's keys of one head form a
``head_dim x block_size`` matrix that multiplies a query directly (``q @ K``), the way
some accelerators lay out their caches. The contract still holds: dimension 0 is the block
id, slot ``s`` is offset ``s % block_size`` of block ``s // block_size``, and a block
holds exactly ``block_size * num_kv_heads * head_dim`` values, as pagedlm's KV sizing
counts them.

Features: sliding windows are implemented (``supports_sliding_window``); logit
soft-capping is not, so the attention layer refuses models that need it (Gemma 2) with
an error naming it, instead of this backend attending wrongly. No graph capture: the
platform replays no graphs, so padding rows never reach this backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.attention import AttentionBackend, BatchLayout


@dataclass(frozen=True)
class RequestRows:
    query_start: int
    query_end: int
    seq_len: int
    block_ids: torch.Tensor
    """[ceil(seq_len / block_size)] the blocks holding positions ``0 .. seq_len-1``."""


@dataclass(frozen=True)
class ExampleMetadata:
    slot_blocks: torch.Tensor
    """[num_tokens] the block of each new token's slot."""
    slot_offsets: torch.Tensor
    """[num_tokens] its offset in that block."""
    requests: tuple[RequestRows, ...]


class ExampleAttentionBackend(AttentionBackend):
    name = "example_attention"
    supports_sliding_window = True
    supports_logits_soft_cap = False

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, head_dim, block_size)

    @classmethod
    def kv_block_view(
        cls, layer_cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int
    ) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] as a view of this layout."""
        return layer_cache.view(-1, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)

    def build_metadata(self, layout: BatchLayout) -> ExampleMetadata:
        """Host-side planning from the layout's host copies, once per step."""
        slots = layout.slot_mapping.to(self.device, torch.long)
        tables = layout.block_table.to(self.device, torch.long)
        starts, seq_lens = layout.query_start_loc_cpu, layout.seq_lens_cpu
        requests = []
        for i in range(layout.num_reqs):
            num_blocks = -(-int(seq_lens[i]) // layout.block_size)
            requests.append(
                RequestRows(
                    int(starts[i]), int(starts[i + 1]), int(seq_lens[i]), tables[i, :num_blocks]
                )
            )
        return ExampleMetadata(
            slot_blocks=slots // layout.block_size,
            slot_offsets=slots % layout.block_size,
            requests=tuple(requests),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: ExampleMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        # Write first: a request may read slots another request of this step fills.
        # Indices at dims 0 and 3 around two slices select [num_tokens, kv_heads, head_dim].
        blocks, offsets = metadata.slot_blocks, metadata.slot_offsets
        key_cache[blocks, :, :, offsets] = key.to(key_cache.dtype)
        value_cache[blocks, :, :, offsets] = value.to(value_cache.dtype)
        out = torch.empty_like(query)
        for request in metadata.requests:
            rows = slice(request.query_start, request.query_end)
            out[rows] = self._attend(
                query[rows], key_cache, value_cache, request, scale, sliding_window
            ).to(query.dtype)
        return out

    @staticmethod
    def _attend(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        request: RequestRows,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """One request's queries [Q, heads, d] over its positions, in float32."""
        num_queries, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[1]
        group = num_heads // num_kv_heads
        # [blocks, kv_heads, d, block_size] -> [kv_heads, d, blocks * block_size] -> seq_len
        keys = key_cache[request.block_ids].permute(1, 2, 0, 3).flatten(2)[..., : request.seq_len]
        values = (
            value_cache[request.block_ids].permute(1, 2, 0, 3).flatten(2)[..., : request.seq_len]
        )
        # Query head h reads kv head h // group: [kv_heads, group * Q, d].
        q = query.float().view(num_queries, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_queries, head_dim)
        scores = torch.bmm(q, keys.float()) * scale  # [kv_heads, group * Q, seq_len]
        positions = torch.arange(request.seq_len, device=query.device)
        query_positions = (
            request.seq_len - num_queries + torch.arange(num_queries, device=query.device)
        )
        visible = positions[None, :] <= query_positions[:, None]
        if sliding_window is not None:
            visible &= positions[None, :] > query_positions[:, None] - sliding_window
        scores = scores.masked_fill(~visible.repeat(group, 1), float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.bmm(probs, values.float().transpose(1, 2))  # [kv_heads, group * Q, d]
        out = out.view(num_kv_heads, group, num_queries, head_dim).permute(2, 0, 1, 3)
        return out.reshape(num_queries, num_heads, head_dim)
