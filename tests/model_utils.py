"""Run a pagedlm model on whole sequences, outside the engine, for logit comparisons."""

from __future__ import annotations

import math

import torch

from pagedlm.attention import BatchLayout
from pagedlm.kv_cache.interface import TensorKVCache
from pagedlm.model_executor.forward_context import ForwardContext


@torch.inference_mode()
def full_logits(model, arch, backend, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [len(token_ids), vocab] for one sequence, prefilled in one step."""
    n = len(token_ids)
    num_blocks = math.ceil(n / block_size)
    cache = TensorKVCache(
        backend.kv_cache_shape(num_blocks, block_size, arch.num_key_value_heads, arch.head_dim),
        arch.num_hidden_layers,
        block_size,
        next(model.parameters()).dtype,
        lambda shape, dtype: torch.zeros(shape, dtype=dtype),
    )
    layout = BatchLayout(
        query_start_loc=[0, n],
        seq_lens=[n],
        block_tables=[list(range(num_blocks))],
        slot_mapping=list(range(n)),
        block_size=block_size,
    )
    ctx = ForwardContext(backend, backend.build_metadata(layout), cache)
    hidden = model(torch.tensor(token_ids), torch.arange(n), ctx)
    return model.compute_logits(hidden)
