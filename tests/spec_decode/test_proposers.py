"""The proposers on their own: n-gram lookup against a brute-force search, the EAGLE heads
loaded from the authors' layouts against a plain-torch reference of their math, and the
benchmarks' acceptance proposer at known rates."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.kv_cache.interface import TensorKVCache
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.spec_decode.acceptance import AcceptanceProposer
from pagedlm.spec_decode.eagle import load_head
from pagedlm.spec_decode.ngram import propose_ngrams
from pagedlm.spec_decode.proposer import ProposalRequests
from pagedlm.step import NewRequestData
from pagedlm.worker.input_batch import InputBatch
from pagedlm_cpu.attention import CpuSdpaBackend
from spec_decode.tiny_heads import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    VOCAB,
    write_eagle,
    write_eagle3,
)


def _brute_force_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix (up to ``max_n``) found earlier, at its earliest place."""
    best, best_end = 0, -1
    for end in range(len(tokens) - 1):  # an occurrence ending before the last token
        length = 0
        while (
            length < max_n
            and length <= end
            and tokens[end - length] == tokens[len(tokens) - 1 - length]
        ):
            length += 1
        if length > best:
            best, best_end = length, end
    if best < min_n:
        return []
    return tokens[best_end + 1 : best_end + 1 + k]


def test_ngram_lookup_is_the_longest_earliest_match() -> None:
    rng = random.Random(0)
    cases = []
    for _ in range(200):
        length = rng.randint(1, 30)
        tokens = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(length)]
        cases.append((tokens, rng.randint(1, 3), rng.randint(3, 5), rng.randint(1, 5)))
    for min_n, max_n in {(c[1], c[2]) for c in cases}:
        group = [c for c in cases if (c[1], c[2]) == (min_n, max_n)]
        width = max(len(c[0]) for c in group) + 2
        rows = torch.tensor([c[0] + [9] * (width - len(c[0])) for c in group])
        lengths = torch.tensor([len(c[0]) for c in group])
        wanted = torch.tensor([c[3] for c in group])
        drafts, num_valid = propose_ngrams(rows, lengths, min_n, max_n, 5, wanted)
        rows_out = zip(drafts.tolist(), num_valid.tolist(), group, strict=True)
        for row, count, (tokens, *_, k) in rows_out:
            assert row[:count] == _brute_force_ngram(tokens, min_n, max_n, k), tokens


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary over [T, heads, head_dim]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = (
        torch.cat([angles.cos()] * 2, -1)[:, None],
        torch.cat([angles.sin()] * 2, -1)[:, None],
    )
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _attention(w: dict, prefix: str, x: torch.Tensor, theta: float) -> torch.Tensor:
    """Causal GQA attention of one sequence, as the authors' LlamaAttention computes it."""
    tokens = x.shape[0]
    positions = torch.arange(tokens)
    q = _rope((x @ w[f"{prefix}q_proj.weight"].T).view(tokens, HEADS, HEAD_DIM), positions, theta)
    k = _rope(
        (x @ w[f"{prefix}k_proj.weight"].T).view(tokens, KV_HEADS, HEAD_DIM), positions, theta
    )
    v = (x @ w[f"{prefix}v_proj.weight"].T).view(tokens, KV_HEADS, HEAD_DIM)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(tokens, tokens, dtype=torch.bool), 1), -1e30)
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(tokens, -1)
    return out @ w[f"{prefix}o_proj.weight"].T


def _mlp(w: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate = torch.nn.functional.silu(x @ w[f"{prefix}gate_proj.weight"].T)
    return (gate * (x @ w[f"{prefix}up_proj.weight"].T)) @ w[f"{prefix}down_proj.weight"].T


def _run_head(head, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The pagedlm head over one sequence of positions 0..T-1 (CPU backend, its own KV)."""
    tokens, block_size = embeds.shape[0], 4
    num_blocks = -(-tokens // block_size)
    layout = BatchLayout.from_lists(
        [0, tokens], [tokens], [list(range(num_blocks))], list(range(tokens)), block_size
    )
    backend = CpuSdpaBackend(torch.device("cpu"))
    shape = backend.kv_cache_shape(num_blocks, block_size, KV_HEADS, HEAD_DIM)
    num_layers = len(head.layers)
    cache = TensorKVCache(
        shape, num_layers, block_size, torch.float32, lambda s, d: torch.zeros(s, dtype=d)
    )
    ctx = ForwardContext(backend, backend.build_metadata(layout), cache)
    with torch.no_grad():
        return head(embeds, hidden, torch.arange(tokens, dtype=torch.int32), ctx)


def _config(path) -> ModelConfig:
    return ModelConfig(str(path), None, ArchConfig.from_directory(path), torch.float32, 64)


def test_eagle_head_matches_the_authors_math(tmp_path) -> None:
    path = write_eagle(tmp_path / "eagle")
    w = torch.load(path / "pytorch_model.bin", weights_only=True)
    head = load_head("eagle", _config(path), torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, VOCAB, (7,), generator=generator)
    hidden = torch.randn(7, HIDDEN, generator=generator)
    embeds = w["embed_tokens.weight"][token_ids]
    assert torch.equal(head.embed_tokens(token_ids), embeds)  # its own copy, loaded
    x = torch.cat([embeds, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    x = x + _attention(w, "layers.0.self_attn.", x, 10000.0)  # no input_layernorm
    x = x + _mlp(w, "layers.0.mlp.", _rms(x, w["layers.0.post_attention_layernorm.weight"]))
    torch.testing.assert_close(_run_head(head, embeds, hidden), x, rtol=1e-4, atol=1e-4)


def test_eagle3_head_matches_the_authors_math(tmp_path) -> None:
    from safetensors.torch import load_file

    path = write_eagle3(tmp_path / "eagle3", aux_layers=[0, 1, 1])
    w = load_file(path / "model.safetensors")
    head = load_head("eagle3", _config(path), torch.device("cpu"))
    assert head.embed_tokens is None  # the target's is shared
    generator = torch.Generator().manual_seed(1)
    embeds = torch.randn(6, HIDDEN, generator=generator)
    aux = torch.randn(6, 3 * HIDDEN, generator=generator)
    fused = aux @ w["fc.weight"].T
    torch.testing.assert_close(head.combine(aux), fused)
    m = "midlayer."
    x = torch.cat(
        [_rms(embeds, w[f"{m}input_layernorm.weight"]), _rms(fused, w[f"{m}hidden_norm.weight"])],
        -1,
    )
    h = fused + _attention(w, f"{m}self_attn.", x, 10000.0)
    out = h + _mlp(w, f"{m}mlp.", _rms(h, w[f"{m}post_attention_layernorm.weight"]))
    torch.testing.assert_close(_run_head(head, embeds, fused), out, rtol=1e-4, atol=1e-4)
    draft = (_rms(out, w["norm.weight"]) @ w["lm_head.weight"].T).argmax(-1)
    expected_ids = draft + w["d2t"][draft]
    assert torch.equal(head.draft_token_ids(out), expected_ids)
    assert bool((expected_ids % 2 == 0).all())  # the draft vocabulary is the even ids


@pytest.mark.parametrize(("rate", "expected"), [(1.0, 1.0), (0.0, 0.0), (0.6, 0.6)])
def test_the_acceptance_proposer_is_right_at_the_given_rate(tmp_path, rate, expected) -> None:
    prompt, continuation = [5, 6, 7], list(range(10, 90))
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps([[prompt, continuation]]))
    batch = InputBatch(2, 100, 4, torch.device("cpu"))
    proposer = AcceptanceProposer(batch, str(reference), rate, VOCAB)
    proposer.admit(NewRequestData("a", prompt, 3, None, [], 0), 1)  # type: ignore[arg-type]
    right = 0
    for length in range(3, 63, 4):  # the request has `length` tokens, all the reference's
        requests = ProposalRequests(
            np.array([0]),
            np.array([1]),
            np.array([4]),
            torch.tensor([length]),
            np.array([length]),
            True,
            torch.tensor([0]),
            torch.tensor([1]),
            torch.tensor([4]),
        )
        drafts, num_valid = proposer.propose(None, requests)  # type: ignore[arg-type]
        truth = (prompt + continuation)[length : length + 4]
        right += sum(int(d == t) for d, t in zip(drafts[0].tolist(), truth))
        assert num_valid.tolist() == [4]
    assert abs(right / 60 - expected) < 0.15
