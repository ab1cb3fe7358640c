"""The attention layer: reshapes q/k/v to heads and hands them to the platform's backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedlm.attention.backend import FusedRotary
from pagedlm.distributed import get_tensor_model_parallel_rank
from pagedlm.kv_cache import fp8
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.rotary_embedding import PendingRotation


class Attention(nn.Module):
    """Attention of one layer over the paged KV cache (causal unless ``causal=False``).

    forward(q [T, num_heads * head_dim], k, v [T, num_kv_heads * head_dim], ctx, rotation)
    -> [T, num_heads * head_dim]. ``layer_idx`` picks this layer's cache. Holds no weights
    unless ``sinks``: then ``sinks`` [num_heads] (this rank's heads, loaded from the
    checkpoint's [total heads] by tensor-parallel rank) are per-head logits that join every
    query's softmax denominator (gpt-oss), only on backends with ``supports_sinks``.
    ``rotation``: q and k still need their rotary embedding; the backend applies it inside
    its kernel where it can (``AttentionBackend.fuses_rotary``), else this layer first.
    ``sliding_window`` (keys within the last ``w`` positions only) and ``logits_soft_cap``
    (scores squashed to ``c * tanh(s / c)``) are per layer; None means off.

    ``k_scale``/``v_scale`` (float32 [1] buffers, 1.0 by default) dequantize an FP8 KV
    cache (``pagedlm.kv_cache.fp8``); they are passed to the backend only when this
    layer's cache is FP8. ``calculate_kv_scales`` set: the next forward measures them.
    ``causal=False`` (encoders such as BERT) lets every token of a request attend to every
    token of it, only for backends with ``supports_non_causal``, and only for steps that
    feed each request's whole prompt (the pooling runner schedules no chunks).

    ``value_dim`` (latent attention, DeepSeek's MLA over a latent cache): one key head
    (``num_kv_heads`` 1) that is also the value, its first ``value_dim`` features being
    the value; forward(q [T, num_heads * head_dim], kv [T, head_dim], kv, ctx) -> [T,
    num_heads * value_dim]. The layer's cache is then one tensor (``KVGeometry``'s
    ``shares_values``), and only backends with ``supports_latent_kv`` take it.
    """

    calculate_kv_scales: bool = False

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        causal: bool = True,
        sinks: bool = False,
        value_dim: int | None = None,
    ) -> None:
        super().__init__()
        if value_dim is not None and (num_kv_heads != 1 or not 0 < value_dim < head_dim):
            raise ValueError(
                f"latent attention takes one key head whose first value_dim features are "
                f"the value; got num_kv_heads={num_kv_heads}, value_dim={value_dim}, "
                f"head_dim={head_dim}."
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
                "check num_attention_heads and num_key_value_heads in config.json."
            )
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.causal = causal
        # Keyword arguments only when set, so backends that predate them keep working.
        self._extra_kwargs: dict[str, int | float | bool] = {}
        if sliding_window is not None:
            self._extra_kwargs["sliding_window"] = sliding_window
        if logits_soft_cap is not None:
            self._extra_kwargs["logits_soft_cap"] = logits_soft_cap
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        if not causal:
            self._extra_kwargs["causal"] = False
        self.value_dim = value_dim
        if value_dim is not None:
            self._extra_kwargs["value_dim"] = value_dim
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
        self._checks_backend = bool(self._extra_kwargs) or sinks

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        rotation: PendingRotation | None = None,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        key_cache, value_cache = ctx.kv_cache.layer(self.layer_idx)
        if self._checks_backend:
            self._check_backend(ctx)
        extra = self._extra_kwargs
        if self.sinks is not None:
            extra = {**extra, "sinks": self.sinks}
        if rotation is not None:
            fused = self._fused_rotary(rotation, ctx)
            if fused is None:
                q, k = rotation.apply(q, k)
            else:
                extra = {**extra, "rotary": fused}
        if fp8.is_fp8(key_cache.dtype):
            extra = {**extra, **self._fp8_kwargs(k, v, ctx)}
        key = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.value_dim is None:
            value, out_dim = v.view(num_tokens, self.num_kv_heads, self.head_dim), self.head_dim
        else:  # the keys are the values: one tensor
            value, out_dim = key, self.value_dim
        out = ctx.attn_backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            key,
            value,
            key_cache,
            value_cache,
            ctx.attn_metadata,
            self.scale,
            **extra,
        )
        return out.reshape(num_tokens, self.num_heads * out_dim)

    def _fused_rotary(self, rotation: PendingRotation, ctx: ForwardContext) -> FusedRotary | None:
        """The rotation for the backend to apply in its kernel, or None (the layer does it):
        the backend declines this step, or the layer measures FP8 scales from the keys
        (which must be rotated first)."""
        if self.calculate_kv_scales or rotation.rotary.head_dim != self.head_dim:
            return None
        if not ctx.attn_backend.fuses_rotary(ctx.attn_metadata, self.head_dim):
            return None
        return rotation.fused()

    def _fp8_kwargs(
        self, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> dict[str, torch.Tensor]:
        if not getattr(ctx.attn_backend, "supports_fp8_kv_cache", False):
            raise ValueError(
                f"the {ctx.attn_backend.name!r} attention backend cannot read an FP8 KV "
                "cache; use kv_cache_dtype='auto' or a backend that can."
            )
        if self.calculate_kv_scales:
            scales = fp8.measured_scales(k, v)
            if scales is not None:
                self.k_scale.fill_(scales[0])
                self.v_scale.fill_(scales[1])
                self.calculate_kv_scales = False
        if self.value_dim is not None:  # one tensor, one scale
            return {"k_scale": self.k_scale, "v_scale": self.k_scale}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """This rank's heads of the checkpoint's [total heads] sinks (``QKVParallelLinear``
        gives rank ``r`` query heads ``r * num_heads ..``)."""
        # Imported here: the loader package imports this module.
        from pagedlm.model_executor.loader.weight_utils import copy_checked, shard_of

        rank = get_tensor_model_parallel_rank()
        copy_checked(param.data, shard_of(loaded_weight, 0, rank, self.num_heads), "sinks")

    def _check_backend(self, ctx: ForwardContext) -> None:
        backend = ctx.attn_backend
        features: dict[str, object] = dict(self._extra_kwargs)
        if self.sinks is not None:
            features["sinks"] = f"[{self.num_heads}]"
        for feature, flag in (
            ("sliding_window", "supports_sliding_window"),
            ("logits_soft_cap", "supports_logits_soft_cap"),
            ("causal", "supports_non_causal"),
            ("sinks", "supports_sinks"),
            ("value_dim", "supports_latent_kv"),
        ):
            if feature in features and not getattr(backend, flag, False):
                raise ValueError(
                    f"layer {self.layer_idx} needs {feature}={features[feature]}, "
                    f"which the {backend.name!r} attention backend does not implement; choose "
                    "a backend that does (e.g. the CPU platform's attention_backend='cpu_sdpa') "
                    "or another model."
                )

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, scale={self.scale}, "
            f"sliding_window={self.sliding_window}, logits_soft_cap={self.logits_soft_cap}, "
            f"causal={self.causal}, sinks={self.sinks is not None}, value_dim={self.value_dim}"
        )


def model_kv_heads(model: nn.Module, default: int) -> int:
    """KV heads ``model``'s attention layers hold on this worker (its shard under tensor
    parallelism); ``default`` for a model without any."""
    return model_kv_geometry(model, default, 0).num_kv_heads


@dataclass(frozen=True)
class KVGeometry:
    """What one layer's KV cache holds per token on this worker: ``num_kv_heads`` heads
    of ``head_dim`` for the keys and as many for the values, or, ``shares_values``
    (latent attention), one tensor whose keys are also the values."""

    num_kv_heads: int
    head_dim: int
    shares_values: bool = False


def model_kv_geometry(model: nn.Module, num_kv_heads: int, head_dim: int) -> KVGeometry:
    """The KV cache geometry of ``model``'s attention layers on this worker (they all
    share one); ``num_kv_heads``/``head_dim`` for a model without any."""
    for module in model.modules():
        if isinstance(module, Attention):
            return KVGeometry(module.num_kv_heads, module.head_dim, module.value_dim is not None)
    return KVGeometry(num_kv_heads, head_dim)


def install_kv_scales(model: torch.nn.Module, found: dict[tuple[int, str], float]) -> None:
    """Copy ``split_kv_scales``' scales into the attention layers of ``model``."""
    for module in model.modules():
        if isinstance(module, Attention):
            for kind in ("k_scale", "v_scale"):
                if (module.layer_idx, kind) in found:
                    getattr(module, kind).fill_(found[(module.layer_idx, kind)])


def arm_kv_scale_calculation(model: torch.nn.Module) -> None:
    """Have every attention layer measure its scales on its next forward (once)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.calculate_kv_scales = True


def kv_scales_pending(model: torch.nn.Module) -> bool:
    """Whether an attention layer of ``model`` still waits to measure its scales."""
    return any(m.calculate_kv_scales for m in model.modules() if isinstance(m, Attention))
