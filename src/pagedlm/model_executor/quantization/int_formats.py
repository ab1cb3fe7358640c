"""The layouts of integer weight-only checkpoints: GPTQ (AutoGPTQ, GPTQModel), AWQ (AutoAWQ
"gemm") and compressed-tensors "pack-quantized" (llm-compressor's W4A16 / W8A16).

Each stores a quantized linear layer as integer codes packed into int32 words, with a
float scale and an integer zero point per group of ``group_size`` input columns:
``w[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)]``. With p = 32 / bits codes per word, slot
j of a word sits at bits ``[j * bits, (j + 1) * bits)``:

| part | GPTQ | AWQ (4 bits) | compressed-tensors |
| --- | --- | --- | --- |
| codes | ``qweight`` int32 [in / p, out]: word r, slot j is input row r p + j | ``qweight`` int32 [in, out / 8]: word c, slot j is output column 8 c + (0, 2, 4, 6, 1, 3, 5, 7)[j] | ``weight_packed`` int32 [out, in / p]: word c, slot j is input column c p + j |
| zero points | ``qzeros`` int32 [groups, out / p], word c slot j is column c p + j | ``qzeros`` [groups, out / 8], ordered as qweight | ``weight_zero_point`` int32 [out / p, groups], word r slot j is row r p + j; absent when symmetric: 2^(bits-1) |
| scales | ``scales`` [groups, out] | ``scales`` [groups, out] | ``weight_scale`` [out, groups] |
| groups | ``g_idx`` int32 [in] (act-order: not sorted) | consecutive | ``weight_g_idx`` [in] with act-order, else consecutive |

GPTQ's original format (``checkpoint_format`` "gptq" or absent) stores each zero point less
one; GPTQModel's "gptq_v2" stores it as it is. compressed-tensors stores codes and zero
points as signed values plus 2^(bits-1), which cancels in ``q - z``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedlm.config import INT_CHECKPOINT_METHODS
from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE, AffineBlocks

METHOD_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "marlin": "gptq"}
"""vLLM's names for its faster kernels over the same checkpoints."""
_AWQ_SLOT_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]
"""Inverse of AutoAWQ's packing order (slot j holds column (0, 2, 4, 6, 1, 3, 5, 7)[j])."""
_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": (
        "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class IntCheckpointScheme:
    """How a checkpoint's quantized layers are stored (its ``quantization_config``)."""

    method: str
    """ "gptq", "awq" or "compressed-tensors"."""
    bits: int
    group_size: int
    """Input columns per scale; -1: one group per row."""
    zeros_less_one: bool = False
    """GPTQ's original format: the stored zero point is the real one less one."""
    symmetric: bool = False
    """compressed-tensors without stored zero points."""
    act_order: bool = False
    """compressed-tensors with a ``weight_g_idx`` per layer."""

    def split_part(self, name: str) -> tuple[str, str] | None:
        """``("<layer>", "<part>")`` for a tensor that is part of a quantized layer, else
        None (``weight_scale`` belongs to a layer only beside ``weight_packed``)."""
        layer, _, part = name.rpartition(".")
        return (layer, part) if layer and part in _PARTS[self.method] else None

    def required_parts(self) -> set[str]:
        """The parts a layer is waited for until (GPTQ's ``g_idx``: or the stream's end)."""
        if self.method != "compressed-tensors":
            return set(_PARTS[self.method])
        required = {"weight_packed", "weight_scale", "weight_shape"}
        required |= set() if self.symmetric else {"weight_zero_point"}
        return required | ({"weight_g_idx"} if self.act_order else set())


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(
        f"This {method} checkpoint uses {what}, which pagedlm does not read; it reads 4- and "
        "8-bit GPTQ ('gptq', 'gptq_v2' formats), 4-bit AWQ ('gemm') and compressed-tensors "
        "'pack-quantized' 4- and 8-bit integer weights (W4A16, W8A16). Use a checkpoint "
        "quantized that way, or the float one."
    )


def int_checkpoint_scheme(hf_config: dict[str, Any]) -> IntCheckpointScheme | None:
    """The scheme of a GPTQ, AWQ or integer compressed-tensors checkpoint (None for other
    ones); ``ValueError`` naming the setting for variants that are not read."""
    config = hf_config.get("quantization_config") or {}
    method = str(config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    if method not in ("gptq", "awq"):
        return None
    bits = config.get("bits", config.get("w_bit"))
    group_size = config.get("group_size", config.get("q_group_size", 128))
    _check_group_size(method, group_size)
    if method == "gptq":
        if bits not in (4, 8):
            raise _refuse(method, f"{bits}-bit codes")
        checkpoint_format = config.get("checkpoint_format") or "gptq"
        if checkpoint_format not in ("gptq", "gptq_v2") or config.get("is_marlin_format"):
            raise _refuse(method, f"checkpoint_format={checkpoint_format!r}")
        return IntCheckpointScheme("gptq", bits, group_size, checkpoint_format == "gptq")
    version = str(config.get("version", "gemm")).lower()
    if bits != 4:
        raise _refuse(method, f"{bits}-bit codes")
    if version != "gemm":
        raise _refuse(method, f"version={version!r}")
    if not config.get("zero_point", True):
        raise _refuse(method, "zero_point=false")
    return IntCheckpointScheme("awq", 4, group_size)


def _check_group_size(method: str, group_size: Any) -> None:
    if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        raise _refuse(method, f"group_size={group_size!r}")


def _compressed_tensors_scheme(config: dict[str, Any]) -> IntCheckpointScheme | None:
    """The integer weight-only scheme of a "pack-quantized" checkpoint; None for the other
    formats (FP8 ones are ``fp8_checkpoint``'s)."""
    if config.get("format") != "pack-quantized":
        return None
    method = "compressed-tensors"
    schemes = set()
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if group.get("input_activations") is not None:
            raise _refuse(method, "quantized activations")
        if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
            raise _refuse(method, f"{weights.get('num_bits')}-bit {weights.get('type')} weights")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise _refuse(method, f"{strategy!r} weight scales")
        group_size = weights.get("group_size") if strategy == "group" else -1
        _check_group_size(method, group_size)
        act_order = weights.get("actorder") not in (None, False, "static")
        schemes.add((weights["num_bits"], group_size, bool(weights.get("symmetric")), act_order))
    if len(schemes) != 1:
        raise _refuse(method, f"{len(schemes)} different weight schemes in config_groups")
    bits, group_size, symmetric, act_order = schemes.pop()
    return IntCheckpointScheme(method, bits, group_size, symmetric=symmetric, act_order=act_order)


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int16 codes, each word's 32 / bits slots spread along ``dim`` in
    slot order (dim 0: [R, C] -> [R * p, C]; dim 1: [R, C] -> [R, C * p])."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    words = words.to(torch.int32)
    if dim == 0:
        codes = (words[:, None, :] >> shifts[None, :, None]) & mask
        return codes.reshape(-1, words.shape[1]).to(torch.int16)
    codes = (words[:, :, None] >> shifts[None, None, :]) & mask
    return codes.reshape(words.shape[0], -1).to(torch.int16)


@dataclass(frozen=True)
class IntLayer:
    """One layer's codes, zero points and scales, unpacked: ``w[o, i] = (codes[o, i] -
    zeros[o, group[i]]) * scales[o, group[i]]``."""

    codes: torch.Tensor
    """int16 [out, in]."""
    zeros: torch.Tensor
    """int16 [out, groups]."""
    scales: torch.Tensor
    """float32 [out, groups]."""
    group: torch.Tensor
    """int64 [in]: each input column's group."""

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        codes = self.codes.float()
        zeros, scales = self.zeros.float()[:, self.group], self.scales[:, self.group]
        return (codes - zeros) * scales

    def affine_blocks(self) -> AffineBlocks | None:
        """The layer as codes with a scale and a minimum per 32 columns, or None where its
        groups are not runs of whole 32-column blocks."""
        if self.codes.shape[1] % GROUP_SIZE:
            return None
        block_groups = self.group.view(-1, GROUP_SIZE)
        if not torch.equal(block_groups, block_groups[:, :1].expand_as(block_groups)):
            return None
        first = block_groups[:, 0]
        scales = self.scales[:, first].contiguous()
        mins = (-self.zeros.float()[:, first] * scales).contiguous()
        return AffineBlocks(self.codes.to(torch.uint8), scales, mins)


def decode_layer(
    scheme: IntCheckpointScheme, parts: dict[str, torch.Tensor], name: str
) -> IntLayer:
    """A layer from its parts (``IntCheckpointScheme.split_part``'s names)."""
    codes, zeros, scales = _DECODERS[scheme.method](scheme, parts)  # [out, in], [out, groups]
    out_features, in_features = codes.shape
    groups = scales.shape[1]
    if zeros.shape != (out_features, groups) or scales.shape[0] != out_features:
        shapes = ", ".join(f"{part} {tuple(tensor.shape)}" for part, tensor in parts.items())
        raise ValueError(
            f"{name}: {shapes} do not describe one {scheme.method} layer of {scheme.bits}-bit "
            "codes; the checkpoint does not match its quantization_config."
        )
    g_idx = parts.get("g_idx", parts.get("weight_g_idx"))
    if g_idx is not None:
        group = g_idx.to(torch.int64)
    else:
        size = in_features if scheme.group_size == -1 else scheme.group_size
        group = torch.arange(in_features) // size
    if group.shape != (in_features,) or int(group.min()) < 0 or int(group.max()) >= groups:
        raise ValueError(
            f"{name}: its group index does not give each of the {in_features} input columns "
            f"one of the {groups} groups; the checkpoint is damaged."
        )
    return IntLayer(codes.contiguous(), zeros.contiguous(), scales.float(), group)


Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _gptq(scheme: IntCheckpointScheme, parts: dict[str, torch.Tensor]) -> Decoded:
    codes = _unpack(parts["qweight"], scheme.bits, dim=0)  # [in, out]
    zeros = _unpack(parts["qzeros"], scheme.bits, dim=1)  # [groups, out]
    if scheme.zeros_less_one:
        zeros = zeros + 1
    return codes.t(), zeros.t(), parts["scales"].t()


def _awq(scheme: IntCheckpointScheme, parts: dict[str, torch.Tensor]) -> Decoded:
    def unpack(words: torch.Tensor) -> torch.Tensor:
        values = _unpack(words, 4, dim=1)  # slots in AutoAWQ's order
        return values.view(values.shape[0], -1, 8)[..., _AWQ_SLOT_OF_COLUMN].flatten(1)

    return unpack(parts["qweight"]).t(), unpack(parts["qzeros"]).t(), parts["scales"].t()


def _compressed_tensors(scheme: IntCheckpointScheme, parts: dict[str, torch.Tensor]) -> Decoded:
    out_features, in_features = (int(v) for v in parts["weight_shape"].tolist())
    codes = _unpack(parts["weight_packed"], scheme.bits, dim=1)[:, :in_features]
    scales = parts["weight_scale"].reshape(out_features, -1)
    if "weight_zero_point" in parts:
        zeros = _unpack(parts["weight_zero_point"], scheme.bits, dim=0)[:out_features]
    else:
        zeros = torch.full(scales.shape, 1 << (scheme.bits - 1), dtype=torch.int16)
    return codes, zeros, scales


_DECODERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}


__all__ = [
    "INT_CHECKPOINT_METHODS",
    "METHOD_ALIASES",
    "IntCheckpointScheme",
    "IntLayer",
    "decode_layer",
    "int_checkpoint_scheme",
]
