"""GGUF for llama, qwen2 and qwen3 in every supported tensor type, against transformers.

Tiny random HF checkpoints are written as llama.cpp-style GGUF files (names, metadata and,
for llama only, the q/k row permutation done the way ``convert_hf_to_gguf`` does it). pagedlm's
logits are compared with transformers loading the *same file* through its own GGUF path.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from model_utils import full_logits
from pagedlm.config import ModelConfig
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.gguf_loader import gguf_arch_config, iter_gguf_weights
from pagedlm_cpu.attention import CpuSdpaBackend

# HF module path -> llama.cpp stem, written independently of the loader's own table.
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
_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}

_CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
}
PROMPT = [1, 5, 17, 33, 2, 64, 90, 7, 7, 41, 12, 3, 88, 60, 25, 9]


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"


def interleave_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's llama q/k permutation: rotate-half halves -> interleaved pairs."""
    head_dim = weight.shape[0] // num_heads
    split = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def deinterleave_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def tiny_model(arch: str, hidden_size: int = 64, seed: int = 0):
    config_class, model_class, extra = _CONFIGS[arch]
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=96,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
    return config, model


def k_quant_bytes(array: np.ndarray, qtype) -> np.ndarray:
    """Valid random blocks for a K-quant (gguf cannot quantize these): random codes, small
    positive float16 super-block scales, so every dequantized value is finite and small."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = array.shape
    rng = np.random.default_rng(cols + rows)
    raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    # Byte offsets of the float16 scale fields (d, and dmin where the type has one).
    scale_offsets = {
        "Q2_K": (80, 82),
        "Q3_K": (108,),
        "Q4_K": (0, 2),
        "Q5_K": (0, 2),
        "Q6_K": (208,),
    }
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for offset in scale_offsets[qtype.name]:
        raw[:, :, offset : offset + 2] = scale
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path, arch: str, config, state_dict: dict[str, torch.Tensor], qtype_names: str | list[str]
):
    """Write ``state_dict`` as a llama.cpp GGUF; 2-D weights in ``qtype_names`` (one type, or
    a list that the 2-D weights take in turn, so one file can hold every K-quant).

    Returns the state dict the file actually holds in HF layout (K-quants: random blocks),
    for exact comparisons.
    """
    cycle = [qtype_names] if isinstance(qtype_names, str) else qtype_names
    matrices = 0
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch != "llama" else "gpt-2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_merges([])
    held = {}
    for hf_name, tensor in state_dict.items():
        array = tensor.detach().float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (
                config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            )
            array = interleave_rotary_rows(array, heads)
        qtype_name = cycle[matrices % len(cycle)] if array.ndim == 2 else "F32"
        matrices += array.ndim == 2
        qtype = gguf.GGMLQuantizationType[qtype_name]
        if qtype == gguf.GGMLQuantizationType.F32:
            data, raw_dtype = np.ascontiguousarray(array), None
        elif qtype_name.endswith("_K"):
            data, raw_dtype = k_quant_bytes(array, qtype), qtype
        else:
            data, raw_dtype = gguf.quants.quantize(array, qtype), qtype
        writer.add_tensor(gguf_name(hf_name), data, raw_dtype=raw_dtype)
        values = data if raw_dtype is None else gguf.quants.dequantize(data, qtype)
        values = np.asarray(values, dtype=np.float32).reshape(array.shape)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            values = deinterleave_rotary_rows(values, heads)
        held[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def pagedlm_logits(path: Path) -> torch.Tensor:
    arch = gguf_arch_config(str(path))
    model = load_model(ModelConfig(str(path), None, arch, torch.float32, 64), torch.device("cpu"))
    return full_logits(model, arch, CpuSdpaBackend(torch.device("cpu")), PROMPT)


def transformers_logits(path: Path, arch: str, config) -> torch.Tensor:
    """Logits of the HF model class with the weights transformers itself reads from ``path``
    (its GGUF name mapping, dequantization and llama q/k reverse permutation)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, model_class, _ = _CONFIGS[arch]
    with torch.device("meta"):
        skeleton = model_class(config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    model = model_class(config).eval()
    model.load_state_dict({k: v.float() for k, v in parsed["tensors"].items()}, strict=True)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
_K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _cases() -> list:
    """llama and qwen2 in every type; qwen3 (same loader path) in two, the rest marked slow."""
    cases = []
    for arch in sorted(_CONFIGS):
        for qtype in _TYPES:
            slow = arch == "qwen3" and qtype not in ("F32", "Q8_0")
            cases.append(pytest.param(arch, qtype, marks=[pytest.mark.slow] if slow else []))
    return cases


@pytest.mark.parametrize(("arch", "qtype"), _cases())
def test_logits_match_transformers_gguf_loading(tmp_path: Path, arch: str, qtype: str) -> None:
    config, model = tiny_model(arch)
    path = tmp_path / f"{arch}-{qtype}.gguf"
    write_gguf(path, arch, config, model.state_dict(), qtype)
    ours, reference = pagedlm_logits(path), transformers_logits(path, arch, config)
    # Both dequantize the same bytes to the same float32 weights, so only the float32
    # arithmetic of two implementations differs (SDPA vs eager attention, fused qkv).
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    if qtype in ("F32", "F16", "BF16"):
        with torch.no_grad():
            original = model(torch.tensor([PROMPT])).logits[0]
        # F32 is exact; F16/BF16 round every weight by at most 2^-11 / 2^-8 relative.
        tolerance = {"F32": 1e-4, "F16": 1e-2, "BF16": 5e-2}[qtype]
        torch.testing.assert_close(ours, original, rtol=0, atol=tolerance)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_k_quants_load_the_dequantized_blocks(tmp_path: Path, arch: str) -> None:
    # K-quants pack 256 values per block, so every matrix row needs 256 columns. The 2-D
    # weights take Q2_K..Q6_K in turn (each type appears at least twice in 14 matrices).
    config, model = tiny_model(arch, hidden_size=256)
    path = tmp_path / f"{arch}-kquants.gguf"
    held = write_gguf(path, arch, config, model.state_dict(), _K_TYPES)
    weights = dict(iter_gguf_weights(str(path), gguf_arch_config(str(path))))
    assert set(weights) == set(held)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, held[name], rtol=0, atol=0, msg=name)
    reference = transformers_logits(path, arch, config)
    torch.testing.assert_close(pagedlm_logits(path), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_arch_config_follows_the_architecture(tmp_path: Path, arch: str) -> None:
    config, model = tiny_model(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, config, model.state_dict(), "F32")
    got = gguf_arch_config(str(path))
    assert got.architecture == type(model).__name__
    assert got.qk_norm is (arch == "qwen3")
    assert got.attention_bias is (arch == "qwen2")
    assert got.head_dim == (32 if arch == "qwen3" else 16)
