"""An FP8 KV cache: vLLM's ``kv_cache_dtype`` values and per-tensor key/value scales.

With ``kv_cache_dtype="fp8"`` (= "fp8_e4m3") every layer's keys and values are stored as
``torch.float8_e4m3fn``: a key ``k`` is stored as ``saturate(k / k_scale)`` and read back
as ``stored * k_scale`` (values likewise with ``v_scale``). Saturation clamps to the
format's largest finite value (+-448), because a plain cast of an out-of-range value gives
NaN in E4M3FN (it has no infinity).

Scales are one float32 per layer for keys and one for values (vLLM's per-tensor
``k_scale``/``v_scale``), kept as buffers of the attention layer so a CUDA graph reads
them in place. They are 1.0 unless the checkpoint carries ``...self_attn.k_scale`` /
``v_scale`` tensors (vLLM's and llm-compressor's names), or ``calculate_kv_scales`` asks
for them to be measured on the first real step, as vLLM does: ``amax(|k|) / 200`` and
``amax(|v|) / 100`` (vLLM's ``K_SCALE_CONSTANT``/``V_SCALE_CONSTANT``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
"""Accepted ``kv_cache_dtype`` values; "fp8" is "fp8_e4m3", as in vLLM. A 16-bit name is
the model's dtype spelled out, accepted where it is the model's dtype."""

_SIXTEEN_BIT = {"float16": torch.float16, "bfloat16": torch.bfloat16}

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0

# model.layers.3.self_attn.k_scale, ...self_attn.attn.k_scale, ...self_attn.kv_scale (an
# older single scale for both), ...self_attn.k_proj.output_scale (compressed-tensors).
_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale|"
    r"k_proj\.output_scale|v_proj\.output_scale|k_proj\.k_scale|v_proj\.v_scale)$"
)


def validate_kv_cache_dtype(value: str, model_dtype: torch.dtype) -> str:
    """The canonical name ("auto" or "fp8") of a ``kv_cache_dtype`` for a model of
    ``model_dtype``; a clear error else.

    "float16"/"bfloat16" name the model's own dtype ("auto"). Another dtype than the
    model's is refused: vLLM takes it and its kernels store the model dtype's bits in the
    cache, read back as the other dtype (garbage, vllm-project/vllm#54338)."""
    if value not in KV_CACHE_DTYPES:
        hint = " (E5M2 caches are not implemented)" if value == "fp8_e5m2" else ""
        raise ValueError(
            f"kv_cache_dtype={value!r} is not supported{hint}; use one of "
            f"{list(KV_CACHE_DTYPES)} (--kv-cache-dtype)."
        )
    named = _SIXTEEN_BIT.get(value)
    if named is not None and named != model_dtype:
        model_name = str(model_dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype={value!r} differs from the model's dtype {model_name}: a "
            "16-bit cache holds keys and values in the model's dtype. Use "
            f"kv_cache_dtype='auto' (--kv-cache-dtype auto) or dtype={value!r} "
            f"(--dtype {value})."
        )
    return "fp8" if value.startswith("fp8") else "auto"


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the cache: the model's for "auto", float8 E4M3 for "fp8"."""
    return model_dtype if cache_dtype == "auto" else FP8_DTYPE


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [..] -> float8 E4M3 of ``x / scale``, saturated (the reference the kernels
    match); ``scale`` a 1-element float32 tensor."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored float8 values -> ``dtype``: ``x * scale`` computed in float32."""
    return (x.float() * scale).to(dtype)


def measured_scales(key: torch.Tensor, value: torch.Tensor) -> tuple[float, float] | None:
    """vLLM's dynamic scales of one layer from a step's keys and values (None when the
    step has no tokens); a zero tensor gets scale 1.0 rather than 0."""
    if key.numel() == 0:
        return None
    k = key.abs().amax().float().item() / K_SCALE_CONSTANT
    v = value.abs().amax().float().item() / V_SCALE_CONSTANT
    return (k if k > 0 else 1.0), (v if v > 0 else 1.0)


def split_kv_scales(
    weights: Iterable[tuple[str, torch.Tensor]], found: dict[tuple[int, str], float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors minus its KV-cache scales, which land in ``found`` as
    ``(layer, "k_scale" | "v_scale") -> scale`` (models have no parameter for them)."""
    for name, tensor in weights:
        match = _SCALE_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        layer, kind = int(match.group(1)), match.group(2)
        scale = float(tensor.float().max())  # per-tensor; a per-head one takes its max
        if kind == "kv_scale":
            found[(layer, "k_scale")] = found[(layer, "v_scale")] = scale
        else:
            found[(layer, kind[0] + "_scale")] = scale
