"""GGUF models: map llama.cpp metadata to ``ArchConfig`` and tensors to HF-layout weights.

The container itself (header parsing, reading and dequantizing one tensor) lives in
``gguf_reader``. Here: which llama.cpp architectures we accept, what HF architecture each
becomes, and how its tensor names and layouts differ from the HF checkpoint's.

llama.cpp's converter permutes the q/k rows of *llama* models only (its llama rotary kernel
rotates interleaved pairs); qwen2/qwen3/gemma2/phi3 use the NeoX rotation, like HF, and are
stored as is. Gemma's converter stores every RMSNorm weight as ``1 + w`` (llama.cpp multiplies
by the stored weight) where HF and ``GemmaRMSNorm`` keep ``w``; the offset is taken off here.
Phi-3 keeps its fused ``qkv_proj``/``gate_up_proj`` (``Phi3ForCausalLM`` splits them) and its
LongRoPE factors as two small tensors, which become ``rope_scaling`` rather than weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedlm.config import ArchConfig
from pagedlm.model_executor.loader.gguf_reader import (
    GGUFHeader,
    GGUFTensorInfo,
    read_gguf_header,
    read_gguf_tensor,
)

# llama.cpp tensor name -> HF name (without the ".weight"/".bias" suffix).
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp ``general.architecture`` maps onto a pagedlm / HF architecture."""

    hf_architecture: str
    layer_tensors: dict[str, str]
    """llama.cpp per-layer tensor stem (``attn_q``) -> HF module path (``self_attn.q_proj``)."""
    permuted_qk: bool = False
    """Whether the converter interleaved q/k rows (undone with ``unpermute_rotary_rows``)."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """ArchConfig fields that follow from the architecture rather than the metadata."""
    norm_offset: float = 0.0
    """What the converter added to every norm weight (Gemma: 1.0); subtracted on load."""
    config_tensors: tuple[str, ...] = ()
    """Tensors that are configuration, not weights (Phi-3's rope factors); never yielded."""
    extras: Callable[[GGUFHeader, str], dict[str, Any]] | None = None
    """``(header, arch_name) -> {field: value}`` for metadata beyond the common keys; a
    ``"raw"`` entry is merged into ``ArchConfig.raw`` (where model code reads its extras)."""


def _gemma2_extras(header: GGUFHeader, arch: str) -> dict[str, Any]:
    meta = header.metadata
    hidden = int(meta[f"{arch}.embedding_length"])
    heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    scale = meta.get(f"{arch}.attention.scale")
    if scale:
        scalar = 1.0 / float(scale) ** 2
    else:
        # Gemma 2 GGUFs do not store the query scale; llama.cpp hard-codes it the same way:
        # hidden / heads for the 27B model (46 layers), head_dim for the others.
        scalar = hidden // heads if int(meta[f"{arch}.block_count"]) == 46 else head_dim
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
        "raw": {
            "hidden_activation": "gelu_pytorch_tanh",
            "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
            "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
            "query_pre_attn_scalar": scalar,
        },
    }


def _phi3_extras(header: GGUFHeader, arch: str) -> dict[str, Any]:
    meta = header.metadata
    hidden = int(meta[f"{arch}.embedding_length"])
    head_dim = int(
        meta.get(f"{arch}.attention.key_length", hidden // meta[f"{arch}.attention.head_count"])
    )
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    raw: dict[str, Any] = {"partial_rotary_factor": rotary_dim / head_dim}
    extras: dict[str, Any] = {
        "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
        "raw": raw,
    }
    if original is not None:
        raw["original_max_position_embeddings"] = int(original)
    factors = ("rope_factors_long", "rope_factors_short")
    present = [f"{name}.weight" in header.tensors for name in factors]
    if any(present):
        if not all(present) or original is None:
            raise ValueError(
                f"{header.path} has incomplete LongRoPE data (needs rope_factors_long, "
                f"rope_factors_short and {arch}.rope.scaling.original_context_length); "
                "re-convert the model."
            )
        with open(header.path, "rb", buffering=0) as file:
            long, short = (
                read_gguf_tensor(file, header.tensors[f"{name}.weight"], header.path).tolist()
                for name in factors
            )
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": long,
            "short_factor": short,
            "original_max_position_embeddings": int(original),
        }
        attention_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
        if attention_factor is not None:
            scaling["attention_factor"] = float(attention_factor)
        extras["rope_scaling"] = scaling
    return extras


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", _LLAMA_LAYER_TENSORS, permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", _LLAMA_LAYER_TENSORS),
    "qwen3": GGUFArchitecture(
        "Qwen3ForCausalLM",
        {
            **_LLAMA_LAYER_TENSORS,
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
        },
        config_overrides={"qk_norm": True},
    ),
    "gemma2": GGUFArchitecture(
        "Gemma2ForCausalLM",
        {
            **_LLAMA_LAYER_TENSORS,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norm_offset=1.0,
        extras=_gemma2_extras,
    ),
    "phi3": GGUFArchitecture(
        "Phi3ForCausalLM",
        {
            **_LLAMA_LAYER_TENSORS,
            "attn_qkv": "self_attn.qkv_proj",
            "ffn_up": "mlp.gate_up_proj",
        },
        config_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
        extras=_phi3_extras,
    ),
}
SUPPORTED_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)


def _check_architecture(header: GGUFHeader) -> str:
    arch = header.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{header.path} holds a {arch!r} model; the GGUF loader supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Pass the original Hugging Face model "
            "directory (config.json + *.safetensors) instead."
        )
    return arch


def _rope_scaling(meta: dict[str, Any], prefix: str, path: str) -> dict[str, Any] | None:
    kind = meta.get(f"{prefix}.rope.scaling.type", "none")
    factor = meta.get(f"{prefix}.rope.scaling.factor")
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = meta.get(f"{prefix}.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": original,
        }
    raise ValueError(f"{path} uses rope scaling {kind!r}; supported: 'linear', 'yarn'.")


def gguf_arch_config(path: str) -> ArchConfig:
    """The model shape from a GGUF's metadata (reads only the header)."""
    header = read_gguf_header(path)
    arch = _check_architecture(header)
    spec = GGUF_ARCHITECTURES[arch]
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
    extras = dict(spec.extras(header, arch)) if spec.extras is not None else {}
    fields["raw"].update(extras.pop("raw", {}))
    return ArchConfig(**{**fields, **extras, **spec.config_overrides})


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    layer_tensors = GGUF_ARCHITECTURES[architecture].layer_tensors
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
        parts = stem.split(".")
        if (
            len(parts) == 3
            and parts[0] == "blk"
            and parts[1].isdigit()
            and parts[2] in layer_tensors
        ):
            return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{suffix}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no {architecture} equivalent; is this really a "
        f"{architecture} model?"
    )


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


def iter_gguf_entries(
    header: GGUFHeader, arch: ArchConfig
) -> Iterator[tuple[str, GGUFTensorInfo, RowFix]]:
    """``(hf_name, info, fix_rows)`` for every weight tensor of the file, in file order.

    ``fix_rows`` undoes llama's q/k row permutation (with ``arch.num_attention_heads`` /
    ``arch.num_key_value_heads``) and is the identity elsewhere; it applies to anything
    with one row per weight row (values, quantization codes, per-row block scales).
    Configuration tensors (Phi-3's rope factors) are skipped.
    """
    architecture = _check_architecture(header)
    spec = GGUF_ARCHITECTURES[architecture]
    heads = {"attn_q": arch.num_attention_heads, "attn_k": arch.num_key_value_heads}
    for info in header.tensors.values():
        if info.name in spec.config_tensors:
            continue
        kind = info.name.split(".")[-2]
        fix: RowFix = _no_fix
        if spec.permuted_qk and info.name.startswith("blk.") and kind in heads:
            num_heads = heads[kind]

            def fix(tensor: torch.Tensor, num_heads: int = num_heads) -> torch.Tensor:
                return unpermute_rotary_rows(tensor, num_heads)

        yield hf_tensor_name(info.name, architecture), info, fix


def iter_gguf_weights(path: str, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` in HF layout, one tensor at a time, in file order.

    Quantized tensors are dequantized; rows are fixed as ``iter_gguf_entries`` says; Gemma
    norms lose their +1. ``lm_head.weight`` appears only when the file has an
    ``output.weight`` (otherwise the embeddings are tied).
    """
    header = read_gguf_header(path)
    spec = GGUF_ARCHITECTURES[_check_architecture(header)]
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
    "gguf_arch_config",
    "hf_tensor_name",
    "iter_gguf_entries",
    "iter_gguf_weights",
    "offset_norm",
    "read_gguf_header",
    "unpermute_rotary_rows",
]
