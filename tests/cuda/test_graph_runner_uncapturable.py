"""A model with MoE layers (which group tokens by expert on the host) gets no CUDA graphs
and runs eagerly, instead of failing its capture at start-up."""

from __future__ import annotations

import logging
import types

from torch import nn

from pagedlm.model_executor.layers.moe import HOST_GROUPING, FusedMoE
from pagedlm_cuda.graph_runner import CudaGraphRunner


class _Backend:
    name = "fake"

    @staticmethod
    def supports_graph(query_len: int) -> bool:
        return True


def test_moe_models_run_eagerly_and_say_why(caplog) -> None:
    moe = FusedMoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, renormalize=True)
    runner = types.SimpleNamespace(
        attn_backend=_Backend(),
        config=types.SimpleNamespace(speculative=None),
        model=nn.Sequential(nn.Linear(8, 8), moe),
    )
    with caplog.at_level(logging.INFO, logger="pagedlm_cuda.graph_runner"):
        assert CudaGraphRunner.for_model_runner(runner) is None  # before any capture
    assert HOST_GROUPING in caplog.text
