"""Batch-invariant mode on CPU: the same 32 requests alone, in a batch of 256 and with
chunked prefill give bitwise-identical logprobs (and the mode is what makes them so)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedlm import LLM, SamplingParams
from pagedlm.batch_invariant import RowTiledLinear, batch_invariant_from_env, make_batch_invariant
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.layers.moe import FusedMoE
from tiny_checkpoints import save_random_model

NUM_REQUESTS = 32
BATCH = 256


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 30, (count,), generator=generator).tolist()
    return [torch.randint(0, 320, (n,), generator=generator).tolist() for n in lens]


PROMPTS = _prompts(NUM_REQUESTS, 3)
FILLER = _prompts(BATCH - NUM_REQUESTS, 4)
# Half greedy, half seeded random: the sampled token too must not depend on the batch.
PARAMS = [
    SamplingParams(
        max_tokens=6, temperature=0 if i % 2 else 0.8, seed=i, logprobs=3, ignore_eos=True
    )
    for i in range(NUM_REQUESTS)
]
FILLER_PARAMS = [
    SamplingParams(max_tokens=6, temperature=0.8, seed=100 + i, ignore_eos=True)
    for i in range(BATCH - NUM_REQUESTS)
]


def _results(llm: LLM, prompts, params) -> list[list[tuple[int, list[tuple[int, float]]]]]:
    """Per request: (sampled token, sorted (token, logprob) of its top-3) per step."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        [
            (out.outputs[0].token_ids[step], sorted((t, lp.logprob) for t, lp in top.items()))
            for step, top in enumerate(out.outputs[0].logprobs or [])
        ]
        for out in outs
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bi-llama")
    save_random_model(path, "LlamaConfig", {})
    return str(path)


def _llm(checkpoint: str, batch_invariant: bool, **kwargs) -> LLM:
    return LLM(
        model=checkpoint,
        skip_tokenizer_init=True,
        max_model_len=128,
        enable_prefix_caching=False,
        num_kv_blocks=2048,
        batch_invariant=batch_invariant,
        **kwargs,
    )


def test_alone_batched_and_chunked_agree_bitwise(checkpoint):
    big = _llm(checkpoint, True, max_num_seqs=BATCH, max_num_batched_tokens=8192)
    alone = [_results(big, [p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]
    assert all(len(r) == 6 for r in alone)
    batched = _results(big, PROMPTS + FILLER, PARAMS + FILLER_PARAMS)[:NUM_REQUESTS]
    assert batched == alone
    # 16-token steps: prompts split over chunks, mixed with other requests' decodes.
    small = _llm(checkpoint, True, max_num_seqs=64, max_num_batched_tokens=16)
    chunked = _results(small, PROMPTS + FILLER[:32], PARAMS + FILLER_PARAMS[:32])[:NUM_REQUESTS]
    assert chunked == alone


def test_without_the_mode_chunking_changes_bits(checkpoint):
    """The check above is not vacuous: the default path's reductions follow the chunks."""
    count = 8
    big = _llm(checkpoint, False, max_num_seqs=BATCH, max_num_batched_tokens=8192)
    alone = [_results(big, [p], [sp])[0] for p, sp in zip(PROMPTS[:count], PARAMS)]
    small = _llm(checkpoint, False, max_num_seqs=64, max_num_batched_tokens=16)
    chunked = _results(small, PROMPTS[:count] + FILLER[:8], PARAMS[:count] + FILLER_PARAMS[:8])
    assert chunked[:count] != alone


class _ShapeRecorder:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert x.is_contiguous()
        self.shapes.append(tuple(x.shape))
        return F.linear(x, self.weight)


def test_row_tiled_linear_feeds_fixed_tiles():
    layer = LinearBase()
    layer.weight = torch.nn.Parameter(torch.randn(24, 40), requires_grad=False)
    inner = _ShapeRecorder(layer.weight)
    layer.set_kernel(inner)
    tiled = RowTiledLinear(layer, tile=16)
    x = torch.randn(37, 40)
    out = tiled(x)
    assert out.shape == (37, 24)
    assert inner.shapes == [(16, 40)] * 3
    torch.testing.assert_close(out, F.linear(x, layer.weight))
    assert torch.equal(tiled(x.view(37, 1, 40)).view(37, 24), out)
    # A row's bits do not depend on the other rows of its call.
    for rows in (1, 5, 16, 17, 37):
        assert torch.equal(tiled(x[:rows]), out[:rows])


def test_vllm_environment_switch(monkeypatch):
    monkeypatch.delenv("PAGEDLM_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert not batch_invariant_from_env()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert batch_invariant_from_env()


def _experts_layer(hidden: int, intermediate: int) -> FusedMoE:
    moe = FusedMoE(8, 2, hidden, intermediate, renormalize=True)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / hidden**0.5)
    return moe


def test_moe_experts_in_row_tiles_do_not_depend_on_the_batch():
    """An expert's GEMM gets as many rows as chose it; in the mode, fixed tiles of them."""
    moe = _experts_layer(1024, 256)
    x = torch.randn(300, 1024, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = moe(x)
        # Not vacuous: MKL sums a lone row (its GEMV path) otherwise than 300 rows.
        assert any(not torch.equal(moe(x[i : i + 1]), whole[i : i + 1]) for i in range(8))
        assert make_batch_invariant(moe, tile=16) == 2  # the layer and its router
        tiled = moe(x)
        torch.testing.assert_close(tiled, whole)
        for rows in (slice(0, 1), slice(3, 4), slice(10, 15), slice(250, 300)):
            assert torch.equal(moe(x[rows]), tiled[rows])
