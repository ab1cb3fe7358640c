"""GGUF models: map llama.cpp metadata to ``ArchConfig`` and tensors to HF-layout weights.

The container itself (header parsing, reading and dequantizing one tensor) lives in
``gguf_reader``; which architectures are accepted and how their names map, in
``gguf_architectures`` (their extra metadata in ``gguf_config_extras``); stacked expert
tensors are cut per expert in ``gguf_experts``. Here: the entry points, which read the
common metadata keys into ``ArchConfig`` and yield the tensors in file order, their layouts
fixed.

llama.cpp's converter permutes the q/k rows of *llama* models only (its llama rotary kernel
rotates interleaved pairs); the others use the NeoX rotation, like HF, and are stored as
is. Gemma's converter stores every RMSNorm weight as ``1 + w`` (llama.cpp multiplies by the
stored weight) where HF and ``GemmaRMSNorm`` keep ``w``; the offset is taken off here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pagedlm.config import ArchConfig
from pagedlm.model_executor.loader.gguf_architectures import (
    GGUF_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    GGUFArchitecture,
    architecture_of,
    hf_tensor_name,
)
from pagedlm.model_executor.loader.gguf_experts import hf_entries
from pagedlm.model_executor.loader.gguf_reader import (
    GGUFHeader,
    GGUFTensorInfo,
    read_gguf_header,
    read_gguf_tensor,
)

logger = logging.getLogger(__name__)


def _rope_scaling(meta: dict[str, Any], prefix: str, path: str) -> dict[str, Any] | None:
    kind = meta.get(f"{prefix}.rope.scaling.type", "none")
    factor = meta.get(f"{prefix}.rope.scaling.factor")
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        # llama.cpp falls back to the training context where the file names no original.
        original = meta.get(f"{prefix}.rope.scaling.original_context_length") or meta.get(
            f"{prefix}.context_length"
        )
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": original,
        }
    raise ValueError(f"{path} uses rope scaling {kind!r}; supported: 'linear', 'yarn'.")


def gguf_arch_config(path: str) -> ArchConfig:
    """The model shape from a GGUF's metadata (reads only the header)."""
    header = read_gguf_header(path)
    arch, spec = architecture_of(header)
    meta = header.metadata

    def require(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(
                f"{path} lacks the GGUF metadata key {arch}.{key}; re-convert the model."
            )
        return meta[f"{arch}.{key}"]

    if "rope_freqs.weight" in header.tensors:
        raise ValueError(
            f"{path} uses Llama-3 style rope frequency scaling (rope_freqs.weight), which the GGUF "
            "loader does not support yet; pass the Hugging Face model directory instead."
        )
    hidden = int(require("embedding_length"))
    num_heads = int(require("attention.head_count"))
    num_kv_heads = meta.get(f"{arch}.attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ValueError(f"{path} has a per-layer KV head count, which {arch} models never use.")
    vocab_size = meta.get(f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if tokens else header.tensors["token_embd.weight"].shape[0]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    # llama.cpp stops on end-of-turn as well as end-of-sequence; keep both when they differ.
    eos_ids: int | list[int] | None = [eos, eot] if None not in (eos, eot) and eos != eot else eos
    fields: dict[str, Any] = dict(
        architecture=spec.hf_architecture,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        num_hidden_layers=int(require("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv_heads),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // num_heads)),
        intermediate_size=int(require("feed_forward_length")),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, path),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        torch_dtype=None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos_ids,
        raw={key: value for key, value in meta.items() if not isinstance(value, list)},
    )
    fields["raw"]["tie_word_embeddings"] = fields["tie_word_embeddings"]
    skipped = [name for name in header.tensors if name.startswith(spec.skipped_prefixes)]
    if skipped:
        logger.info("%s: %d vision tensors left out (text only).", path, len(skipped))
    extras = dict(spec.extras(header, arch)) if spec.extras is not None else {}
    fields["raw"].update(extras.pop("raw", {}))
    return ArchConfig(**{**fields, **extras, **spec.config_overrides})


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    ``convert_hf_to_gguf`` reorders each head's rows from HF's rotate-half layout
    (``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]``) into interleaved pairs (``[x_0, y_0, x_1, y_1, ..]``)
    for llama.cpp's rotary kernel. ``weight``: ``[num_heads * head_dim, ...]`` (weight or bias);
    returns the same shape in HF order.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"Cannot split {rows} rows into {num_heads} heads of even size.")
    paired = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return paired.transpose(1, 2).reshape(weight.shape)


RowFix = Callable[[torch.Tensor], torch.Tensor]
"""Reorders the rows of a tensor read from the file into HF order (any trailing shape)."""


def _no_fix(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _as_row(tensor: torch.Tensor) -> torch.Tensor:
    """A shared-expert gate as its [1, hidden] weight (older converters squeezed it)."""
    return tensor.reshape(1, -1) if tensor.dim() == 1 else tensor


def iter_gguf_entries(
    header: GGUFHeader, arch: ArchConfig
) -> Iterator[tuple[str, GGUFTensorInfo, RowFix]]:
    """``(hf_name, info, fix_rows)`` for every weight tensor of the file, in file order.

    ``fix_rows`` undoes llama's q/k row permutation (with ``arch.num_attention_heads`` /
    ``arch.num_key_value_heads``) and is the identity elsewhere; it applies to anything
    with one row per weight row (values, quantization codes, per-row block scales).
    Configuration tensors (Phi-3's rope factors) and a Gemma 3 file's vision tower are
    skipped. A stacked expert tensor comes as one 2-D entry per expert (``info`` then
    describes that expert's byte range).
    """
    _, spec = architecture_of(header)
    heads = {"attn_q": arch.num_attention_heads, "attn_k": arch.num_key_value_heads}
    for info in header.tensors.values():
        if info.name in spec.config_tensors or info.name.startswith(spec.skipped_prefixes):
            continue
        kind = info.name.split(".")[-2]
        fix: RowFix = _as_row if kind == "ffn_gate_inp_shexp" else _no_fix
        if spec.permuted_qk and info.name.startswith("blk.") and kind in heads:
            num_heads = heads[kind]

            def fix(tensor: torch.Tensor, num_heads: int = num_heads) -> torch.Tensor:
                return unpermute_rotary_rows(tensor, num_heads)

        for name, part in hf_entries(info, spec):
            yield name, part, fix


def iter_gguf_weights(path: str, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` in HF layout, one tensor at a time, in file order.

    Quantized tensors are dequantized; rows are fixed as ``iter_gguf_entries`` says; Gemma
    norms lose their +1. ``lm_head.weight`` appears only when the file has an
    ``output.weight`` (otherwise the embeddings are tied).
    """
    header = read_gguf_header(path)
    _, spec = architecture_of(header)
    with open(path, "rb", buffering=0) as file:
        for name, info, fix_rows in iter_gguf_entries(header, arch):
            tensor = fix_rows(read_gguf_tensor(file, info, path))
            yield name, offset_norm(tensor, info, spec.norm_offset)
            del tensor


def offset_norm(tensor: torch.Tensor, info: GGUFTensorInfo, norm_offset: float) -> torch.Tensor:
    """A norm weight without the ``norm_offset`` its converter added (Gemma's 1); any other
    tensor as it is."""
    if norm_offset and info.name.split(".")[-2].endswith("norm"):
        return tensor - norm_offset
    return tensor


__all__ = [
    "GGUF_ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "GGUFArchitecture",
    "GGUFHeader",
    "GGUFTensorInfo",
    "architecture_of",
    "gguf_arch_config",
    "hf_tensor_name",
    "iter_gguf_entries",
    "iter_gguf_weights",
    "offset_norm",
    "read_gguf_header",
    "unpermute_rotary_rows",
]
