"""Whether a model with latent attention (DeepSeek's MLA) runs it over a latent KV cache.

A model that can (``enable_latent_kv``) caches one latent vector per token and layer
(``kv_lora_rank + qk_rope_head_dim`` features: 576 for DeepSeek-V2/V3) instead of every
head's expanded keys and values, as vLLM's MLA backends do. It does so by default; it
keeps the expanded keys and values where the latent form cannot serve the run, and says
why in the start-up log:

- ``PAGEDLM_MLA_DISABLE=1`` (or vLLM's ``VLLM_MLA_DISABLE=1``) asks for the expanded form;
- the attention backend has no latent attention (``AttentionBackend.supports_latent_kv``);
- LoRA is enabled: an adapter's ``kv_b_proj`` delta would change the weights the latent
  form folds into the queries and outputs once, at load;
- batch-invariant mode: the folded products are batched matrix products whose reduction
  order is the BLAS library's, not fixed per row as the mode's linear layers are.
"""

from __future__ import annotations

import logging
import os

from torch import nn

from pagedlm.attention.backend import AttentionBackend
from pagedlm.config import EngineConfig
from pagedlm.model_executor.layers.attention import KVGeometry

logger = logging.getLogger(__name__)

DISABLE_ENVS = ("PAGEDLM_MLA_DISABLE", "VLLM_MLA_DISABLE")
"""Set to 1 to keep latent attention over expanded keys and values."""


def latent_kv_refusal(
    config: EngineConfig, backend_cls: type[AttentionBackend] | None
) -> str | None:
    """Why the latent cache cannot serve this run, or None when it can (``backend_cls``
    None: whatever the attention backend)."""
    for name in DISABLE_ENVS:
        if os.environ.get(name, "0") not in ("", "0"):
            return f"{name}={os.environ[name]}"
    if backend_cls is not None and not backend_cls.supports_latent_kv:
        return f"the {backend_cls.name!r} attention backend has no latent attention"
    if config.lora is not None:
        return "LoRA is enabled (adapters may change kv_b_proj)"
    if config.batch_invariant:
        return "batch-invariant mode"
    return None


def choose_latent_kv(
    model: nn.Module, config: EngineConfig, backend_cls: type[AttentionBackend]
) -> bool:
    """Switch ``model`` to its latent cache where it has one and nothing refuses it (logged
    either way); whether it switched. Call after the weights are loaded and before the KV
    cache is sized."""
    enable = getattr(model, "enable_latent_kv", None)
    if enable is None:
        return False
    refusal = latent_kv_refusal(config, backend_cls)
    if refusal is not None:
        logger.info(
            "Latent attention runs over expanded keys and values, a larger KV cache: %s.",
            refusal,
        )
        return False
    enable()
    logger.info("Latent attention over a latent KV cache (one vector per token and layer).")
    return True


def planned_kv_geometry(config: EngineConfig) -> KVGeometry:
    """The whole model's KV geometry (every head: no tensor-parallel split), decided from
    the configuration alone, for sizing what outlives a worker's cache (the offloading
    pool): a model class with a latent cache (``enable_latent_kv``) gets it unless the
    configuration refuses it. Whether the attention backend has latent
    attention is not known here; a worker whose blocks turn out larger says so
    (``OffloadingConnector.register_kv_caches``)."""
    from pagedlm.model_executor.models.registry import get_model_class

    arch = config.model.arch
    rank = arch.raw.get("kv_lora_rank")
    model_class = get_model_class(arch.architecture, config.model.model_impl)
    latent = rank and hasattr(model_class, "enable_latent_kv")
    if latent and latent_kv_refusal(config, None) is None:
        return KVGeometry(1, int(rank) + int(arch.raw["qk_rope_head_dim"]), shares_values=True)
    return KVGeometry(arch.num_key_value_heads, arch.head_dim)
