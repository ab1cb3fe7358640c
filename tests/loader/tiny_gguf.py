"""Tiny random HF checkpoints, and the GGUF files llama.cpp's converter would make of them.

One builder for every GGUF test: tensor names, metadata and (llama only) the q/k row
permutation are written the way ``convert_hf_to_gguf`` writes them, independently of
pagedlm's loader, so the tests do not check the loader against itself.
"""

from __future__ import annotations

import re
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
    # Mixture-of-experts routers and shared experts (the experts themselves: _converted).
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
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
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_FLOAT32_STEMS = ("ffn_gate_inp", "ffn_gate_inp_shexp")
"""Tensors the converter always keeps in float32 (expert routers), whatever the file type."""
EXPERT_LAYOUTS = ("stacked", "fused", "split")
"""How a file holds each layer's experts: ``ffn_{gate,up,down}_exps`` [experts, rows, cols]
(the converter's default), gate and up as one ``ffn_gate_up_exps`` (``--fuse-gate-up-exps``),
or one 2-D ``ffn_{gate,up,down}.E`` per expert (early llama.cpp Mixtral files)."""

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


def _converted(
    hf_name: str, array: np.ndarray, arch: str, expert_layout: str
) -> tuple[list[tuple[str, np.ndarray]], Callable[[list[np.ndarray]], np.ndarray]]:
    """The GGUF tensors the converter makes of one HF tensor, and how their (dequantized)
    values make the HF tensor again. transformers stacks a layer's experts as
    ``mlp.experts.gate_up_proj`` [experts, 2 * ff, hidden] (gate rows first) and
    ``mlp.experts.down_proj`` [experts, hidden, ff]; the file holds them as
    ``EXPERT_LAYOUTS`` says."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", hf_name)
    if match is None:
        return [(gguf_name(hf_name, arch), array)], lambda values: values[0]
    layer, projection = match.groups()
    if projection == "down_proj":
        stems = ["ffn_down"]
    else:
        stems = ["ffn_gate_up"] if expert_layout == "fused" else ["ffn_gate", "ffn_up"]
    parts = np.split(array, len(stems), axis=1)
    if expert_layout != "split":
        tensors = [(f"blk.{layer}.{stem}_exps.weight", part) for stem, part in zip(stems, parts)]
        return tensors, lambda values: np.concatenate(values, axis=1)
    experts = array.shape[0]
    tensors = [
        (f"blk.{layer}.{stem}.{expert}.weight", part[expert])
        for stem, part in zip(stems, parts)
        for expert in range(experts)
    ]

    def join(values: list[np.ndarray]) -> np.ndarray:
        stacked = [np.stack(values[i : i + experts]) for i in range(0, len(values), experts)]
        return np.concatenate(stacked, axis=1)

    return tensors, join


def _add_arch_metadata(writer: gguf.GGUFWriter, arch: str, config) -> None:
    """What convert_hf_to_gguf writes for ``arch`` beyond the common keys: expert counts and
    sizes; Gemma 3's local rope base, global rope scaling, window and final soft cap.
    (Gemma 2's and Phi-3's extras come from their tests' ``add_extras``.)"""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
        full = config.rope_parameters["full_attention"]
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)


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
    if qtype_name.endswith("_K"):  # [.., rows, cols] as one matrix of rows
        matrix = array.reshape(-1, array.shape[-1])
        data = k_quant_bytes(matrix, qtype, k_quant_scale).reshape(*array.shape[:-1], -1)
    else:
        data = gguf.quants.quantize(array, qtype)
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
    expert_layout: str = "stacked",
) -> dict[str, torch.Tensor]:
    """Write an HF state dict as a llama.cpp GGUF of architecture ``arch``.

    2-D and 3-D (stacked expert) weights take ``qtype_names`` (one type, or a list the file's
    matrices take in turn, so one file can hold every K-quant); 1-D tensors and expert
    routers stay F32. ``rope_dims`` defaults to the head size; ``tokenizer_pre=None`` writes
    no vocabulary (a weights-only file). ``add_extras`` adds an architecture's own metadata
    and tensors before the weights. K-quants get random blocks with super-block scales
    ``k_quant_scale`` (``k_quant_bytes``). ``expert_layout``: one of ``EXPERT_LAYOUTS``.

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
    rope = config.rope_parameters  # Gemma 3: per layer type; the global layers' base here
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
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
    _add_arch_metadata(writer, arch, config)
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
        tensors, join = _converted(hf_name, array, arch, expert_layout)
        parts = []
        for name, part in tensors:
            matrix = part.ndim >= 2 and name.split(".")[-2] not in _FLOAT32_STEMS
            qtype_name = cycle[matrices % len(cycle)] if matrix else "F32"
            matrices += matrix
            data, part_values = _encode(part, qtype_name, k_quant_scale)
            raw_dtype = None if qtype_name == "F32" else gguf.GGMLQuantizationType[qtype_name]
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
            parts.append(part_values)
        values = join(parts)
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
