"""Each row's argmax over a vocabulary-wide row, at the CPU's vector rate.

``torch.max(x, dim=-1)`` on CPU walks a row with a scalar value-and-index loop: 32 rows of
49,152 float32 logits (SmolLM2's greedy step at batch 32) take ~0.8 ms on a Zen 5 core, 2%
of that step, and the random rows' exponential race ends in the same argmax. ``amax``
(values only) is vectorized: the same rows take ~70 us. So a row is cut into chunks of
``CHUNK`` values, ``amax`` finds each chunk's maximum, and ``torch.max`` runs over the
chunk maxima and then over the one chunk holding the row's maximum: ~125 us in all.

The answer is ``torch.max``'s own: the first chunk holding the row's maximum holds its first
occurrence, and the first maximal index inside that chunk is it. NaN ranks above every
number in both ``amax`` and ``max``, so a row with a NaN gets its first NaN, as
``torch.max`` gives it.
"""

from __future__ import annotations

import torch

CHUNK = 256
"""Values per chunk. 32 float32 rows of 49,152 (one Zen 5 core, us): 64 values 197, 128
144, 256 124, 512 127, 1,024 140. Shorter chunks make ``amax`` slower, longer ones the
scalar scan of the chunk holding the maximum."""

MIN_VOCAB = 8 * CHUNK
"""Shorter rows take ``torch.max`` directly: three ops cost more than the scan they save."""


def chunked_argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.max(dim=-1).indices`` for a 2-d ``x`` [N, V] (int64 [N]): the first index of each
    row's maximum."""
    vocab = x.shape[-1]
    if vocab < MIN_VOCAB or x.stride(-1) != 1:
        return x.max(dim=-1).indices
    whole = vocab - vocab % CHUNK
    chunk_max = x[:, :whole].unflatten(1, (whole // CHUNK, CHUNK)).amax(dim=-1)
    if whole < vocab:
        chunk_max = torch.cat([chunk_max, x[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    start = chunk_max.max(dim=-1).indices * CHUNK
    # The last chunk may be short: its missing columns repeat the row's last value, which
    # never comes before an equal value in the chunk.
    columns = (start[:, None] + torch.arange(CHUNK, device=x.device)).clamp_(max=vocab - 1)
    return start + x.gather(1, columns).max(dim=-1).indices
