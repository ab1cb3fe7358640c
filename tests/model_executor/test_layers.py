"""Layers: tensor-parallel shards recombine to the full layer; norm, rotary, activation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pagedlm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_state
from pagedlm.model_executor.layers import vocab_embedding
from pagedlm.model_executor.layers.activation import SiluAndMul, get_act_and_mul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding, rope_inv_freq
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


def load(param: torch.nn.Parameter, tensor: torch.Tensor, *shard_id: object) -> None:
    param.weight_loader(param, tensor, *shard_id)


@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each simulated rank returns its partial result; the test combines them."""
    monkeypatch.setattr(vocab_embedding, "tensor_model_parallel_all_reduce", lambda t: t)
    monkeypatch.setattr(vocab_embedding, "tensor_model_parallel_all_gather", lambda t: t)


def test_single_process_defaults() -> None:
    assert get_tensor_model_parallel_world_size() == 1
    layer = ColumnParallelLinear(8, 6, bias=True)
    assert layer.weight.shape == (6, 8) and layer.bias is not None


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_then_row_parallel_equals_full_mlp(tp: int) -> None:
    torch.manual_seed(0)
    w1, b1, w2, b2 = torch.randn(16, 8), torch.randn(16), torch.randn(8, 16), torch.randn(8)
    x = torch.randn(5, 8)
    expected = F.linear(F.linear(x, w1, b1).relu(), w2, b2)
    partial_sums = []
    for rank in range(tp):
        with tensor_model_parallel_state(rank, tp):
            column = ColumnParallelLinear(8, 16, bias=True)
            row = RowParallelLinear(16, 8, bias=True, reduce_results=False)
        load(column.weight, w1)
        load(column.bias, b1)
        load(row.weight, w2)
        load(row.bias, b2)
        assert column.weight.shape == (16 // tp, 8) and row.weight.shape == (8, 16 // tp)
        partial_sums.append(row(column(x).relu()))
    torch.testing.assert_close(sum(partial_sums), expected)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_shards_hold_their_heads(tp: int) -> None:
    """4 query heads and 2 kv heads: at tp=4 each kv head is replicated on two ranks."""
    torch.manual_seed(0)
    head_dim, hidden = 3, 10
    wq, wk, wv = torch.randn(12, hidden), torch.randn(6, hidden), torch.randn(6, hidden)
    bq, bk, bv = torch.randn(12), torch.randn(6), torch.randn(6)
    x = torch.randn(4, hidden)
    q_parts, k_parts, v_parts = [], [], []
    for rank in range(tp):
        with tensor_model_parallel_state(rank, tp):
            qkv = QKVParallelLinear(hidden, head_dim, 4, 2, bias=True)
        for shard_id, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            load(qkv.weight, w, shard_id)
            load(qkv.bias, b, shard_id)
        q, k, v = qkv.split(qkv(x))
        assert q.shape == (4, 4 // tp * head_dim)
        q_parts.append(q)
        if rank % max(1, tp // 2) == 0:  # the first rank holding each kv head
            k_parts.append(k)
            v_parts.append(v)
    torch.testing.assert_close(torch.cat(q_parts, -1), F.linear(x, wq, bq))
    torch.testing.assert_close(torch.cat(k_parts, -1), F.linear(x, wk, bk))
    torch.testing.assert_close(torch.cat(v_parts, -1), F.linear(x, wv, bv))


def test_qkv_rejects_unknown_shard_id() -> None:
    qkv = QKVParallelLinear(8, 2, 4, 2)
    with pytest.raises(ValueError, match="'q', 'k' or 'v'"):
        load(qkv.weight, torch.zeros(8, 8), "o")


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_gate_up_keeps_each_projection_slice(tp: int) -> None:
    torch.manual_seed(0)
    gate, up, x = torch.randn(6, 4), torch.randn(6, 4), torch.randn(3, 4)
    outputs = []
    for rank in range(tp):
        with tensor_model_parallel_state(rank, tp):
            layer = MergedColumnParallelLinear(4, [6, 6])
        load(layer.weight, gate, 0)
        load(layer.weight, up, 1)
        outputs.append(SiluAndMul()(layer(x)))
    expected = F.silu(F.linear(x, gate)) * F.linear(x, up)
    torch.testing.assert_close(torch.cat(outputs, -1), expected)


def test_shape_mismatch_names_the_problem() -> None:
    layer = ColumnParallelLinear(8, 6)
    with pytest.raises(ValueError, match=r"shape \(6, 9\).*expects \(6, 8\)"):
        load(layer.weight, torch.zeros(6, 9))


@pytest.mark.parametrize("tp", [1, 3])
def test_vocab_shards_recombine(tp: int, no_collectives: None) -> None:
    """vocab 10 over 3 ranks: 4 + 4 + 2 rows, the last rank zero-padded to 4."""
    torch.manual_seed(0)
    table, ids, hidden = torch.randn(10, 6), torch.tensor([0, 3, 4, 9, 7]), torch.randn(2, 6)
    embeddings, logits = [], []
    for rank in range(tp):
        with tensor_model_parallel_state(rank, tp):
            embed = VocabParallelEmbedding(10, 6)
            head = ParallelLMHead(10, 6)
        load(embed.weight, table)
        load(head.weight, table)
        embeddings.append(embed(ids))
        logits.append(head(hidden))
    torch.testing.assert_close(sum(embeddings), F.embedding(ids, table))
    combined = torch.cat(logits, -1)[:, :10]
    assert combined.dtype == torch.float32
    torch.testing.assert_close(combined, hidden @ table.T)


def test_tied_lm_head_shares_the_embedding() -> None:
    embed, head = VocabParallelEmbedding(10, 4), ParallelLMHead(10, 4)
    head.tie_to(embed)
    load(embed.weight, torch.arange(40.0).view(10, 4))
    assert head.weight is embed.weight
    torch.testing.assert_close(head(torch.ones(1, 4)), torch.arange(40.0).view(10, 4).sum(1)[None])


def test_rms_norm_fused_residual_equals_add_then_norm() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    summed = x + residual
    expected = summed / (summed.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * norm.weight
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(new_residual, summed)
    torch.testing.assert_close(norm(summed), expected)


def test_rotary_matches_transformers_rotate_half() -> None:
    torch.manual_seed(0)
    head_dim, positions = 8, torch.tensor([0, 5, 17, 3])
    rope = RotaryEmbedding(head_dim, max_position=32, base=10000.0)
    q, k = torch.randn(4, 2 * head_dim), torch.randn(4, head_dim)
    q_out, k_out = rope(positions, q, k)

    angles = positions[:, None].float() * rope_inv_freq(head_dim, 10000.0, None)
    emb = torch.cat([angles, angles], -1)
    q_ref, k_ref = apply_rotary_pos_emb(
        q.view(4, 2, head_dim).transpose(0, 1)[None],
        k.view(4, 1, head_dim).transpose(0, 1)[None],
        emb.cos()[None],
        emb.sin()[None],
    )
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1).reshape(4, -1))
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1).reshape(4, -1))


def test_linear_rope_scaling_divides_frequencies() -> None:
    base = rope_inv_freq(8, 10000.0, None)
    scaled = rope_inv_freq(8, 10000.0, {"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(scaled, base / 4)


def test_unsupported_rope_and_activation_are_named() -> None:
    with pytest.raises(ValueError, match=r"rope_type='dynamic'.*'llama3', 'yarn'"):
        rope_inv_freq(8, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"hidden_act='gelu'.*silu"):
        get_act_and_mul("gelu")
