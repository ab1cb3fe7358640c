"""Which llama.cpp architectures the GGUF loader accepts, what HF architecture each becomes,
and how its tensor names map onto the HF checkpoint's.

``GGUF_ARCHITECTURES`` holds one ``GGUFArchitecture`` per ``general.architecture``: its
per-layer tensor names, whether its q/k rows are permuted, the norm offset its converter
added, its stacked expert tensors, and the function that reads its metadata beyond the
common keys (``gguf_config_extras``). Phi-3 keeps its fused ``qkv_proj``/``gate_up_proj``
(``Phi3ForCausalLM`` splits them); a llama file with experts is Mixtral.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedlm.model_executor.loader.gguf_config_extras import (
    expert_extras,
    gemma2_extras,
    gemma3_extras,
    gemma_extras,
    phi3_extras,
)
from pagedlm.model_executor.loader.gguf_reader import GGUFHeader

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
            extras=functools.partial(expert_extras, renormalize=True),
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
        "Gemma2ForCausalLM", _GEMMA2_LAYER_TENSORS, norm_offset=1.0, extras=gemma2_extras
    ),
    "phi3": GGUFArchitecture(
        "Phi3ForCausalLM",
        {
            **_LLAMA_LAYER_TENSORS,
            "attn_qkv": "self_attn.qkv_proj",
            "ffn_up": "mlp.gate_up_proj",
        },
        config_tensors=("rope_factors_long.weight", "rope_factors_short.weight"),
        extras=phi3_extras,
    ),
    "qwen2moe": GGUFArchitecture(
        "Qwen2MoeForCausalLM",
        _QWEN_MOE_LAYER_TENSORS,
        extras=functools.partial(expert_extras, renormalize=False),
        expert_tensors=_QWEN_EXPERTS,
    ),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM",
        {**_QWEN_MOE_LAYER_TENSORS, **_QK_NORM_TENSORS},
        config_overrides={"qk_norm": True},
        extras=functools.partial(expert_extras, renormalize=True),
        expert_tensors=_QWEN_EXPERTS,
    ),
    "gemma": GGUFArchitecture(
        "GemmaForCausalLM", _LLAMA_LAYER_TENSORS, norm_offset=1.0, extras=gemma_extras
    ),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM",
        {**_GEMMA2_LAYER_TENSORS, **_QK_NORM_TENSORS},
        norm_offset=1.0,
        extras=gemma3_extras,
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


def hf_tensor_name(gguf_name: str, architecture: str | GGUFArchitecture = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``. (An expert
    tensor holds several HF tensors: ``gguf_experts.hf_entries`` splits it.)"""
    spec = GGUF_ARCHITECTURES[architecture] if isinstance(architecture, str) else architecture
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if suffix in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
        if is_layer_tensor(parts) and len(parts) == 3 and parts[2] in spec.layer_tensors:
            return f"model.layers.{parts[1]}.{spec.layer_tensors[parts[2]]}.{suffix}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no {spec.hf_architecture} equivalent; the file is not "
        "the model its metadata names. Pass the Hugging Face model directory instead."
    )


def is_layer_tensor(parts: list[str]) -> bool:
    """Whether a dot-split tensor name is a layer's: ``blk.{layer}.{stem}...``."""
    return len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit()
