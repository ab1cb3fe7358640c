"""Score transforms shared by the attention kernels: scaling and optional soft-capping.

Both kernels keep scores in the log2 domain (``exp2`` is the cheap instruction), so a
plain score is ``q.k * scale * log2(e)``. A soft-capped one is ``c * tanh(q.k * scale / c)``
(Gemma 2) times ``log2(e)``; ``score_args`` folds the constants on the host so the kernel
does one multiply without the cap and one ``exp2`` plus a division with it.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def score_args(scale: float, logits_soft_cap: float | None) -> tuple[float, float]:
    """(score_scale, cap_log2e) for ``scaled_scores``: without a cap the second is unused."""
    if logits_soft_cap is None:
        return scale * LOG2E, 0.0
    if logits_soft_cap <= 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}.")
    return scale / logits_soft_cap, logits_soft_cap * LOG2E


@triton.jit
def scaled_scores(dots, score_scale, cap_log2e, USE_SOFT_CAP: tl.constexpr):
    """Raw ``q.k`` dots -> log2-domain scores, soft-capped when ``USE_SOFT_CAP``."""
    if USE_SOFT_CAP:
        # tanh(x) = 1 - 2 / (e^{2x} + 1): e^{2x} overflowing to inf still gives 1, and
        # underflowing to 0 gives -1, so no clamp is needed.
        e2x = tl.exp2(dots * (score_scale * 2.8853900817779268))  # 2 * log2(e)
        return (1.0 - 2.0 / (e2x + 1.0)) * cap_log2e
    else:
        return dots * score_scale
