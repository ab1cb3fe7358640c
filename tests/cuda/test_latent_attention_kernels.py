"""The latent attention kernels (DeepSeek's MLA over a latent paged cache) against a float64
reference, through ``TritonAttentionBackend.forward`` and the kernel launcher.

On CPU these run under ``TRITON_INTERPRET=1`` at tiny shapes (head_dim 40 = value 32 +
tail 8, and 24 = 16 + 8); the ``cuda`` cases add DeepSeek's 576 = 512 + 64 at 16 and 128
heads over long contexts. Every case scatters each request's blocks randomly over the
cache, poisons the slots of the step's new keys with NaN (they must be written before they
are read) and checks the cache afterwards: the new keys at their slots, nothing else
touched (padding rows, slot -1, write nothing).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from triton_env import DEVICE, ON_GPU, rel_error, tolerance

from pagedlm.attention.backend import BatchLayout
from pagedlm.kv_cache import fp8
from pagedlm_cuda.attention import TritonAttentionBackend
from pagedlm_cuda.kernels.latent_attention import (
    LatentConfig,
    paged_latent_attention,
    write_latent_cache,
)

cuda_only = pytest.mark.skipif(not ON_GPU, reason="DeepSeek's sizes need a GPU")


class Step:
    """One step over a latent cache: its layout (``padding`` graph-style padding rows of
    ``padding_len`` tokens each at the end), inputs and the cache it must leave."""

    def __init__(
        self, chunks, num_heads, head_dim, value_dim, dtype, block_size=16, padding=0,
        padding_len=1, seed=0, cache_dtype=None,
    ):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        blocks = [-(-(q + c) // block_size) for q, c in chunks]
        num_blocks = sum(blocks) + 2
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        qsl, seq_lens, tables, slots = [0], [], [], []
        for (q_len, ctx), n in zip(chunks, blocks):
            table, ids = ids[:n], ids[n:]
            qsl.append(qsl[-1] + q_len)
            seq_lens.append(q_len + ctx)
            tables.append(table + [ids[0]])  # a spare column, like reserved blocks
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in range(ctx, ctx + q_len)]  # fmt: skip
        for _ in range(padding):
            qsl.append(qsl[-1] + padding_len)
            seq_lens.append(0)
            tables.append([0])
            slots += [-1] * padding_len
        self.layout = BatchLayout.from_lists(qsl, seq_lens, tables, slots, block_size, DEVICE)
        self.chunks, self.tables, self.value_dim = chunks, tables, value_dim
        self.num_real = qsl[len(chunks)]
        self.scale = head_dim**-0.5
        num_tokens = qsl[-1]
        self.query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
        self.key = torch.randn(num_tokens, 1, head_dim, generator=gen).to(dtype)
        shape = TritonAttentionBackend.kv_cache_shape(num_blocks, block_size, 1, head_dim)
        cache = torch.randn(shape, generator=gen)
        self.k_scale = None
        if cache_dtype == fp8.FP8_DTYPE:
            self.k_scale = torch.tensor([0.02], device=DEVICE)
            self.expected_cache = fp8.quantize(cache * 3, self.k_scale.cpu())
            new = fp8.quantize(self.key[: self.num_real].float(), self.k_scale.cpu())
            self.cache = self.expected_cache.clone()
        else:
            self.expected_cache = cache.to(dtype)
            new = self.key[: self.num_real]
            self.cache = self.expected_cache.clone()
            self.cache.view(-1, head_dim)[slots[: self.num_real]] = float("nan")
        self.expected_cache.view(-1, head_dim)[slots[: self.num_real]] = new[:, 0]
        self.query, self.key, self.cache = (
            t.to(DEVICE) for t in (self.query, self.key, self.cache)
        )

    def reference(self) -> torch.Tensor:
        """float64 latent attention over the expected cache (scaled back from FP8): each
        row sees its request's keys up to its own position; padding rows give zeros."""
        keys_all = self.expected_cache.float().double()[:, 0]  # [blocks, block_size, D]
        if self.k_scale is not None:
            keys_all = keys_all * self.k_scale.item()
        q64 = self.query.double().cpu()
        out = torch.zeros(q64.shape[0], q64.shape[1], self.value_dim, dtype=torch.float64)
        row = 0
        for (q_len, ctx), table in zip(self.chunks, self.tables):
            keys = keys_all[table].reshape(-1, keys_all.shape[-1])[: q_len + ctx]
            scores = torch.einsum("qhd,sd->hqs", q64[row : row + q_len], keys) * self.scale
            hidden = torch.arange(q_len + ctx)[None, :] > torch.arange(ctx, ctx + q_len)[:, None]
            probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
            out[row : row + q_len] = torch.einsum("hqs,sd->qhd", probs, keys[:, : self.value_dim])
            row += q_len
        return out

    def check(self, out: torch.Tensor, dtype: torch.dtype) -> None:
        assert out.shape == (self.query.shape[0], self.query.shape[1], self.value_dim)
        assert out.dtype == self.query.dtype
        error = rel_error(out[: self.num_real], self.reference()[: self.num_real])
        assert error < (0.05 if self.k_scale is not None else tolerance(dtype)), error
        assert torch.equal(out[self.num_real :].cpu(), torch.zeros_like(out[self.num_real :].cpu()))
        stored, expected = self.cache.cpu(), self.expected_cache
        if stored.dtype == fp8.FP8_DTYPE:
            stored, expected = stored.view(torch.uint8), expected.view(torch.uint8)
        assert torch.equal(stored, expected)


def run_backend(step: Step) -> torch.Tensor:
    backend = TritonAttentionBackend(DEVICE)
    scales = {} if step.k_scale is None else {"k_scale": step.k_scale, "v_scale": step.k_scale}
    return backend.forward(
        step.query, step.key, step.key, step.cache, step.cache,
        backend.build_metadata(step.layout), step.scale, value_dim=step.value_dim, **scales,
    )  # fmt: skip


def run_kernel(step: Step, config: LatentConfig, fused_write: bool) -> torch.Tensor:
    layout = step.layout
    write = {"new_key": step.key, "slot_mapping": layout.slot_mapping}
    if not fused_write:
        write_latent_cache(step.key, step.cache, layout.slot_mapping, step.k_scale)
        write = {}
    return paged_latent_attention(
        step.query, step.cache, layout.block_table, layout.seq_lens, layout.query_start_loc,
        step.scale, step.value_dim, layout.max_query_len, k_scale=step.k_scale, config=config,
        **write,
    )  # fmt: skip


DTYPES = [torch.float32, torch.bfloat16]
DECODE = [(1, 0), (1, 16), (1, 39), (1, 70)]
VERIFY = [(3, 20), (5, 33), (2, 0)]
PREFILL = [(20, 13), (9, 0), (40, 25)]
MIXED = [(1, 30), (12, 5), (1, 0), (3, 17)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "chunks", [DECODE, VERIFY, PREFILL, MIXED], ids=["decode", "verify", "prefill", "mixed"]
)
def test_backend_latent_steps(chunks, dtype) -> None:
    """Decode (the kernel writes the new keys itself, split over 32 ranges), verification
    (split, rows of several tokens), prefill with cached context and a mixed batch (the
    flash configuration), at 4 heads of 40 = 32 + 8 features."""
    step = Step(chunks, num_heads=4, head_dim=40, value_dim=32, dtype=dtype, seed=len(chunks))
    step.check(run_backend(step), dtype)


@pytest.mark.parametrize(
    "chunks, padding_len", [(DECODE[1:3], 1), (VERIFY[:2], 5)], ids=["decode", "verify"]
)
def test_backend_padding_rows(chunks, padding_len) -> None:
    """A replayed graph's padding rows (seq_len 0, slot -1): zeros, nothing written."""
    step = Step(chunks, 4, 40, 32, torch.float32, padding=3, padding_len=padding_len, seed=5)
    step.check(run_backend(step), torch.float32)


@pytest.mark.parametrize(
    "num_heads, chunks", [(2, DECODE), (20, DECODE[1:]), (3, VERIFY), (5, PREFILL[:2])]
)
def test_backend_other_heads(num_heads, chunks) -> None:
    """24 = 16 + 8 features; head counts under a head block, past it (20: a second block
    of 4) and not powers of two."""
    step = Step(chunks, num_heads, 24, 16, torch.float32, block_size=8, seed=num_heads)
    step.check(run_backend(step), torch.float32)


@pytest.mark.parametrize(
    "config, chunks, fused_write",
    [
        (LatentConfig(4, 4, 16, 1, 4, 2), DECODE, True),  # one split: stored directly
        (LatentConfig(4, 4, 16, 2, 4, 2), DECODE, True),  # the new key in the last split
        (LatentConfig(4, 4, 16, 8, 4, 2), DECODE, False),  # keys written first
        (LatentConfig(1, 16, 16, 4, 4, 2), VERIFY, False),  # one token per tile, 4 splits
        # Split 1 of (5, 14) is keys 16 .. 18: the tile's rows at 14 and 15 see none there.
        (LatentConfig(4, 4, 16, 4, 4, 2), [(5, 14), (2, 40)], False),
        (LatentConfig(2, 8, 32, 2, 4, 2), MIXED[:1] + MIXED[2:], False),
        (LatentConfig(16, 1, 16, 1, 4, 2), PREFILL, False),  # prefill rows of 16
    ],
)
def test_kernel_configurations(config, chunks, fused_write) -> None:
    """Split counts, tiles and row shapes other than the ones the backend picks here."""
    step = Step(chunks, 4, 40, 32, torch.float32, seed=config.num_splits)
    step.check(run_kernel(step, config, fused_write), torch.float32)


@pytest.mark.parametrize("chunks", [DECODE, MIXED], ids=["decode", "mixed"])
def test_backend_fp8_cache(chunks) -> None:
    """An FP8 cache: new keys quantized on write (by the decode kernel, or the write
    kernel), tiles dequantized in registers."""
    step = Step(chunks, 4, 40, 32, torch.float32, seed=9, cache_dtype=fp8.FP8_DTYPE)
    if ON_GPU:
        step.query = step.query.to(torch.bfloat16)
    step.check(run_backend(step), step.query.dtype)


def test_backend_refuses_what_latent_layers_never_ask_for() -> None:
    step = Step(DECODE[:2], 4, 40, 32, torch.float32)
    backend = TritonAttentionBackend(DEVICE)
    metadata = backend.build_metadata(step.layout)
    args = (step.query, step.key, step.key, step.cache, step.cache, metadata, step.scale)
    with pytest.raises(ValueError, match="sliding_window, logits_soft_cap"):
        backend.forward(*args, value_dim=32, sliding_window=8, logits_soft_cap=3.0)
    with pytest.raises(ValueError, match="value=key"):
        backend.forward(*args[:2], step.key.clone(), *args[3:], value_dim=32)
    assert step.cache.isnan().any()  # nothing ran: the new keys' slots are still poisoned


DEEPSEEK = [
    ([(1, 0), (1, 700), (1, 2048), (1, 4099)], 16),
    ([(1, 3000)], 128),  # batch 1, many splits
    ([(1, 100 + 37 * i) for i in range(48)], 16),  # bucket 48
    ([(4, 1100), (2, 5), (4, 3000)], 16),  # verification
    ([(4, 1100), (4, 60)], 128),
    ([(300, 700), (1, 2000), (64, 0), (1000, 0)], 16),  # prefill, mixed
    ([(130, 900), (1, 50)], 128),
]


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("chunks, num_heads", DEEPSEEK)
def test_deepseek_shapes(chunks, num_heads) -> None:
    """DeepSeek's 576 = 512 + 64 features, bf16, at V2-Lite's 16 heads and V3's 128."""
    step = Step(chunks, num_heads, 576, 512, torch.bfloat16, seed=num_heads + len(chunks))
    step.check(run_backend(step), torch.bfloat16)


@pytest.mark.cuda
@cuda_only
def test_deepseek_fp8_decode_with_padding() -> None:
    step = Step(DEEPSEEK[0][0], 16, 576, 512, torch.bfloat16, padding=4,
                cache_dtype=fp8.FP8_DTYPE)  # fmt: skip
    step.check(run_backend(step), torch.bfloat16)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("query_len", [1, 4])
def test_deepseek_graph_replay(query_len) -> None:
    """A uniform step captured over padding rows only (nothing written, max_seq_len a
    bound), then replayed with real rows in the same buffers: the kernels read lengths,
    tables and slots on the device at replay."""
    chunks = [(query_len, 100), (query_len, 1000), (query_len, 3000)]
    step = Step(chunks, 16, 576, 512, torch.bfloat16, padding=2, padding_len=query_len, seed=3)
    layout = step.layout
    real_seq_lens, real_slots = layout.seq_lens.clone(), layout.slot_mapping.clone()
    layout.seq_lens.zero_()
    layout.slot_mapping.fill_(-1)
    backend = TritonAttentionBackend(DEVICE)
    assert backend.supports_graph(query_len)
    metadata = backend.build_graph_metadata(dataclasses.replace(layout, max_seq_len=8192))

    def forward() -> torch.Tensor:
        return backend.forward(
            step.query, step.key, step.key, step.cache, step.cache, metadata, step.scale,
            value_dim=512,
        )  # fmt: skip

    forward()  # compiles the kernels outside the capture; padding rows write nothing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    layout.seq_lens.copy_(real_seq_lens)
    layout.slot_mapping.copy_(real_slots)
    graph.replay()
    torch.cuda.synchronize()
    step.check(out, torch.bfloat16)
