"""GGUF for llama, qwen2 and qwen3 in every supported tensor type, against transformers.

Tiny random HF checkpoints are written as llama.cpp-style GGUF files (names, metadata and,
for llama only, the q/k row permutation done the way ``convert_hf_to_gguf`` does it). pagedlm's
logits are compared with transformers loading the *same file* through its own GGUF path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_gguf import tiny_causal_lm, write_gguf

from model_utils import full_logits
from pagedlm.config import ModelConfig
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.gguf_loader import gguf_arch_config, iter_gguf_weights
from pagedlm_cpu.attention import CpuSdpaBackend

_CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
}
PROMPT = [1, 5, 17, 33, 2, 64, 90, 7, 7, 41, 12, 3, 88, 60, 25, 9]


def tiny_model(arch: str, hidden_size: int = 64, seed: int = 0):
    config_class, model_class, extra = _CONFIGS[arch]
    return tiny_causal_lm(
        config_class,
        model_class,
        seed=seed,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **extra,
    )


def write_arch_gguf(path: Path, arch: str, config, model, qtype_names: str | list[str]):
    """``model`` as llama.cpp writes ``arch``, with a vocabulary; the weights it holds."""
    pre = "qwen2" if arch != "llama" else "gpt-2"
    return write_gguf(path, arch, config, model.state_dict(), qtype_names, tokenizer_pre=pre)


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
    write_arch_gguf(path, arch, config, model, qtype)
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
    held = write_arch_gguf(path, arch, config, model, _K_TYPES)
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
    write_arch_gguf(path, arch, config, model, "F32")
    got = gguf_arch_config(str(path))
    assert got.architecture == type(model).__name__
    assert got.qk_norm is (arch == "qwen3")
    assert got.attention_bias is (arch == "qwen2")
    assert got.head_dim == (32 if arch == "qwen3" else 16)
