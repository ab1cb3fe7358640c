"""``load_format="dummy"``: random weights of the configured shapes, no weight files at all.

Used by benchmarks, where only shapes and dtypes matter. Values are small and bounded so
activations stay finite through many layers: norm weights are 1, everything else is drawn
uniformly from ``[-scale, scale]``.

Values are drawn where the parameter lives, by a generator of that device seeded from the
engine seed: two engines with the same seed on the same kind of device get the same
weights (different kinds of device draw different values). Drawing 8e9 values on the CPU
generator and copying them over instead took ~50 s of every 8B benchmark engine's start-up
on the H200 host; on the GPU it takes a fraction of a second.
"""

from __future__ import annotations

import torch
from torch import nn

DUMMY_SCALE = 0.02
_CHUNK_ELEMENTS = 1 << 24
"""Values are drawn in float32 (the same whatever the parameter's dtype) in chunks of this
many elements, so the temporary stays small even for a vocabulary-sized embedding."""


def fill_dummy_weights(model: nn.Module, seed: int = 0, scale: float = DUMMY_SCALE) -> None:
    """Overwrite every parameter of ``model`` in place (any device, any floating dtype)."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                raise ValueError(f"dummy weights cannot fill the non-float parameter {name}.")
            if param.dim() == 1 and name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            generator = generators.get(param.device)
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
                generators[param.device] = generator
            flat = param.data.view(-1)
            for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
                count = min(_CHUNK_ELEMENTS, flat.numel() - start)
                chunk = torch.empty(count, dtype=torch.float32, device=flat.device)
                flat[start : start + count].copy_(
                    chunk.uniform_(-scale, scale, generator=generator)
                )
