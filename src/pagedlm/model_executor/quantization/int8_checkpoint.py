"""compressed-tensors checkpoints of unpacked int8 weights ("int-quantized", as
llm-compressor saves W8A8 models, and "naive-quantized" int8), loaded as float weights.

Each quantized layer stores ``weight`` int8 [out, in], ``weight_scale`` [out, groups] (one
group per row with the "channel" strategy, one in all with "tensor") and, when asymmetric,
``weight_zero_point`` [out, groups]: ``w[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)]``,
computed exactly in float32 here while the checkpoint streams. The activations' int8
quantization (dynamic per token, or static ``input_scale``) is not applied: the layers
compute on 16-bit activations, which is the checkpoint's model without its activation
rounding; ``quantization="fp8"`` then stores the weights in FP8 to save memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_FORMATS = ("int-quantized", "naive-quantized")
_ACTIVATION_PARTS = (".input_scale", ".input_zero_point")
"""Static activation parameters: not applied (see the module docstring), so dropped."""


@dataclass(frozen=True)
class Int8CheckpointScheme:
    group_size: int
    """Input columns per scale; -1: one per row (or one for the whole tensor)."""
    symmetric: bool
    """No zero points stored (else each layer has ``weight_zero_point``)."""

    @property
    def required_parts(self) -> frozenset[str]:
        parts = {"codes", "weight_scale"}
        return frozenset(parts if self.symmetric else parts | {"weight_zero_point"})


def int8_checkpoint_scheme(hf_config: dict[str, Any]) -> Int8CheckpointScheme | None:
    """The scheme of an unpacked int8 compressed-tensors checkpoint; None for any other
    (the packed and FP8 ones are read by ``int_formats`` and ``fp8_checkpoint``)."""
    config = hf_config.get("quantization_config") or {}
    if config.get("quant_method") != "compressed-tensors" or config.get("format") not in _FORMATS:
        return None
    groups = [group.get("weights") or {} for group in (config.get("config_groups") or {}).values()]
    if not groups or any((w.get("type"), w.get("num_bits")) != ("int", 8) for w in groups):
        return None
    sizes, symmetric = set(), set()
    for weights in groups:
        symmetric.add(weights.get("symmetric", True) is not False)
        strategy = weights.get("strategy") or ("group" if weights.get("group_size") else "tensor")
        if strategy not in ("tensor", "channel", "group"):
            raise ValueError(
                f"This int8 compressed-tensors checkpoint uses {strategy!r} weight scales, "
                "which pagedlm does not read; it reads per-tensor, per-channel and per-group "
                "scales."
            )
        sizes.add(int(weights.get("group_size") or 0) if strategy == "group" else -1)
    if len(sizes) != 1 or len(symmetric) != 1:
        raise ValueError(
            "This int8 compressed-tensors checkpoint mixes weight layouts over its "
            "config_groups; pagedlm reads one layout per checkpoint."
        )
    return Int8CheckpointScheme(sizes.pop(), symmetric.pop())


def dequantize_int8(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: Int8CheckpointScheme
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's stream with each int8 ``<layer>.weight`` joined with its scale (and
    zero point) into float32 weights; other tensors pass as they are, static activation
    scales are dropped."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        layer, _, part = name.rpartition(".")
        if part == "weight" and tensor.dtype == torch.int8:
            part = "codes"
        elif part not in ("weight_scale", "weight_zero_point"):
            if not name.endswith(_ACTIVATION_PARTS):
                yield name, tensor
            continue
        elif part == "weight_zero_point" and scheme.symmetric:
            continue  # zeros, where a symmetric checkpoint stores them at all
        parts = pending.setdefault(layer, {})
        parts[part] = tensor
        if scheme.required_parts <= parts.keys():
            del pending[layer]
            yield f"{layer}.weight", _dequantize(parts, scheme, layer)
    for layer, parts in pending.items():
        missing = sorted(scheme.required_parts - parts.keys())
        raise ValueError(
            f"The int8 checkpoint has {layer}'s {sorted(parts)} but not its {missing}; it is "
            "incomplete."
        )


def _dequantize(
    parts: dict[str, torch.Tensor], scheme: Int8CheckpointScheme, layer: str
) -> torch.Tensor:
    codes = parts["codes"].float()
    out_features, in_features = codes.shape
    stored = parts["weight_scale"].float()
    scale = stored.reshape(out_features if stored.numel() > 1 else 1, -1)
    zero = parts.get("weight_zero_point")
    zero = None if zero is None else zero.float().reshape(scale.shape)
    groups = scale.shape[1]
    if groups == 1:
        column_group = torch.zeros(in_features, dtype=torch.int64)
    else:
        size = scheme.group_size if scheme.group_size > 0 else -(-in_features // groups)
        column_group = torch.arange(in_features) // size
        if int(column_group[-1]) != groups - 1:
            raise ValueError(
                f"{layer}: {groups} weight scales per row do not cover its {in_features} "
                f"input columns in groups of {size}; the checkpoint is damaged."
            )
    scale = scale.expand(out_features, groups)[:, column_group]
    if zero is not None:
        codes = codes - zero.expand(out_features, groups)[:, column_group]
    return codes * scale
