"""GGUF metadata beyond the common keys: what each architecture's ``ArchConfig`` needs that
llama.cpp leaves implicit or spells its own way.

Gemma's activation; Gemma 2/3's query scale, logit soft-capping and sliding window (Gemma 3
also its per-layer sliding/full pattern and a second rope base for the local layers);
Phi-3's partial rotary factor and LongRoPE factors, which its file stores as two small
tensors and which become ``rope_scaling`` rather than weights; a mixture-of-experts model's
expert count, top-k, sizes and dense layers. Each function is ``(header, arch_name) ->
{field: value}``, a ``"raw"`` entry going into ``ArchConfig.raw`` (``GGUFArchitecture.extras``).
"""

from __future__ import annotations

from typing import Any

from pagedlm.model_executor.loader.gguf_reader import GGUFHeader, read_gguf_tensor


def _query_pre_attn_scalar(meta: dict[str, Any], arch: str, layers_27b: int) -> float:
    """Gemma 2/3's query scale is ``scalar ** -0.5``. Their GGUFs do not store it (unless as
    ``attention.scale``); llama.cpp hard-codes it the same way: hidden / heads for the 27B
    model (``layers_27b`` layers), head_dim for the others."""
    hidden = int(meta[f"{arch}.embedding_length"])
    heads = int(meta[f"{arch}.attention.head_count"])
    scale = meta.get(f"{arch}.attention.scale")
    if scale:
        return 1.0 / float(scale) ** 2
    if int(meta[f"{arch}.block_count"]) == layers_27b:
        return hidden // heads
    return int(meta.get(f"{arch}.attention.key_length", hidden // heads))


def gemma_extras(header: GGUFHeader, arch: str) -> dict[str, Any]:
    return {"hidden_act": "gelu_pytorch_tanh", "raw": {"hidden_activation": "gelu_pytorch_tanh"}}


def gemma2_extras(header: GGUFHeader, arch: str) -> dict[str, Any]:
    meta = header.metadata
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
        "raw": {
            "hidden_activation": "gelu_pytorch_tanh",
            "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
            "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
            "query_pre_attn_scalar": _query_pre_attn_scalar(meta, arch, layers_27b=46),
        },
    }


def _gemma3_layer_types(meta: dict[str, Any], arch: str) -> list[str]:
    """Sliding or full attention per layer. llama.cpp's converter writes only the window;
    llama.cpp then makes every sixth layer global (an ``attention.sliding_window_pattern``
    says otherwise: every n-th global, or a bool per layer, true for sliding). Without a
    window every layer is global."""
    layers = int(meta[f"{arch}.block_count"])
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if not meta.get(f"{arch}.attention.sliding_window"):
        sliding = [False] * layers
    elif isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [(i + 1) % max(int(pattern), 1) != 0 for i in range(layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def gemma3_extras(header: GGUFHeader, arch: str) -> dict[str, Any]:
    """Global layers rotate with ``rope.freq_base`` (1M) and the file's rope scaling, local
    ones with ``rope.freq_base_swa`` (10k, unscaled: what llama.cpp assumes where the key is
    missing). Ollama-style files spell the bases ``rope.global/local.freq_base``."""
    meta = header.metadata
    base = meta.get(f"{arch}.rope.freq_base", meta.get(f"{arch}.rope.global.freq_base", 1e6))
    local = meta.get(f"{arch}.rope.freq_base_swa", meta.get(f"{arch}.rope.local.freq_base", 1e4))
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": meta.get(f"{arch}.attention.sliding_window") or None,
        "rope_theta": float(base),
        "raw": {
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
            "query_pre_attn_scalar": _query_pre_attn_scalar(meta, arch, layers_27b=62),
            "layer_types": _gemma3_layer_types(meta, arch),
            "rope_local_base_freq": float(local),
        },
    }


_SIGMOID_GATING = 2  # gguf.ExpertGatingFuncType.SIGMOID


def expert_extras(header: GGUFHeader, arch: str, renormalize: bool) -> dict[str, Any]:
    """Expert count, top-k and sizes; a layer without a router (``ffn_gate_inp``) keeps a
    dense MLP. ``renormalize``: whether llama.cpp divides the top-k weights by their sum for
    this architecture (``expert_weights_norm`` overrides it)."""
    meta, tensors = header.metadata, header.tensors
    num_experts, top_k = meta.get(f"{arch}.expert_count"), meta.get(f"{arch}.expert_used_count")
    if not num_experts or not top_k:
        raise ValueError(
            f"{header.path} lacks {arch}.expert_count or {arch}.expert_used_count, which a "
            "mixture-of-experts model needs; re-convert the model."
        )
    if meta.get(f"{arch}.expert_gating_func") == _SIGMOID_GATING:
        raise ValueError(
            f"{header.path} routes its experts with a sigmoid, which {arch} models in pagedlm "
            "never do (softmax); pass the Hugging Face model directory instead."
        )
    layers = range(int(meta[f"{arch}.block_count"]))
    moe_layers = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    first = moe_layers[0] if moe_layers else 0
    down = tensors.get(f"blk.{first}.ffn_down_exps.weight") or tensors.get(
        f"blk.{first}.ffn_down.0.weight"
    )
    moe_size = meta.get(f"{arch}.expert_feed_forward_length") or (
        down.shape[-1] if down is not None else meta[f"{arch}.feed_forward_length"]
    )
    shared = tensors.get("blk.0.ffn_gate_shexp.weight")
    shared_size = meta.get(f"{arch}.expert_shared_feed_forward_length") or (
        shared.shape[0] if shared is not None else 0
    )
    return {
        "raw": {
            "num_experts": int(num_experts),
            "num_local_experts": int(num_experts),
            "num_experts_per_tok": int(top_k),
            "moe_intermediate_size": int(moe_size),
            "shared_expert_intermediate_size": int(shared_size),
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", renormalize)),
            "mlp_only_layers": [i for i in layers if i not in moe_layers],
            "qkv_bias": "blk.0.attn_q.bias" in tensors,
        }
    }


def phi3_extras(header: GGUFHeader, arch: str) -> dict[str, Any]:
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
