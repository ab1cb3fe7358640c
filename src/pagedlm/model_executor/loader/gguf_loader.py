"""GGUF models: map llama.cpp metadata to ``ArchConfig`` and tensors to HF-layout weights.

The container itself (header parsing, reading and dequantizing one tensor) lives in
``gguf_reader``. Here: which llama.cpp architectures we accept, what HF architecture each
becomes, and how its tensor names and layouts differ from the HF checkpoint's.

llama.cpp's converter permutes the q/k rows of *llama* models only (its llama rotary kernel
rotates interleaved pairs); the others use the NeoX rotation, like HF, and are stored as
is. Gemma's converter stores every RMSNorm weight as ``1 + w`` (llama.cpp multiplies by the
stored weight) where HF and ``GemmaRMSNorm`` keep ``w``; the offset is taken off here.
Phi-3 keeps its fused ``qkv_proj``/``gate_up_proj`` (``Phi3ForCausalLM`` splits them) and its
LongRoPE factors as two small tensors, which become ``rope_scaling`` rather than weights.

Mixture-of-experts files (qwen2moe, qwen3moe, and llama files with ``llama.expert_count``:
Mixtral) stack each layer's experts into one ``[experts, out, in]`` tensor per projection
(``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``; gate and up fused into
``ffn_gate_up_exps`` by ``--fuse-gate-up-exps``; one 2-D ``ffn_gate.{e}`` per expert in early
Mixtral files). Quantized blocks run along rows, so every expert's rows are a byte range
of their own: each becomes a 2-D tensor of its own under the HF per-expert name
(``mlp.experts.{e}.gate_proj``), which ``MoEForCausalLM.load_weights`` stacks again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedlm.config import ArchConfig
from pagedlm.model_executor.loader.gguf_reader import (
    GGUFHeader,
    GGUFTensorInfo,
    read_gguf_header,
    read_gguf_tensor,
)

logger = logging.getLogger(__name__)

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
    expert_tensors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Stacked expert stem (``ffn_gate_exps``: ``[experts, out, in]``) -> the HF module path
    of each equal row part of one expert's slice, ``{expert}`` standing for its index
    (``mlp.experts.{expert}.gate_proj``; ``ffn_gate_up_exps`` has two parts)."""
    skipped_prefixes: tuple[str, ...] = ()
    """Name prefixes of tensors not loaded (a Gemma 3 file's own vision tower)."""
    with_experts: GGUFArchitecture | None = None
    """What a file of this architecture with ``{arch}.expert_count`` > 0 is instead (a
    llama file with experts is Mixtral)."""


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


def _gemma_extras(header: GGUFHeader, arch: str) -> dict[str, Any]:
    return {"hidden_act": "gelu_pytorch_tanh", "raw": {"hidden_activation": "gelu_pytorch_tanh"}}


def _gemma2_extras(header: GGUFHeader, arch: str) -> dict[str, Any]:
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


def _gemma3_extras(header: GGUFHeader, arch: str) -> dict[str, Any]:
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


def _expert_extras(header: GGUFHeader, arch: str, renormalize: bool) -> dict[str, Any]:
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


_QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA2_LAYER_TENSORS = {
    **_LLAMA_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QWEN_MOE_LAYER_TENSORS = {
    **_LLAMA_LAYER_TENSORS,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def _expert_paths(prefix: str, gate: str, up: str, down: str) -> dict[str, tuple[str, ...]]:
    expert = f"{prefix}.experts.{{expert}}"
    return {
        "ffn_gate_exps": (f"{expert}.{gate}",),
        "ffn_up_exps": (f"{expert}.{up}",),
        "ffn_down_exps": (f"{expert}.{down}",),
        "ffn_gate_up_exps": (f"{expert}.{gate}", f"{expert}.{up}"),
    }


_QWEN_EXPERTS = _expert_paths("mlp", "gate_proj", "up_proj", "down_proj")

GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture(
        "LlamaForCausalLM",
        _LLAMA_LAYER_TENSORS,
        permuted_qk=True,
        with_experts=GGUFArchitecture(
            "MixtralForCausalLM",
            {**_LLAMA_LAYER_TENSORS, "ffn_gate_inp": "block_sparse_moe.gate"},
            permuted_qk=True,
            extras=functools.partial(_expert_extras, renormalize=True),
            expert_tensors=_expert_paths("block_sparse_moe", "w1", "w3", "w2"),
        ),
    ),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", _LLAMA_LAYER_TENSORS),
    "qwen3": GGUFArchitecture(
        "Qwen3ForCausalLM",
        {**_LLAMA_LAYER_TENSORS, **_QK_NORM_TENSORS},
        config_overrides={"qk_norm": True},
    ),
    "gemma2": GGUFArchitecture(
        "Gemma2ForCausalLM", _GEMMA2_LAYER_TENSORS, norm_offset=1.0, extras=_gemma2_extras
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
    "qwen2moe": GGUFArchitecture(
        "Qwen2MoeForCausalLM",
        _QWEN_MOE_LAYER_TENSORS,
        extras=functools.partial(_expert_extras, renormalize=False),
        expert_tensors=_QWEN_EXPERTS,
    ),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM",
        {**_QWEN_MOE_LAYER_TENSORS, **_QK_NORM_TENSORS},
        config_overrides={"qk_norm": True},
        extras=functools.partial(_expert_extras, renormalize=True),
        expert_tensors=_QWEN_EXPERTS,
    ),
    "gemma": GGUFArchitecture(
        "GemmaForCausalLM", _LLAMA_LAYER_TENSORS, norm_offset=1.0, extras=_gemma_extras
    ),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM",
        {**_GEMMA2_LAYER_TENSORS, **_QK_NORM_TENSORS},
        norm_offset=1.0,
        extras=_gemma3_extras,
        skipped_prefixes=("v.", "mm."),
    ),
}
SUPPORTED_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)


def architecture_of(header: GGUFHeader) -> tuple[str, GGUFArchitecture]:
    """``(general.architecture, how pagedlm loads it)``; a clear error for any other file."""
    arch = header.metadata.get("general.architecture")
    if arch == "clip":
        raise ValueError(
            f"{header.path} is a multimodal projector (mmproj) file: the vision half of a "
            "model llama.cpp converted. pagedlm loads a GGUF's text model only; pass the "
            "model's main .gguf file, or its Hugging Face directory for image input."
        )
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{header.path} holds a {arch!r} model; the GGUF loader supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Pass the original Hugging Face model "
            "directory (config.json + *.safetensors) instead."
        )
    spec = GGUF_ARCHITECTURES[arch]
    if spec.with_experts is not None and header.metadata.get(f"{arch}.expert_count"):
        spec = spec.with_experts
    return arch, spec


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


def hf_tensor_name(gguf_name: str, architecture: str | GGUFArchitecture = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``. (An expert
    tensor holds several HF tensors: ``iter_gguf_entries`` splits it.)"""
    spec = GGUF_ARCHITECTURES[architecture] if isinstance(architecture, str) else architecture
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if suffix in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
        if _is_layer_tensor(parts) and len(parts) == 3 and parts[2] in spec.layer_tensors:
            return f"model.layers.{parts[1]}.{spec.layer_tensors[parts[2]]}.{suffix}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no {spec.hf_architecture} equivalent; the file is not "
        "the model its metadata names. Pass the Hugging Face model directory instead."
    )


def _is_layer_tensor(parts: list[str]) -> bool:
    return len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit()


def _hf_entries(
    info: GGUFTensorInfo, spec: GGUFArchitecture
) -> Iterator[tuple[str, GGUFTensorInfo]]:
    """``(hf_name, info)`` for the HF tensors one file tensor holds: itself, or each
    expert's part of a stacked ``[experts, rows, cols]`` tensor (or of an early Mixtral
    file's ``blk.N.ffn_gate.E``) as a 2-D tensor of its own. Quantized blocks run along
    rows, so every expert's rows, and each equal row part of them (a fused gate/up), are a
    byte range of the file."""
    import gguf

    parts = info.name.split(".")
    stem = parts[2] if _is_layer_tensor(parts) else ""
    if len(parts) == 5 and parts[3].isdigit() and f"{stem}_exps" in spec.expert_tensors:
        (path,) = spec.expert_tensors[f"{stem}_exps"]
        yield f"model.layers.{parts[1]}.{path.format(expert=parts[3])}.{parts[4]}", info
        return
    if stem not in spec.expert_tensors:
        yield hf_tensor_name(info.name, spec), info
        return
    paths = spec.expert_tensors[stem]
    if len(info.shape) != 3 or info.shape[1] % len(paths):
        raise ValueError(
            f"{info.name} has shape {info.shape}, not [experts, rows, columns]; re-convert "
            "the model."
        )
    num_experts, rows, cols = info.shape
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
    row_bytes = cols // block_size * type_size
    part_rows = rows // len(paths)
    for expert in range(num_experts):
        for index, path in enumerate(paths):
            offset = info.offset + (expert * rows + index * part_rows) * row_bytes
            yield (
                f"model.layers.{parts[1]}.{path.format(expert=expert)}.{parts[-1]}",
                replace(info, shape=(part_rows, cols), offset=offset),
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

        for name, part in _hf_entries(info, spec):
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
