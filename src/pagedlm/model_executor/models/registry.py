"""Which model class implements each HF ``architectures`` name (imported on first use)."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS = "pagedlm.model_executor.models"
_LLAMA = f"{_MODELS}.llama"
_EMBEDDING = f"{_MODELS}.decoder_embedding"
_CLASSIFIER = f"{_MODELS}.sequence_classification"
_TOKEN_CLASSIFIER = f"{_MODELS}.token_classification"

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": f"{_LLAMA}:LlamaForCausalLM",
    "MistralForCausalLM": f"{_LLAMA}:MistralForCausalLM",
    "Qwen2ForCausalLM": f"{_LLAMA}:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": f"{_LLAMA}:Qwen3ForCausalLM",
    "Phi3ForCausalLM": f"{_MODELS}.phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": f"{_MODELS}.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": f"{_MODELS}.qwen3_moe:Qwen3MoeForCausalLM",
    "GemmaForCausalLM": f"{_MODELS}.gemma:GemmaForCausalLM",
    "GraniteForCausalLM": f"{_MODELS}.granite:GraniteForCausalLM",
    "Olmo2ForCausalLM": f"{_MODELS}.olmo2:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": f"{_MODELS}.olmo2:Olmo3ForCausalLM",
    "SmolLM3ForCausalLM": f"{_MODELS}.smollm3:SmolLM3ForCausalLM",
    "Qwen2MoeForCausalLM": f"{_MODELS}.qwen2_moe:Qwen2MoeForCausalLM",
    "Ernie4_5ForCausalLM": f"{_MODELS}.ernie45:Ernie4_5ForCausalLM",
    "Gemma2ForCausalLM": f"{_MODELS}.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": f"{_MODELS}.gemma3:Gemma3ForCausalLM",
    "GPT2LMHeadModel": f"{_MODELS}.gpt2:GPT2LMHeadModel",
    "GPTNeoXForCausalLM": f"{_MODELS}.gpt_neox:GPTNeoXForCausalLM",
    "StableLmForCausalLM": f"{_MODELS}.stablelm:StableLmForCausalLM",
    "PhiForCausalLM": f"{_MODELS}.phi:PhiForCausalLM",
    "Starcoder2ForCausalLM": f"{_MODELS}.starcoder2:Starcoder2ForCausalLM",
    "CohereForCausalLM": f"{_MODELS}.cohere:CohereForCausalLM",
    "Cohere2ForCausalLM": f"{_MODELS}.cohere:Cohere2ForCausalLM",
    "GptOssForCausalLM": f"{_MODELS}.gpt_oss:GptOssForCausalLM",
    "DeepseekV2ForCausalLM": f"{_MODELS}.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": f"{_MODELS}.deepseek_v2:DeepseekV3ForCausalLM",
    # Embedding models (no LM head): served by the pooling runner.
    "BertModel": f"{_MODELS}.bert:BertModel",
    "RobertaModel": f"{_MODELS}.bert:RobertaModel",
    "XLMRobertaModel": f"{_MODELS}.bert:XLMRobertaModel",
    "LlamaModel": f"{_EMBEDDING}:LlamaModel",
    "MistralModel": f"{_EMBEDDING}:MistralModel",
    "Qwen2Model": f"{_EMBEDDING}:Qwen2Model",
    "Qwen3Model": f"{_EMBEDDING}:Qwen3Model",
    # Sequence classifiers (cross-encoders, rerankers): also pooling models.
    "BertForSequenceClassification": f"{_MODELS}.bert:BertForSequenceClassification",
    "RobertaForSequenceClassification": f"{_MODELS}.bert:RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification": (f"{_MODELS}.bert:XLMRobertaForSequenceClassification"),
    "LlamaForSequenceClassification": f"{_CLASSIFIER}:LlamaForSequenceClassification",
    "MistralForSequenceClassification": f"{_CLASSIFIER}:MistralForSequenceClassification",
    "Qwen2ForSequenceClassification": f"{_CLASSIFIER}:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification": f"{_CLASSIFIER}:Qwen3ForSequenceClassification",
    # Token classifiers and reward models: pooling models scoring every token.
    "LlamaForTokenClassification": f"{_TOKEN_CLASSIFIER}:LlamaForTokenClassification",
    "MistralForTokenClassification": f"{_TOKEN_CLASSIFIER}:MistralForTokenClassification",
    "Qwen2ForTokenClassification": f"{_TOKEN_CLASSIFIER}:Qwen2ForTokenClassification",
    "Qwen3ForTokenClassification": f"{_TOKEN_CLASSIFIER}:Qwen3ForTokenClassification",
    "Qwen2ForRewardModel": f"{_TOKEN_CLASSIFIER}:Qwen2ForRewardModel",
    "Qwen2ForProcessRewardModel": f"{_TOKEN_CLASSIFIER}:Qwen2ForProcessRewardModel",
    "LlavaForConditionalGeneration": f"{_MODELS}.llava:LlavaForConditionalGeneration",
    "Gemma3ForConditionalGeneration": f"{_MODELS}.gemma3_mm:Gemma3ForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": (
        f"{_MODELS}.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration"
    ),
}
"""HF architecture name -> ``"module:Class"``."""


TRANSFORMERS_BACKEND = f"{_MODELS}.transformers_backend:TransformersForCausalLM"
"""The class of ``model_impl="transformers"`` (transformers' modeling code, paged attention)."""


def get_model_class(architecture: str, model_impl: str = "vllm") -> type[nn.Module]:
    """The model class for config.json's ``architectures[0]``: pagedlm's own for
    ``model_impl="vllm"``, the Transformers backend for "transformers", the first of them
    for "auto" (``pagedlm.engine.model_impl_args`` checks the backend can run it)."""
    if model_impl == "transformers" or (
        model_impl == "auto" and architecture not in SUPPORTED_ARCHITECTURES
    ):
        target = TRANSFORMERS_BACKEND
    else:
        try:
            target = SUPPORTED_ARCHITECTURES[architecture]
        except KeyError:
            raise ValueError(
                f"Model architecture {architecture!r} is not supported; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}. Others may run with "
                "model_impl='transformers' (--model-impl transformers)."
            ) from None
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
