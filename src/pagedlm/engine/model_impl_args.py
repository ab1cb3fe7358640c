"""``model_impl`` (vLLM's ``--model-impl``): which implementation runs the architecture.

"vllm" (alias "pagedlm") is pagedlm's own model class; "transformers" is the Transformers
modeling backend (``model_executor/models/transformers_backend.py``): transformers' own
modeling code with pagedlm's paged attention; "auto" takes the native class where there
is one, else the backend where transformers can run the architecture with a custom
attention function. ``resolve_model_impl`` decides at the edge;
``check_transformers_backend`` and ``check_transformers_parallel`` refuse, naming the
fix, what the backend does not run.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from pagedlm.config import MODEL_IMPL_ALIASES, MODEL_IMPLS, ArchConfig

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig

logger = logging.getLogger(__name__)

_MULTIMODAL_KEYS = ("vision_config", "audio_config", "image_token_id", "image_token_index")


def transformers_refusal(arch: ArchConfig) -> str | None:
    """Why the Transformers backend cannot run ``arch`` (None: it can)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = arch.architecture
    if any(key in arch.raw for key in _MULTIMODAL_KEYS):
        return f"{name} is a multimodal model, which the Transformers backend does not run yet"
    if name not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return f"transformers {transformers.__version__} has no causal LM class {name!r}"
    model_class = getattr(transformers, name, None)
    if model_class is None:
        return f"transformers {transformers.__version__} cannot import {name}"
    if not getattr(model_class, "_supports_attention_backend", False):
        return f"transformers' {name} does not call custom attention functions"
    from pagedlm.model_executor.models.transformers_backend import hf_config

    config = hf_config(arch)
    others = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if others:
        # Convolution, recurrent or linear-attention layers keep state across steps
        # that a step-wise forward over the paged cache does not carry.
        return f"{name} has {others} layers besides attention, which the backend cannot carry"
    if getattr(config, "attention_chunk_size", None):
        return f"{name} attends in chunks (attention_chunk_size), which the backend cannot mask"
    return None


ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def resolve_model_impl(requested: str, arch: ArchConfig, model: str) -> tuple[str, ArchConfig]:
    """``("vllm" | "transformers", arch)`` for ``model_impl=requested``; with the backend,
    ``arch`` takes the head size transformers' attention uses (the KV cache's)."""
    from pagedlm.model_executor.models.registry import SUPPORTED_ARCHITECTURES

    impl = MODEL_IMPL_ALIASES.get(requested, requested)
    if impl not in MODEL_IMPLS:
        raise ValueError(
            f"model_impl={requested!r} is unknown; use one of "
            f"{', '.join(MODEL_IMPLS + tuple(MODEL_IMPL_ALIASES))} (--model-impl)."
        )
    native = arch.architecture in SUPPORTED_ARCHITECTURES
    if impl == "vllm" or (impl == "auto" and native):
        if not native:
            raise ValueError(_unsupported(arch, model, "model_impl='vllm' (pagedlm's own)"))
        return "vllm", arch
    refusal = transformers_refusal(arch)
    if refusal is not None:
        if impl == "auto":
            raise ValueError(_unsupported(arch, model, f"the Transformers backend: {refusal}"))
        raise ValueError(
            f"model_impl='transformers' cannot run {model}: {refusal}. Use a model that "
            "transformers implements, or model_impl='auto'."
        )
    if impl == "auto":
        logger.info(
            "%s has no pagedlm implementation; running it with the Transformers modeling "
            "backend (transformers' code, pagedlm's paged attention; --model-impl).",
            arch.architecture,
        )
    from pagedlm.model_executor.models.transformers_backend import hf_config, hf_head_dim

    return "transformers", replace(arch, head_dim=hf_head_dim(hf_config(arch)))


def _unsupported(arch: ArchConfig, model: str, tried: str) -> str:
    from pagedlm.model_executor.models.registry import SUPPORTED_ARCHITECTURES

    remote = (
        " It ships its own modeling code (auto_map), which pagedlm never executes."
        if "auto_map" in arch.raw
        else ""
    )
    return (
        f"Architecture {arch.architecture!r} of {model} is not supported by {tried}. "
        f"pagedlm implements: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}; other "
        "transformers causal LMs run with --model-impl transformers (model_impl='auto' "
        f"picks it where transformers can).{remote}"
    )


def check_transformers_backend(config: EngineConfig, is_gguf: bool) -> None:
    """Refuses what the Transformers backend does not support in this version."""
    if config.model.model_impl != "transformers":
        return
    speculative = config.speculative
    refusals = (
        (is_gguf, "GGUF files", "load the model's Hugging Face directory"),
        (
            "quantization_config" in config.model.arch.raw,
            f"pre-quantized checkpoints (this one's: {config.model.quantization})",
            "serve its float checkpoint, unquantized or with quantization='fp8'",
        ),
        (
            config.model.quantization not in (None, "fp8"),
            f"quantization={config.model.quantization!r}",
            "serve the float checkpoint, unquantized or with quantization='fp8'",
        ),
        (
            speculative is not None and speculative.method in ("eagle", "eagle3", "mtp"),
            "EAGLE and MTP draft heads (they read the target's own layers)",
            "use a draft_model or ngram speculator",
        ),
        (
            config.batch_invariant,
            "batch-invariant mode (transformers' layers are not tiled)",
            "drop batch_invariant (and VLLM_BATCH_INVARIANT)",
        ),
    )
    for refused, what, fix in refusals:
        if refused:
            raise ValueError(_refusal(config.model.arch, what, fix))


def check_transformers_parallel(
    model_impl: str, arch: ArchConfig, tensor_parallel_size: int, pipeline_parallel_size: int
) -> None:
    """Refuses pipeline parallelism, and tensor parallelism the model's own plan does not
    give (``transformers_layers.tensor_parallel_refusal``), on the Transformers backend;
    checked before the parallel config, so the answer does not depend on the machine's
    device count."""
    if model_impl != "transformers":
        return
    if pipeline_parallel_size > 1:
        raise ValueError(
            _refusal(
                arch,
                "pipeline_parallel_size above 1",
                "run it with pipeline_parallel_size=1 (tensor_parallel_size where its plan allows)",
            )
        )
    if tensor_parallel_size > 1:
        import torch
        from transformers import AutoModelForCausalLM

        from pagedlm.model_executor.models.transformers_backend import ATTENTION_NAME, hf_config
        from pagedlm.model_executor.models.transformers_layers import tensor_parallel_refusal

        config = hf_config(arch)
        with torch.device("meta"):  # module names and shapes only: nothing allocated
            model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME)
        refusal = tensor_parallel_refusal(model.base_model, model.config, tensor_parallel_size)
        if refusal is not None:
            raise ValueError(
                _refusal(
                    arch,
                    f"tensor_parallel_size={tensor_parallel_size}: {refusal}",
                    "run it with tensor_parallel_size=1",
                )
            )


def _refusal(arch: ArchConfig, what: str, fix: str) -> str:
    return (
        f"The Transformers modeling backend (model_impl='transformers', running "
        f"{arch.architecture}) does not support {what}; {fix}, or serve a model pagedlm "
        "implements (model_impl='vllm')."
    )
