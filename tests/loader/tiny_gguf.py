"""Tiny random HF checkpoints, and the GGUF files llama.cpp's converter would make of them.

One builder for every GGUF test: tensor names, metadata and (llama only) the q/k row
permutation are written the way ``convert_hf_to_gguf`` writes them, independently of
pagedlm's loader, so the tests do not check the loader against itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import gguf
import numpy as np
import torch

# HF parameter name pieces -> llama.cpp tensor names.
_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Where an architecture departs from llama's layer names.
_ARCH_LAYER_NAMES = {
    "gemma2": {
        **_LAYER_NAMES,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {**_LAYER_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}

# Byte offsets of the float16 scale fields (d, and dmin where the type has one) in a K-quant block.
_K_QUANT_SCALE_OFFSETS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight`` (for ``arch``)."""
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)[rest]}.{suffix}"


def interleave_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's llama q/k permutation: rotate-half halves -> interleaved pairs.

    ``weight``: [num_heads * head_dim, ...]; the same shape comes back.
    """
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def deinterleave_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of :func:`interleave_rotary_rows`."""
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def tiny_causal_lm(config_class, model_class, *, seed: int = 0, norm_center: float = 1.0, **fields):
    """A random 2-layer GQA model (4 query heads, 2 KV heads, hidden 64): ``(config, model)``.

    ``fields`` override or extend the config. Norm weights are drawn around ``norm_center``
    (0 for Gemma's ``1 + w`` norms, 1 otherwise) and biases around 0, so a missing or doubled
    offset, or a norm/projection mix-up, cannot hide behind default weights.
    """
    torch.manual_seed(seed)
    defaults = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config = config_class(**{**defaults, **fields})
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(norm_center - 0.5, norm_center + 0.5)
            elif name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
    return config, model


def k_quant_bytes(
    array: np.ndarray, qtype: gguf.GGMLQuantizationType, scale: float = 0.01
) -> np.ndarray:
    """Valid random blocks for a K-quant (gguf cannot quantize these): random codes, small
    positive float16 super-block scales (``scale``), so every dequantized value is finite
    and small (with 0.01: up to about 9.5 for Q4_K, 40 for Q6_K's signed sub-scales).

    ``array``: [rows, cols] with cols a multiple of 256; returns [rows, bytes per row] uint8.
    """
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = array.shape
    rng = np.random.default_rng(cols + rows)
    raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    scale_bytes = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    for offset in _K_QUANT_SCALE_OFFSETS[qtype.name]:
        raw[:, :, offset : offset + 2] = scale_bytes
    return raw.reshape(rows, -1)


def _encode(
    array: np.ndarray, qtype_name: str, k_quant_scale: float = 0.01
) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes or floats to store, float32 values a reader gets back)`` for one tensor."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        data = np.ascontiguousarray(array)
        return data, data
    data = (
        k_quant_bytes(array, qtype, k_quant_scale)
        if qtype_name.endswith("_K")
        else gguf.quants.quantize(array, qtype)
    )
    values = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    return data, values.reshape(array.shape)


def write_gguf(
    path: Path,
    arch: str,
    config,
    state_dict: Mapping[str, torch.Tensor],
    qtype_names: str | Sequence[str] = "F32",
    *,
    rope_dims: int | None = None,
    tokenizer_pre: str | None = "gpt-2",
    add_extras: Callable[[gguf.GGUFWriter], None] | None = None,
    k_quant_scale: float = 0.01,
) -> dict[str, torch.Tensor]:
    """Write an HF state dict as a llama.cpp GGUF of architecture ``arch``.

    2-D weights take ``qtype_names`` (one type, or a list the 2-D weights take in turn, so one
    file can hold every K-quant); 1-D tensors stay F32. ``rope_dims`` defaults to the head
    size; ``tokenizer_pre=None`` writes no vocabulary (a weights-only file). ``add_extras``
    adds an architecture's own metadata and tensors before the weights. K-quants get random
    blocks with super-block scales ``k_quant_scale`` (``k_quant_bytes``).

    Returns the weights the file actually holds, in HF layout and float32 (quantized types
    dequantized, K-quants their random blocks), for exact comparisons.
    """
    cycle = [qtype_names] if isinstance(qtype_names, str) else list(qtype_names)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(rope_dims or head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if tokenizer_pre is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(tokenizer_pre)
        writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
        writer.add_token_merges([])
    if add_extras is not None:
        add_extras(writer)
    held = {}
    matrices = 0
    for hf_name, tensor in state_dict.items():
        array = tensor.detach().float().numpy()
        permuted_heads = None
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            permuted_heads = (
                config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            )
            array = interleave_rotary_rows(array, permuted_heads)
        qtype_name = cycle[matrices % len(cycle)] if array.ndim == 2 else "F32"
        matrices += array.ndim == 2
        data, values = _encode(array, qtype_name, k_quant_scale)
        raw_dtype = None if qtype_name == "F32" else gguf.GGMLQuantizationType[qtype_name]
        writer.add_tensor(gguf_name(hf_name, arch), data, raw_dtype=raw_dtype)
        if permuted_heads is not None:
            values = deinterleave_rotary_rows(values, permuted_heads)
        held[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    finish(writer)
    return held


def finish(writer: gguf.GGUFWriter) -> None:
    """Write out and close a GGUFWriter whose metadata and tensors are all added."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
