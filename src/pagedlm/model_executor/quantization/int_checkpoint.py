"""Pre-quantized integer checkpoints: GPTQ (AutoGPTQ, GPTQModel) and AWQ (AutoAWQ "gemm").

Both store a quantized linear layer as integer codes packed into int32 words, with a float
scale and an integer zero point per group of ``group_size`` input columns:
``w[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)]``. With p = 32 / bits codes per word, slot
j of a word sits at bits ``[j * bits, (j + 1) * bits)``:

| tensor | GPTQ | AWQ (version "gemm", 4 bits) |
| --- | --- | --- |
| ``<layer>.qweight`` | int32 [in / p, out]: word r, slot j is input row r * p + j | int32 [in, out / 8]: word c, slot j is output column 8 c + (0, 2, 4, 6, 1, 3, 5, 7)[j] |
| ``<layer>.qzeros`` | int32 [groups, out / p]: word c, slot j is column c * p + j | int32 [groups, out / 8], ordered as qweight |
| ``<layer>.scales`` | float16 [groups, out] | float16 [groups, out] |
| ``<layer>.g_idx`` | int32 [in]: each input row's group (act-order: not sorted) | absent |

GPTQ's original format (``checkpoint_format`` "gptq" or absent) stores each zero point less
one; GPTQModel's "gptq_v2" stores it as it is. Symmetric checkpoints store the middle code.

A layer whose groups are runs of whole 32-column blocks becomes ``AffineBlocks``: codes,
and per 32 columns the scale and the minimum ``-s * z``, so the GGUF kernels of every
platform compute on it (``loader.block_routing``). That form is exact: ``q * s`` and
``s * z`` are exact in float32 (an 11-bit scale times a code of at most 8 bits) and so is
their difference, ``(q - z) * s``. An act-order layer whose groups interleave, or a group
size that is not a multiple of 32, has no such form; its weight is dequantized.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE, AffineBlocks

INT_CHECKPOINT_METHODS = ("gptq", "awq")
METHOD_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "marlin": "gptq"}
"""vLLM's names for its faster kernels over the same checkpoints."""
PART_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
_AWQ_COLUMN_OF_SLOT = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_SLOT_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class IntCheckpointScheme:
    """How a GPTQ or AWQ checkpoint's layers are stored (its ``quantization_config``)."""

    method: str
    """ "gptq" or "awq"."""
    bits: int
    group_size: int
    """Input columns per scale; -1: one group per row."""
    zeros_less_one: bool = False
    """GPTQ's original format: the stored zero point is the real one less one."""


def _refuse(method: str, what: str) -> ValueError:
    supported = "4- and 8-bit GPTQ ('gptq', 'gptq_v2' formats) and 4-bit AWQ ('gemm')"
    return ValueError(
        f"This {method.upper()} checkpoint uses {what}, which pagedlm does not read; it reads "
        f"{supported}. Use a checkpoint quantized that way, or the float one."
    )


def int_checkpoint_scheme(hf_config: dict[str, Any]) -> IntCheckpointScheme | None:
    """The scheme of a GPTQ or AWQ checkpoint (None for other checkpoints); ``ValueError``
    naming the setting for variants that are not read."""
    config = hf_config.get("quantization_config") or {}
    method = str(config.get("quant_method", "")).lower()
    if method not in INT_CHECKPOINT_METHODS:
        return None
    bits = config.get("bits", config.get("w_bit"))
    group_size = config.get("group_size", config.get("q_group_size", 128))
    if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        raise _refuse(method, f"group_size={group_size!r}")
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
    """A layer from its ``qweight``, ``qzeros``, ``scales`` (and GPTQ's ``g_idx``) tensors."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if scheme.method == "awq":
        codes = _unpack(qweight, 4, dim=1)  # [in, out], slots in AWQ's order
        codes = codes.view(codes.shape[0], -1, 8)[..., list(_AWQ_SLOT_OF_COLUMN)]
        codes = codes.reshape(codes.shape[0], -1)
        zeros = _unpack(qzeros, 4, dim=1)
        zeros = zeros.view(zeros.shape[0], -1, 8)[..., list(_AWQ_SLOT_OF_COLUMN)]
        zeros = zeros.reshape(zeros.shape[0], -1)
    else:
        codes = _unpack(qweight, scheme.bits, dim=0)  # [in, out]
        zeros = _unpack(qzeros, scheme.bits, dim=1)
        if scheme.zeros_less_one:
            zeros = zeros + 1
    in_features, out_features = codes.shape
    groups = scales.shape[0]
    if zeros.shape != (groups, out_features) or scales.shape[1] != out_features:
        raise ValueError(
            f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not describe one {scheme.method.upper()} layer of "
            f"{scheme.bits}-bit codes; the checkpoint does not match its quantization_config."
        )
    if "g_idx" in parts:
        group = parts["g_idx"].to(torch.int64)
    else:
        size = in_features if scheme.group_size == -1 else scheme.group_size
        group = torch.arange(in_features) // size
    if group.shape != (in_features,) or int(group.min()) < 0 or int(group.max()) >= groups:
        raise ValueError(
            f"{name}: g_idx does not give each of the {in_features} input columns one of the "
            f"{groups} groups; the checkpoint is damaged."
        )
    return IntLayer(codes.t().contiguous(), zeros.t().contiguous(), scales.float().t(), group)


def split_part(name: str) -> tuple[str, str] | None:
    """``("<layer>", "qweight")`` for a quantized part's tensor name, else None."""
    for suffix in PART_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix[1:]
    return None


def iter_int_layers(
    scheme: IntCheckpointScheme, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, IntLayer | torch.Tensor]]:
    """The checkpoint stream with each quantized layer's parts joined: (``<layer>.weight``,
    its ``IntLayer``) once its parts have all come (a GPTQ layer's ``g_idx`` too, or the
    end of the stream), every other tensor as it is."""
    needed = {"qweight", "qzeros", "scales"}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        split = split_part(name)
        if split is None:
            yield name, tensor
            continue
        layer, part = split
        parts = pending.setdefault(layer, {})
        parts[part] = tensor
        if needed <= parts.keys() and ("g_idx" in parts or scheme.method == "awq"):
            del pending[layer]
            yield f"{layer}.weight", decode_layer(scheme, parts, layer)
    incomplete = [layer for layer, parts in pending.items() if not needed <= parts.keys()]
    if incomplete:
        raise ValueError(
            f"the checkpoint lacks part of {len(incomplete)} quantized layers (e.g. "
            f"{incomplete[0]}: it has {sorted(pending[incomplete[0]])}); it is incomplete."
        )
    for layer, parts in pending.items():  # GPTQ layers saved without g_idx
        yield f"{layer}.weight", decode_layer(scheme, parts, layer)


def dequantized_weights(
    scheme: IntCheckpointScheme, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with every quantized layer as its float32 weight [out, in]."""
    for name, value in iter_int_layers(scheme, weights):
        yield name, value.dequantize() if isinstance(value, IntLayer) else value


def load_int_checkpoint_keeping_blocks(
    model: torch.nn.Module,
    directory: str,
    scheme: IntCheckpointScheme,
    device: torch.device | None = None,
) -> set[str]:
    """Fill ``model`` from the GPTQ or AWQ checkpoint in ``directory``, keeping each
    quantized layer that has an affine form as blocks (``block_routing.load_keeping_blocks``:
    its float weight is never made; the caller gives it a kernel on them); the others are
    dequantized. Returns the names of the parameters filled."""
    from pagedlm.model_executor.loader.block_routing import load_keeping_blocks
    from pagedlm.model_executor.loader.safetensors_loader import iter_safetensors_weights

    def is_part(name: str) -> bool:
        return split_part(name) is not None

    blocks_by_tensor: dict[str, AffineBlocks] = {}
    dense: dict[str, IntLayer] = {}
    for name, layer in iter_int_layers(scheme, iter_safetensors_weights(directory, select=is_part)):
        assert isinstance(layer, IntLayer)  # only quantized parts were read
        blocks = layer.affine_blocks()
        if blocks is None:
            dense[name] = layer
        else:
            blocks_by_tensor[name] = blocks

    def other_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, layer in dense.items():
            yield name, layer.dequantize()
        yield from iter_safetensors_weights(directory, select=lambda name: not is_part(name))

    return load_keeping_blocks(model, blocks_by_tensor, other_weights, device)


__all__ = [
    "INT_CHECKPOINT_METHODS",
    "METHOD_ALIASES",
    "IntCheckpointScheme",
    "IntLayer",
    "dequantized_weights",
    "int_checkpoint_scheme",
    "iter_int_layers",
    "load_int_checkpoint_keeping_blocks",
]
