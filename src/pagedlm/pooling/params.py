"""``PoolingParams`` (vLLM's name): per-request options of a pooling request."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedlm.config import PoolerConfig


@dataclass(frozen=True)
class PoolingParams:
    """``dimensions``: keep the first this many values (Matryoshka models only), then
    normalize; ``normalize``: L2-normalize (None: the model's pooler config decides)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def validate(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """Raise ``ValueError`` naming the fix when the model cannot honour these."""
        dims = self.dimensions
        if dims is None:
            return
        if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
            raise ValueError(f"dimensions must be a positive integer, got {dims!r}.")
        if not pooler.is_matryoshka:
            if dims == hidden_size:
                return
            raise ValueError(
                f"dimensions={dims} needs a Matryoshka model, and this one is not (its "
                f"config.json has no is_matryoshka / matryoshka_dimensions); omit dimensions "
                f"to get all {hidden_size}."
            )
        allowed = pooler.matryoshka_dimensions
        if allowed is not None and dims not in allowed:
            raise ValueError(
                f"dimensions={dims} is not one this model was trained for; use one of "
                f"{sorted(allowed)}."
            )
        if dims > hidden_size:
            raise ValueError(f"dimensions={dims} exceeds the model's {hidden_size} dimensions.")

    def finish(self, pooled: list[float], pooler: PoolerConfig) -> torch.Tensor:
        """The user's vector from the engine's raw one: cut to ``dimensions``, then
        normalized when asked (float32)."""
        vector = torch.tensor(pooled, dtype=torch.float32)
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        normalize = pooler.normalize if self.normalize is None else self.normalize
        return F.normalize(vector, p=2, dim=-1) if normalize else vector
