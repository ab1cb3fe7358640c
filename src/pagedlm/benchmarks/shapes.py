"""Built-in model shapes for benchmarks: HF config dicts written in code (no download).

``resolve_model("qwen3-0.6b")`` writes the config to a temporary directory (removed when
the process exits) that ``load_format="dummy"`` fills with random weights; a directory
passes through unchanged.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    # DeepSeek-V2-Lite (15.7B parameters, 2.4B active): multi-head latent attention with
    # 16 heads, 64 routed experts of which 6 per token, and 2 shared ones.
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "torch_dtype": "bfloat16",
    },
}


def resolve_model(model: str) -> str:
    """A config directory for a built-in shape name, or ``model`` itself (a directory)."""
    if model in BUILTIN_SHAPES:
        directory = tempfile.mkdtemp(prefix=f"pagedlm-{model}-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(BUILTIN_SHAPES[model], f, indent=1)
        return directory
    if os.path.isdir(model) or (model.endswith(".gguf") and os.path.isfile(model)):
        return model
    raise ValueError(
        f"Model {model!r} is neither a built-in shape ({', '.join(BUILTIN_SHAPES)}) nor a "
        "directory with a config.json."
    )
