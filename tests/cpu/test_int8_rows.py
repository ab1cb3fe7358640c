"""Int8RowsLinear: fbgemm's int8 GEMM with activations split into two exact levels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_quantized_linear import random_blocks
from torch import nn

from pagedlm.model_executor.layers.linear import ColumnParallelLinear
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm_cpu import int8_rows
from pagedlm_cpu.int8_rows import MAX_ROWS, Int8RowsLinear, fbgemm_is_exact, install_int8_rows
from pagedlm_cpu.quantized_linear import Int4Linear, install_int4_kernels, int4_kernel_available

pytestmark = pytest.mark.skipif(not fbgemm_is_exact(), reason="no exact fbgemm int8 GEMM here")


def _rounded_per_row(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as Int8RowsLinear holds it: int8 codes times one scale per row."""
    scales = weight.abs().amax(dim=1, keepdim=True) / 127
    return (weight / scales).round().clamp(-127, 127) * scales


@pytest.mark.parametrize("rows", [1, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_are_the_rounded_weights_times_x_to_float32_precision(rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=generator)
    bias = torch.randn(200, generator=generator)
    scales = weight.abs().amax(dim=1) / 127
    codes = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    layer = Int8RowsLinear(codes, scales, bias)
    # Rows of very different sizes: each is scaled to its own peak.
    x = (torch.randn(rows, 96, generator=generator) * torch.tensor([3.0, 1e-3])[:rows, None]).to(
        dtype
    )
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, 200)
    expected = F.linear(x.double(), _rounded_per_row(weight).double(), bias.double())
    # What is left is the second level's rounding, ~6e-5 of a row's peak per input value;
    # fbgemm's own 8-bit rounding of the inputs (a single level) is off by ~1e-2.
    error = (out.double() - expected).abs().amax(dim=1) / expected.abs().amax(dim=1)
    assert error.max() < (3e-4 if dtype == torch.float32 else 8e-3), error
    if dtype == torch.float32:
        assert error.max() > 0  # the levels really rounded something


def test_more_rows_than_it_serves_are_refused():
    layer = Int8RowsLinear(torch.ones(16, 32, dtype=torch.int8), torch.ones(16), None)
    with pytest.raises(ValueError, match="at most"):
        layer(torch.randn(MAX_ROWS + 1, 32))


def test_from_blocks_rounds_each_row_of_the_blocks_in_chunks(monkeypatch):
    blocks = random_blocks(80, 64, 8)
    whole = Int8RowsLinear.from_blocks(blocks, None)
    monkeypatch.setattr(int8_rows, "_CHUNK_ROWS", 24)  # 80 rows: 24, 24, 24, 8
    chunked = Int8RowsLinear.from_blocks(blocks, None)
    x = torch.randn(2, 64)
    assert torch.equal(whole(x), chunked(x))
    expected = F.linear(x.double(), _rounded_per_row(blocks.dequantize()).double())
    torch.testing.assert_close(chunked(x).double(), expected, rtol=0, atol=2e-4)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(64, 64)
        self.up = ColumnParallelLinear(64, 96, bias=False)
        self.head = ParallelLMHead(64, 64)
        self.head.tie_to(self.embed)


@pytest.mark.skipif(not int4_kernel_available(), reason="no CPU int4 kernel")
def test_install_gives_a_two_plane_lm_head_its_fewest_rows_only():
    model = Tiny()
    blocks = {"up": random_blocks(96, 64, 8), "head": random_blocks(64, 64, 8)}
    assert install_int4_kernels(model, blocks) == 2
    x = torch.randn(MAX_ROWS + 1, 64)
    int4_head = model.head(x)
    # The LM head only: the two-plane "up" layer keeps its planes.
    assert install_int8_rows(model) == 1
    expected = F.linear(x[:MAX_ROWS], blocks["head"].dequantize())
    few = model.head(x[:MAX_ROWS])
    assert not torch.equal(few, int4_head[:MAX_ROWS])  # a different kernel answered
    torch.testing.assert_close(few, expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    assert torch.equal(model.head(x), int4_head)  # more rows: the planes, as before
    assert isinstance(model.up.kernel, Int4Linear) and model.up.kernel._few_rows is None
    # Not over the memory budget given (64 x 64 one-byte weights).
    model = Tiny()
    install_int4_kernels(model, {"head": random_blocks(64, 64, 8)})
    assert install_int8_rows(model, budget_bytes=64 * 64 - 1) == 0
    assert install_int8_rows(model, budget_bytes=64 * 64) == 1
    # A one-plane (4-bit) head gains nothing from int8: it keeps the int4 kernel.
    model = Tiny()
    install_int4_kernels(model, {"head": random_blocks(64, 64, 4)})
    assert install_int8_rows(model) == 0
