"""``load_format="dummy"``: random weights of the configured shapes, no weight files at all.

Used by benchmarks, where only shapes and dtypes matter. Values are small and bounded so
activations stay finite through many layers: norm weights are 1, everything else is drawn
uniformly from ``[-scale, scale]`` with a generator seeded from the engine seed, so two
engines with the same seed get the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

DUMMY_SCALE = 0.02
_CHUNK_ELEMENTS = 1 << 24
"""Random values are drawn on CPU in chunks of this many elements, then copied over."""


def fill_dummy_weights(model: nn.Module, seed: int = 0, scale: float = DUMMY_SCALE) -> None:
    """Overwrite every parameter of ``model`` in place (any device, any floating dtype).

    Drawing on the CPU generator keeps values identical across devices; drawing in chunks
    keeps the temporary small even for a vocabulary-sized embedding.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                raise ValueError(f"dummy weights cannot fill the non-float parameter {name}.")
            if param.dim() == 1 and name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            flat = param.data.view(-1)
            for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
                count = min(_CHUNK_ELEMENTS, flat.numel() - start)
                chunk = torch.empty(count, dtype=torch.float32).uniform_(
                    -scale, scale, generator=generator
                )
                flat[start : start + count].copy_(chunk)
