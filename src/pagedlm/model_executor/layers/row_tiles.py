"""Row-wise functions computed on tiles of a fixed row count (batch-invariant mode's GEMMs:
``pagedlm.batch_invariant``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def in_row_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int
) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` of 2-d ``x``, computed on contiguous tiles of
    exactly ``tile`` rows (the last zero-padded), so ``fn`` sees one shape whatever the
    row count."""
    num_rows = x.shape[0]
    padded = -(-num_rows // tile) * tile
    if padded == 0:
        return fn(x)
    x = F.pad(x, (0, 0, 0, padded - num_rows)) if padded != num_rows else x.contiguous()
    outputs = [fn(x[start : start + tile]) for start in range(0, padded, tile)]
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out[:num_rows]
