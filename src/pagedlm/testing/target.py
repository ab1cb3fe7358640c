"""What the kit checks: an attention backend class on a device, and the shapes to try."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from pagedlm.attention import AttentionBackend
    from pagedlm.platforms import Platform


class HeadShape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"{self.num_heads}/{self.num_kv_heads} heads x {self.head_dim}"


DEFAULT_HEAD_SHAPES = (HeadShape(4, 4, 32), HeadShape(8, 2, 64), HeadShape(4, 1, 128))
"""Multi-head, grouped-query (4 queries per KV head) and multi-query attention."""
DEFAULT_BLOCK_SIZES = (16, 32)

CPU = torch.device("cpu")

_TOLERANCES = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
"""Relative error (per request, ``||out - ref|| / ||ref||``) allowed against the float64
reference: float32 leaves room for TF32 dots on GPUs (~3e-4 measured), bfloat16 for its
8-bit mantissa. Attending to the wrong keys costs far more (> 0.05 in the kit's cases)."""


def _torch_zeros(device: torch.device) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
    return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class AttentionTarget:
    """An attention backend class under test, on ``device`` in ``dtype``.

    ``zeros`` allocates the KV cache (``Platform.zeros``; default ``torch.zeros``).
    ``block_sizes`` and ``head_shapes`` are the configurations tried; narrow them to what
    the backend supports (a backend may refuse others at configuration time).
    """

    backend_cls: type[AttentionBackend]
    device: torch.device = CPU
    dtype: torch.dtype = torch.float32
    zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = field(
        default=None, compare=False
    )
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    head_shapes: tuple[HeadShape, ...] = DEFAULT_HEAD_SHAPES
    tolerance: float | None = None
    """None: by dtype (``_TOLERANCES``)."""

    @classmethod
    def for_platform(
        cls, platform: Platform, backend_cls: type[AttentionBackend], **overrides
    ) -> AttentionTarget:
        """The backend on ``platform``'s device, in float32 if it runs it (else its first
        dtype), with the KV cache allocated by ``platform.zeros``."""
        dtypes = platform.supported_dtypes
        dtype = torch.float32 if torch.float32 in dtypes else dtypes[0]
        fields = dict(device=platform.device, dtype=dtype, zeros=platform.zeros)
        return cls(backend_cls, **{**fields, **overrides})

    @property
    def name(self) -> str:
        cls = self.backend_cls
        return f"attention backend {cls.name!r} ({cls.__module__}.{cls.__qualname__})"

    @property
    def max_relative_error(self) -> float:
        return self.tolerance if self.tolerance is not None else _TOLERANCES[self.dtype]

    def allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        zeros = self.zeros or _torch_zeros(self.device)
        return zeros(shape, self.dtype)

    def new_backend(self) -> AttentionBackend:
        return self.backend_cls(self.device)
