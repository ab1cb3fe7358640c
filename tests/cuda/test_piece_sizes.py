"""The token counts piecewise graphs are captured at (plain Python: runs on any host)."""

from __future__ import annotations

import itertools

from pagedlm_cuda.piecewise_graphs import MAX_TOKENS_ENV, max_piece_tokens, piece_sizes


def test_sizes_ascend_in_multiples_of_16_up_to_the_cap() -> None:
    sizes = piece_sizes(2048)
    assert sizes == sorted(set(sizes)) and all(s % 16 == 0 for s in sizes)
    assert sizes[0] == 16 and sizes[-1] == 2048
    # Above 64 tokens a padded step is at most a third padding rows.
    assert all(b / a <= 1.5 for a, b in itertools.pairwise(sizes[3:]))
    assert piece_sizes(300)[-1] == 256 and piece_sizes(8) == []


def test_the_cap_follows_the_budget_and_the_environment(monkeypatch) -> None:
    assert max_piece_tokens(512) == 512
    monkeypatch.setenv(MAX_TOKENS_ENV, "0")
    assert max_piece_tokens(8192) == 0 and piece_sizes(0) == []


def test_a_latent_attention_call_keeps_one_key_tensor() -> None:
    """Latent attention (``value is key``, output ``value_dim`` wide): the captured call's
    fixed output is the values' width and its unowned inputs keep ``value is key``, which
    the backends check (an H100 run failed both before session 44's fix)."""
    import torch

    from pagedlm_cuda.piecewise_graphs import _AttentionCall, _output_dim, _unowned_inputs

    key = torch.randn(4, 1, 8)
    query, out = torch.randn(4, 2, 8), torch.zeros(4, 2, 6)
    call = _AttentionCall(query, key, key, None, None, 1.0, {"value_dim": 6}, out)
    assert _output_dim(key, call.kwargs) == 6 and _output_dim(key, {}) == 8
    unowned = _unowned_inputs(call)
    assert unowned.value is unowned.key and torch.equal(unowned.key, key)
    value = torch.randn(4, 1, 8)
    plain = _unowned_inputs(_AttentionCall(query, key, value, None, None, 1.0, {}, out))
    assert plain.value is not plain.key and torch.equal(plain.value, value)
