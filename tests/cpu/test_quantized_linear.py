"""Int4Linear against F.linear on the weights its blocks stand for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.model_executor.layers.linear import ColumnParallelLinear
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.loader.gguf_blocks import AffineBlocks
from pagedlm_cpu import quantized_linear
from pagedlm_cpu.quantized_linear import (
    DequantScratch,
    Int4Linear,
    install_int4_kernels,
    int4_kernel_available,
    pack_int4,
)

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="no CPU int4 kernel")


def random_blocks(rows: int, cols: int, bits: int, seed: int = 0) -> AffineBlocks:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, cols), generator=generator, dtype=torch.uint8)
    scales = torch.rand(rows, cols // 32, generator=generator) * 0.02 / 2 ** (bits - 4)
    mins = -(2 ** (bits - 1)) * scales + torch.randn(rows, cols // 32, generator=generator) * 1e-3
    return AffineBlocks(codes, scales, mins)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_matches_dequantized_weights(bits, rows, dtype):
    # 72 output features: not a multiple of the kernel's 16-wide tiles, so padding is cut.
    blocks = random_blocks(72, 128, bits)
    bias = torch.randn(72)
    layer = Int4Linear(blocks, bias.to(dtype), DequantScratch(), max_rows=64)
    assert layer.num_planes == (1 if bits == 4 else 2)
    x = torch.randn(rows, 128)
    expected = F.linear(x, blocks.dequantize(), bias)
    out = layer(x.to(dtype))
    assert out.dtype == dtype and out.shape == (rows, 72)
    # bf16 activations, scales and outputs: a plain bf16 F.linear is off by about 3e-3.
    assert relative_error(out, expected) < 6e-3


def _planes_by_arithmetic(blocks: AffineBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The planes' int32 codes [rows, planes * cols] and (scale, zero) pairs [rows, groups *
    planes, 2] by the definition: centre wide codes, split with floor division."""
    codes, scales, mins = blocks.codes.to(torch.int32), blocks.scales, blocks.mins
    if int(codes.max()) < 16:
        return codes, torch.stack([scales, mins + 8 * scales], dim=-1)
    offset = 1 << (int(codes.max()).bit_length() - 1)
    high, low = torch.div(codes - offset, 16, rounding_mode="floor"), (codes - offset) % 16
    pairs_high = torch.stack([scales * 16, torch.zeros_like(scales)], dim=-1)
    pairs_low = torch.stack([scales, mins + offset * scales + 8 * scales], dim=-1)
    return torch.cat([high + 8, low], dim=1), torch.cat([pairs_high, pairs_low], dim=1)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_packing_from_the_codes_is_the_planes_by_definition(bits, monkeypatch):
    # 1100 rows: packed in two calls (1024 + the rest) with padding rows in the second.
    monkeypatch.setattr(quantized_linear, "_PACK_ROWS", 1024)
    blocks = random_blocks(1100, 64, bits, seed=bits)
    planes = pack_int4(blocks)
    codes, pairs = _planes_by_arithmetic(blocks)
    padded = torch.nn.functional.pad(codes, (0, 0, 0, 4), value=8)
    assert torch.equal(planes.packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 1))
    expected_pairs = torch.nn.functional.pad(pairs, (0, 0, 0, 0, 0, 4)).transpose(0, 1)
    assert torch.equal(planes.scale_zeros, expected_pairs.to(torch.bfloat16).contiguous())
    assert planes.num_planes == (1 if bits == 4 else 2)


def test_strided_and_empty_inputs():
    blocks = random_blocks(32, 64, 4)
    layer = Int4Linear(blocks, None, DequantScratch())
    x = torch.randn(64, 6).t().to(torch.bfloat16)  # a transposed view, not contiguous
    assert relative_error(layer(x), F.linear(x.float(), blocks.dequantize())) < 6e-3
    assert layer(torch.randn(0, 64)).shape == (0, 32)


def test_rows_past_max_rows_take_the_dequantized_path():
    blocks = random_blocks(48, 64, 8, seed=1)
    scratch = DequantScratch()
    layer = Int4Linear(blocks, None, scratch, max_rows=4)
    x = torch.randn(5, 64)
    # float32 all the way: equal to F.linear on the dequantized weight up to summation order.
    torch.testing.assert_close(layer(x), F.linear(x, blocks.dequantize()), rtol=1e-5, atol=1e-5)
    assert scratch.buffer.numel() >= 48 * 64
    assert relative_error(layer(x[:4]), F.linear(x[:4], blocks.dequantize())) < 6e-3


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(64, 64)
        self.up = ColumnParallelLinear(64, 96)
        self.head = ParallelLMHead(64, 64)
        self.head.tie_to(self.embed)


def test_install_releases_untied_weights_only():
    model = Tiny()
    blocks = {"up": random_blocks(96, 64, 4), "head": random_blocks(64, 64, 8)}
    for name, module in (("up", model.up), ("head", model.head)):
        module.weight.data.copy_(blocks[name].dequantize())
    x = torch.randn(3, 64)
    assert install_int4_kernels(model, blocks) == 2
    assert model.up.weight.numel() == 0
    assert model.embed.weight.numel() == 64 * 64  # the embedding still looks rows up
    assert relative_error(model.up(x), F.linear(x, blocks["up"].dequantize())) < 6e-3
    assert relative_error(model.head(x), F.linear(x, blocks["head"].dequantize())) < 6e-3
