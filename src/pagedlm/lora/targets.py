"""Which linear layers of a model take LoRA adapters, and how PEFT's names map onto them.

PEFT names the projections as Hugging Face models have them (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``; Phi-3 checkpoints fuse
``qkv_proj`` and ``gate_up_proj``). pagedlm's models fuse q/k/v and gate/up into one layer
each, so an adapter of ``q_proj`` is *slice* 0 of the model's ``qkv_proj``; an adapter of a
fused HF module covers every slice of it. The model class's ``stacked_params`` already says
which HF projection is which slice; this module reads it, so no model knows about LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.config import ArchConfig

_BERT_REASON = "BERT's query/key/value and dense projections"
UNSUPPORTED_ARCHITECTURES = {
    "GPT2LMHeadModel": "GPT-2's Conv1D projections (c_attn, c_proj, c_fc)",
    "GPTNeoXForCausalLM": "GPT-NeoX's query_key_value, which interleaves q, k and v per head",
    **dict.fromkeys(
        ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
        "DeepSeek's latent-attention projections, whose shapes are not q/k/v's",
    ),
    **dict.fromkeys(
        (
            "BertModel",
            "BertForSequenceClassification",
            "RobertaModel",
            "XLMRobertaModel",
            "RobertaForSequenceClassification",
            "XLMRobertaForSequenceClassification",
        ),
        _BERT_REASON,
    ),
}
MOE_ARCHITECTURES = frozenset(
    {"MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "GptOssForCausalLM"}
)

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
MOE_MODULE_NAMES = ("experts", "block_sparse_moe", "w1", "w2", "w3")


def check_lora_architecture(arch: ArchConfig) -> None:
    """Refuse ``enable_lora`` for a model whose layers adapters cannot target."""
    reason = UNSUPPORTED_ARCHITECTURES.get(arch.architecture)
    if reason is not None:
        raise ValueError(
            f"enable_lora does not support {arch.architecture} ({reason}); LoRA serves "
            "Llama-family models (Llama, Mistral, Qwen2/3, Phi-3, Gemma, Granite, OLMo, the "
            "attention of the MoE models), Phi-1/2, StableLM, StarCoder2 and Cohere."
        )


def module_shapes(arch: ArchConfig, model_impl: str = "vllm") -> dict[str, tuple[int, int]]:
    """HF projection name -> (in_features, out_features) of the whole (unsharded) layer,
    for the projections this architecture has (``adaptable_modules``). On the Transformers
    backend (``model_impl="transformers"``) the layers are transformers' own, one per
    projection, and their sizes are read from them."""
    shapes = _model_modules(arch, model_impl)
    if model_impl == "transformers":
        return dict(shapes)
    return {name: shape for name, shape in _shapes(arch).items() if name in shapes}


_MODULES: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
"""``(repr(arch), model_impl)`` -> ``_model_modules`` (an ``ArchConfig`` holds a dict:
unhashable)."""


def adaptable_modules(arch: ArchConfig, model_impl: str = "vllm") -> frozenset[str]:
    """The projection names an adapter may target in this architecture: its linear layers'
    own and the HF names its merged layers hold (``q_proj`` of ``qkv_proj``), found once
    per configuration by building the model on the meta device."""
    return frozenset(_model_modules(arch, model_impl))


def _model_modules(arch: ArchConfig, model_impl: str) -> dict[str, tuple[int, int]]:
    """Projection name -> the whole layer's (in, out) features (a merged layer's: the
    native shapes come from ``_shapes``), from the model built on the meta device."""
    key = (repr(arch), model_impl)
    if key not in _MODULES:
        import torch

        from pagedlm.model_executor.models.registry import get_model_class

        with torch.device("meta"):  # modules only: no memory, no weights
            model = get_model_class(arch.architecture, model_impl)(arch)
        modules = dict(model.named_modules())
        _MODULES[key] = {
            name.rpartition(".")[2]: _whole_features(modules[target.module_name])
            for name, target in lora_targets(model).items()
        }
    return _MODULES[key]


def _whole_features(layer: object) -> tuple[int, int]:
    """A tensor-parallel layer's unsharded (in, out) features."""
    return layer.input_size, layer.output_size  # type: ignore[attr-defined]


def _shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    hidden, head_dim = arch.hidden_size, arch.head_dim
    q_size = arch.num_attention_heads * head_dim
    kv_size = arch.num_key_value_heads * head_dim
    shapes = {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "qkv_proj": (hidden, q_size + 2 * kv_size),
    }
    if arch.architecture not in MOE_ARCHITECTURES:
        inter = arch.intermediate_size
        shapes |= {
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
            "gate_up_proj": (hidden, 2 * inter),
            "fc_in": (hidden, inter),  # the LayerNorm decoders' GELU MLP (Phi, StarCoder2)
            "fc_out": (inter, hidden),
        }
    return shapes


@dataclass(frozen=True)
class LoRATarget:
    """Where one HF projection's adapter goes: the model's layer and the slices it covers.

    ``slices`` are indices into the layer's output slices (q, k, v of a fused qkv layer;
    gate, up of a fused gate_up layer; one slice for any other layer), in order.
    """

    module_name: str
    slices: tuple[int, ...]


def _shard_index(shard_id: str | int) -> int:
    return {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id


def lora_targets(model: object) -> dict[str, LoRATarget]:
    """HF module path (``model.layers.0.self_attn.q_proj``) -> its ``LoRATarget``, for every
    tensor-parallel linear layer of ``model`` this worker holds (MoE experts and the LM
    head are no such layers)."""
    from torch import nn

    from pagedlm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    assert isinstance(model, nn.Module)
    stacked = getattr(model, "stacked_params", ())
    # The Transformers backend holds transformers' model under a name of its own (``hf.``).
    prefix = getattr(model, "lora_module_prefix", "")
    targets: dict[str, LoRATarget] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if not module_name.startswith(prefix):
            continue
        name = module_name.removeprefix(prefix)
        parent, _, leaf = name.rpartition(".")
        parts = [
            (_leaf(part), _shard_index(shard))
            for merged, part, shard in stacked
            if _leaf(merged) == leaf
        ]
        num_slices = len(layer_slices(module))
        for part, index in parts:
            targets[f"{parent}.{part}"] = LoRATarget(module_name, (index,))
        targets[name] = LoRATarget(module_name, tuple(range(num_slices)))
    return targets


def _leaf(name: str) -> str:
    """A ``stacked_params`` entry's module name: ``qkv_proj`` (Llama's spelling) or the
    last part of a dotted path (``.self_attn.qkv_proj.``, the LayerNorm decoders')."""
    return name.strip(".").rpartition(".")[2]


def layer_slices(layer: object) -> list[int]:
    """The output sizes, on this rank, of a layer's slices (see ``LoRATarget``)."""
    from pagedlm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
    )

    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(layer.output_sizes)
    return [layer_features(layer)[1]]


def layer_features(layer: object) -> tuple[int, int]:
    """(in_features, out_features) of a tensor-parallel linear layer on this rank, from
    its sizes (a platform kernel may have released the plain weight)."""
    from pagedlm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    if isinstance(layer, ColumnParallelLinear):
        return layer.input_size, layer.output_size // layer.tp_size
    assert isinstance(layer, RowParallelLinear)
    return layer.input_size // layer.tp_size, layer.output_size
