"""Gemma 3 (text): Gemma 2's block plus per-head q/k RMSNorm and a rope base per layer type.

Local (sliding-window) layers rotate with ``rope_local_base_freq`` (10k); global layers with
``rope_theta`` (1M), optionally scaled (linear, for the long-context sizes). Transformers 5
writes both into ``rope_parameters`` keyed by layer type; older files spell them
``rope_local_base_freq`` / ``rope_theta`` / ``rope_scaling``. Every sixth layer is global
unless ``layer_types`` says otherwise. No soft-capping by default (the configs set None).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.gemma2 import FULL, SLIDING, Gemma2ForCausalLM


def _rope_settings(arch: ArchConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """layer type -> (rope base, scaling dict or None)."""
    raw = arch.raw
    per_type = raw.get("rope_parameters") or {}
    settings: dict[str, tuple[float, dict[str, Any] | None]] = {}
    if SLIDING in per_type or FULL in per_type:
        for kind in (SLIDING, FULL):
            params = dict(per_type.get(kind) or {})
            base = float(params.pop("rope_theta", 10000.0 if kind == SLIDING else 1e6))
            rope_type = params.get("rope_type", params.get("type", "default"))
            settings[kind] = (base, None if rope_type == "default" else params)
        return settings
    settings[SLIDING] = (float(raw.get("rope_local_base_freq", 10000.0)), None)
    settings[FULL] = (arch.rope_theta, arch.rope_scaling)
    return settings


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    default_sliding_window_pattern = 6

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        super().__init__(arch, max_model_len)
        self.model.scaled_embedding = True

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled rows, as transformers' ``Gemma3TextScaledWordEmbedding`` gives them."""
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.model.normalizer, dtype=x.dtype)

    def rotary_embs(self, arch: ArchConfig) -> dict[str, RotaryEmbedding]:
        return {
            kind: RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, base, scaling)
            for kind, (base, scaling) in _rope_settings(arch).items()
        }
