"""Run a pagedlm model on whole sequences, outside the engine, for logit comparisons."""

from __future__ import annotations

import math

import torch

from pagedlm.attention import BatchLayout
from pagedlm.kv_cache.interface import TensorKVCache
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import model_kv_geometry


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
    layout = BatchLayout.from_lists(
        query_start_loc=[0, n],
        seq_lens=[n],
        block_tables=[list(range(num_blocks))],
        slot_mapping=list(range(n)),
        block_size=block_size,
    )
    ctx = ForwardContext(backend, backend.build_metadata(layout), cache)
    hidden = model(torch.tensor(token_ids), torch.arange(n), ctx)
    return model.compute_logits(hidden)


class PagedRunner:
    """Drives a model step by step as the model runner does, one block table per request,
    through ``backend`` (the CPU one by default) with the model and KV cache on ``device``;
    the cache holds the model's dtype.

    Request ``r`` owns blocks ``r, r + R, r + 2R, ...`` for ``R`` requests: interleaved, so a
    request reading another's block table shows up as wrong logits.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_requests: int,
        max_len: int,
        block_size: int,
        backend=None,
        device: torch.device | str = "cpu",
    ) -> None:
        from pagedlm_cpu.attention import CpuSdpaBackend

        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.backend = backend or CpuSdpaBackend(self.device)
        blocks_per_request = math.ceil(max_len / block_size)
        self.tables = [
            [r + i * num_requests for i in range(blocks_per_request)] for r in range(num_requests)
        ]
        arch = model.arch
        geometry = model_kv_geometry(model, arch.num_key_value_heads, arch.head_dim)
        self.kv_cache = TensorKVCache(
            self.backend.kv_cache_shape(
                num_requests * blocks_per_request,
                block_size,
                geometry.num_kv_heads,
                geometry.head_dim,
            ),
            arch.num_hidden_layers,
            block_size,
            next(model.parameters()).dtype,
            lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=self.device),
            shares_values=geometry.shares_values,
        )

    def step(self, chunks: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
        """chunks: (request, context_len, token ids) -> per chunk float32 logits [n, vocab]
        on the CPU."""
        bs = self.block_size
        input_ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for req, context_len, tokens in chunks:
            table = self.tables[req]
            for pos in range(context_len, context_len + len(tokens)):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            input_ids += tokens
            starts.append(len(input_ids))
            seq_lens.append(context_len + len(tokens))
            tables.append(table)
        layout = BatchLayout.from_lists(starts, seq_lens, tables, slots, bs, self.device)
        ctx = ForwardContext(self.backend, self.backend.build_metadata(layout), self.kv_cache)
        with torch.no_grad():
            ids = torch.tensor(input_ids, device=self.device)
            hidden = self.model(ids, torch.tensor(positions, device=self.device), ctx)
            logits = self.model.compute_logits(hidden).float().cpu()
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]

    def chunk_then_decodes(
        self, prompts: list[list[int]], num_decodes: int = 3
    ) -> list[torch.Tensor]:
        """Request ``i`` runs ``prompts[i]``: all but its last ``num_decodes`` tokens (at least
        its first) in one batched step, then those tokens one per step, every request batched
        in each. Per prompt float32 logits [len(prompt), vocab], as one prefill would give."""
        split = [max(1, len(p) - num_decodes) for p in prompts]
        got = self.step([(i, 0, p[: split[i]]) for i, p in enumerate(prompts)])
        for offset in range(num_decodes):
            chunks = [
                (i, split[i] + offset, [p[split[i] + offset]])
                for i, p in enumerate(prompts)
                if split[i] + offset < len(p)
            ]
            if not chunks:
                break
            for (i, _, _), logits in zip(chunks, self.step(chunks), strict=True):
                got[i] = torch.cat([got[i], logits])
        return got
