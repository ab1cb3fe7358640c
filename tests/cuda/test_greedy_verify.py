"""The fused greedy verification (``greedy_verify``) against the rejection sampler's torch
path plus ``Speculator.verify``'s writes (the conformance kit's check): tokens, counts,
the token table and the rejected counts, for requests of different row counts, fewer
valid drafts than rows, a tie, and a vocabulary of several argmax splits."""

from __future__ import annotations

import pytest
from triton_env import DEVICE

from pagedlm.testing import ConformanceFailure
from pagedlm.testing.platform_checks import check_greedy_verifier
from pagedlm_cuda.kernels.greedy_verify import greedy_verify
from pagedlm_cuda.kernels.sampling import SPLIT_V


@pytest.mark.parametrize("vocab_size", [50, SPLIT_V + 300])
def test_greedy_verify_matches_the_rejection_sampler(vocab_size: int) -> None:
    check_greedy_verifier(greedy_verify, DEVICE, vocab_size=vocab_size)


def test_the_check_fails_a_verifier_that_accepts_one_draft_too_many() -> None:
    def generous(*args, **kwargs):
        grid, num_emitted, emitted = greedy_verify(*args, **kwargs)
        return grid, num_emitted + 1, emitted

    with pytest.raises(ConformanceFailure, match="emitted"):
        check_greedy_verifier(generous, DEVICE)
