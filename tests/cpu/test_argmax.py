"""The CPU platform's argmax: ``torch.max``'s indices, ties, NaN and -inf included."""

from __future__ import annotations

import pytest
import torch

from pagedlm_cpu.argmax import CHUNK, MIN_VOCAB, chunked_argmax_rows
from pagedlm_cpu.platform import CpuPlatform


def _rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(vocab)
    x = torch.randn(9, vocab).to(dtype)
    x[1] = 0.0  # every value tied: index 0
    x[2, 5] = x[2, vocab - 7] = float("nan")  # the first NaN wins
    x[3] = float("-inf")  # a fully masked row
    x[4, -1] = 100.0  # the maximum in the last (maybe short) chunk
    x[5, CHUNK] = x[5, vocab - CHUNK - 1] = 50.0  # tied maxima in two chunks
    x[6, CHUNK + 3] = x[6, CHUNK + 9] = 50.0  # tied maxima in one chunk
    x[7, vocab - 1] = float("nan")  # a NaN at the very end
    return x


@pytest.mark.parametrize("vocab", [MIN_VOCAB - 1, MIN_VOCAB, 49_152, 49_153, 32_000 + 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunked_argmax_is_torch_max(vocab: int, dtype: torch.dtype) -> None:
    x = _rows(vocab, dtype)
    assert torch.equal(chunked_argmax_rows(x), x.max(dim=-1).indices)


def test_chunked_argmax_takes_strided_rows() -> None:
    x = _rows(4 * MIN_VOCAB, torch.float32)
    column_major = x.t().contiguous().t()
    assert torch.equal(chunked_argmax_rows(column_major), x.max(dim=-1).indices)
    part = x[:, 3:]
    assert torch.equal(chunked_argmax_rows(part), part.max(dim=-1).indices)


def test_the_cpu_platform_samples_with_it() -> None:
    assert CpuPlatform().argmax_rows() is chunked_argmax_rows
