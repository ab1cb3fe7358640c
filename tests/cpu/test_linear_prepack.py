"""oneDNN prepacked linears: same results as F.linear, plain weights released unless tied."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedlm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm_cpu.linear import onednn_available, prepack_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


class Tiny(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(50, 16)
        self.up = ColumnParallelLinear(16, 24, bias=True)
        self.down = RowParallelLinear(24, 16, bias=True)
        self.head = ParallelLMHead(50, 16)
        if tied:
            self.head.tie_to(self.embed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.up(self.embed(ids))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_prepacked_matches_plain(tied, dtype):
    torch.manual_seed(0)
    model = Tiny(tied).to(dtype)
    for p in model.parameters():
        p.data.normal_()
    ids = torch.randint(0, 50, (7,))
    expected = model(ids)
    # oneDNN packs bf16 weights only on CPUs with AVX512 (or AVX-NE-CONVERT); elsewhere
    # bf16 layers stay on F.linear rather than fail at start-up.
    packable = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert prepack_linears(model) == (3 if packable else 0)
    tol = 1e-4 if dtype == torch.float32 else 0.25
    torch.testing.assert_close(model(ids), expected, atol=tol, rtol=tol)
    if packable:
        assert model.up.weight.numel() == 0 and model.down.weight.numel() == 0
        assert (model.head.weight.numel() > 0) == tied  # the embedding still needs it
    # The sizes are the layers', not the (released) weights'.
    assert "in_per_rank=16, out_per_rank=24" in repr(model)


def test_layers_with_a_kernel_are_left_alone():
    model = Tiny(tied=False)
    for p in model.parameters():
        p.data.normal_()
    model.up.set_kernel(lambda x: x[:, :1].expand(-1, 24))
    assert prepack_linears(model) == 2
    assert model.up.weight.numel() > 0
