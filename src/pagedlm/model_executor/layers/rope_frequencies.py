"""The rotation frequencies of each ``rope_type`` a config may name, and the factor a type
puts on cos and sin (YaRN's attention scaling): what ``RotaryEmbedding`` and the table
variants of ``rotary_scaled`` build their cos/sin tables from.

Types here: "default", "linear" (positions divided by ``factor``), "llama3" (Llama 3.1's
band-wise interpolation) and "yarn" (YaRN: fast pairs extrapolated, slow ones
interpolated by ``factor``, a linear ramp between, and cos/sin scaled by an attention
factor). LongRoPE and M-RoPE need more than frequencies and live in their own modules.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """[head_dim / 2] the rotation frequency of each pair: ``base^(-2i / head_dim)``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's context extension: slow frequencies divided by ``factor``, fast ones
    kept, and the band between interpolated smoothly (by wavelength)."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    original_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's frequencies: pair i keeps ``base^(-2i / d)`` where it turns more than
    ``beta_fast`` times over the pretraining length (``original_max_position_embeddings``),
    is divided by ``factor`` where it turns fewer than ``beta_slow`` times, and is blended
    linearly in between (the boundaries rounded outward unless ``truncate`` is false)."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def pair_turning(turns: float) -> float:
        """The (fractional) pair index whose frequency turns ``turns`` times over
        ``original`` positions."""
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = default_inv_freq(rotary_dim, base)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Frequencies [head_dim / 2] for a config's ``rope_scaling`` (None, or a dict with
    ``rope_type``); ``head_dim`` is the rotated width (the rotary dimension)."""
    rope_type = "default" if scaling is None else scaling.get("rope_type", "default")
    if rope_type == "default":
        return default_inv_freq(head_dim, base)
    assert scaling is not None
    if rope_type == "linear":
        return default_inv_freq(head_dim, base) / scaling["factor"]
    if rope_type == "llama3":
        return llama3_inv_freq(default_inv_freq(head_dim, base), scaling)
    if rope_type == "yarn":
        return yarn_inv_freq(head_dim, base, scaling)
    raise ValueError(
        f"rope_type={rope_type!r} is not supported; supported: "
        f"{', '.join(repr(t) for t in SUPPORTED_ROPE_TYPES)} (and 'longrope', 'mrope')."
    )


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by (so attention logits by its square): YaRN's
    ``attention_factor``, else ``0.1 ln(factor) + 1``, or DeepSeek's ratio of two such
    terms when ``mscale`` and ``mscale_all_dim`` are given; 1 for the other types."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def rope_context_length(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The positions a config's rope serves: ``max_position_embeddings``, or for YaRN the
    pretraining length times ``factor`` where that is longer (vLLM's rule: a Qwen3 config
    with a YaRN factor of 4 over 32,768 positions serves 131,072)."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return max_position_embeddings
    extended = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    return max(max_position_embeddings, extended)


__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "default_inv_freq",
    "llama3_inv_freq",
    "rope_attention_factor",
    "rope_context_length",
    "rope_inv_freq",
    "yarn_inv_freq",
]
