"""GGUF mixture-of-experts files: qwen3moe, qwen2moe (a shared expert) and llama files with
experts (Mixtral), written from tiny random transformers models the way llama.cpp's
converter does (experts stacked [experts, rows, cols] per projection, gate/up fused, or
one 2-D tensor per expert as early Mixtral files have them; routers in float32).

pagedlm's logits are compared with transformers: F32 files with the original model,
quantized ones with the model fed the weights the file holds (dequantized). The CPU
platform's kept-blocks load must route attention to the file's blocks and load the
experts, whose stacked parameters take no blocks, dequantized.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from tiny_gguf import finish, tiny_causal_lm, write_gguf

from model_utils import full_logits
from pagedlm.config import ModelConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader import load_model, quantized_linear_blocks
from pagedlm.model_executor.loader.block_routing import unroutable_tensors
from pagedlm.model_executor.loader.gguf_loader import (
    gguf_arch_config,
    iter_gguf_entries,
    iter_gguf_weights,
    read_gguf_header,
)
from pagedlm_cpu.attention import CpuSdpaBackend
from pagedlm_cpu.quantized_linear import install_int4_kernels, int4_kernel_available

PROMPT = [1, 5, 17, 33, 2, 64, 90, 7, 7, 41, 12, 3, 88, 60, 25, 9]
_MODELS = {
    # One dense layer (mlp_only_layers): the file has ffn_gate/up/down there, no router.
    "qwen3moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {"num_experts": 4, "norm_topk_prob": True, "mlp_only_layers": [1]},
    ),
    "qwen2moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        {"num_experts": 4, "shared_expert_intermediate_size": 96},
    ),
    "llama": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 4},
    ),
}
_HF_ARCHITECTURES = {
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "llama": "MixtralForCausalLM",
}


def tiny_moe(arch: str, hidden_size: int = 64, expert_size: int = 32):
    """2 layers, 4 experts (top 2) of ``expert_size`` (Mixtral: ``2 * hidden_size``);
    qwen3moe's heads ``hidden_size // 2`` wide, not hidden / heads. Weights larger than the
    default so that routing and every expert matter."""
    config_class, model_class, extra = _MODELS[arch]
    if arch == "qwen3moe":
        extra = {**extra, "head_dim": hidden_size // 2}
    return tiny_causal_lm(
        config_class,
        model_class,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=expert_size,
        num_experts_per_tok=2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.1,
        **extra,
    )


def pagedlm_logits(path: Path) -> torch.Tensor:
    arch = gguf_arch_config(str(path))
    model = load_model(ModelConfig(str(path), None, arch, torch.float32, 64), torch.device("cpu"))
    return full_logits(model, arch, CpuSdpaBackend(torch.device("cpu")), PROMPT)


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("qwen3moe", "stacked"),
        ("qwen3moe", "fused"),
        ("qwen2moe", "stacked"),
        ("llama", "stacked"),
        ("llama", "split"),
    ],
)
def test_f32_logits_match_transformers(tmp_path: Path, arch: str, layout: str) -> None:
    config, model = tiny_moe(arch)
    path = tmp_path / f"{arch}-{layout}.gguf"
    write_gguf(path, arch, config, model.state_dict(), "F32", expert_layout=layout)
    torch.testing.assert_close(pagedlm_logits(path), hf_logits(model), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("arch", "qtypes", "size"),
    [
        ("qwen3moe", "Q8_0", 64),
        ("qwen2moe", "Q8_0", 64),
        ("llama", "Q8_0", 64),
        ("qwen3moe", ["Q4_K", "Q6_K", "Q8_0"], 256),  # K-quants: rows of 256
    ],
)
def test_quantized_logits_match_transformers_on_the_same_weights(
    tmp_path: Path, arch: str, qtypes, size: int
) -> None:
    config, model = tiny_moe(arch, hidden_size=size, expert_size=size // 2 if size < 256 else size)
    path = tmp_path / f"{arch}-quantized.gguf"
    held = write_gguf(path, arch, config, model.state_dict(), qtypes, tokenizer_pre=None)
    # Each expert's byte range of a stacked quantized tensor is that expert's weights.
    arch_config = gguf_arch_config(str(path))
    weights = dict(iter_gguf_weights(str(path), arch_config))
    for name, expected in held.items():
        if ".mlp.experts." in name:
            stacked = _stack_experts(weights, name, expected)
            torch.testing.assert_close(stacked, expected, rtol=0, atol=0, msg=name)
    model.load_state_dict(held)
    torch.testing.assert_close(pagedlm_logits(path), hf_logits(model), rtol=1e-4, atol=1e-4)


def _stack_experts(weights: dict[str, torch.Tensor], hf_name: str, expected: torch.Tensor):
    """transformers' stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` from pagedlm's
    per-expert tensors (Mixtral's ``block_sparse_moe.experts.E.w1/w3/w2`` included)."""
    layer = hf_name.split(".")[2]
    names = (
        [("gate_proj", "w1"), ("up_proj", "w3")]
        if hf_name.endswith("gate_up_proj")
        else [("down_proj", "w2")]
    )
    experts = []
    for expert in range(expected.shape[0]):
        rows = []
        for qwen, mixtral in names:
            qwen_name = f"model.layers.{layer}.mlp.experts.{expert}.{qwen}.weight"
            mixtral_name = (
                f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{mixtral}.weight"
            )
            rows.append(weights.get(qwen_name, weights.get(mixtral_name)))
        experts.append(torch.cat(rows))
    return torch.stack(experts)


@pytest.mark.parametrize("arch", sorted(_MODELS))
def test_arch_config_from_expert_metadata(tmp_path: Path, arch: str) -> None:
    config, model = tiny_moe(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, config, model.state_dict(), "F32", tokenizer_pre=None)
    got = gguf_arch_config(str(path))
    assert got.architecture == _HF_ARCHITECTURES[arch]
    assert (got.raw["num_experts"], got.raw["num_experts_per_tok"]) == (4, 2)
    assert got.raw["moe_intermediate_size"] == (128 if arch == "llama" else 32)
    assert got.intermediate_size == 128
    # llama.cpp renormalizes the top-k weights for qwen3moe and Mixtral, not for qwen2moe.
    assert got.raw["norm_topk_prob"] is (arch != "qwen2moe")
    assert got.raw["mlp_only_layers"] == ([1] if arch == "qwen3moe" else [])
    assert got.raw["shared_expert_intermediate_size"] == (96 if arch == "qwen2moe" else 0)
    assert got.raw["qkv_bias"] is (arch == "qwen2moe")


def test_sigmoid_routing_is_refused(tmp_path: Path) -> None:
    config, model = tiny_moe("qwen3moe")
    path = tmp_path / "sigmoid.gguf"

    def sigmoid(writer: gguf.GGUFWriter) -> None:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)

    write_gguf(path, "qwen3moe", config, model.state_dict(), "F32", add_extras=sigmoid)
    with pytest.raises(ValueError, match="sigmoid"):
        gguf_arch_config(str(path))


def test_missing_expert_count_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "no-experts.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_feed_forward_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match=r"qwen3moe\.expert_count"):
        gguf_arch_config(str(path))


@pytest.mark.skipif(not int4_kernel_available(), reason="no CPU int4 kernel")
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama"])
def test_kept_blocks_route_attention_and_load_experts_dequantized(
    tmp_path: Path, arch: str
) -> None:
    """As the CPU platform loads a quantized file: blocks for every linear layer, the
    experts (3-D parameters, which no block kernel computes) dequantized, and the model on
    the int4 kernels within its bf16 rounding of the dequantized float load."""
    config, model = tiny_moe(arch)
    path = tmp_path / f"{arch}-q4_1.gguf"
    # Embedding Q8_0, every other matrix Q4_1 (the experts too); routers stay F32.
    write_gguf(path, arch, config, model.state_dict(), ["Q8_0"] + ["Q4_1"] * 99)
    engine_config, _ = EngineArgs(
        model=str(path), dtype="float32", platform="cpu"
    ).create_engine_config()
    model_config = engine_config.model
    dense = load_model(model_config, torch.device("cpu"))
    # Of the 2-D entries, exactly the experts' feed the stacked w13/w2: no blocks go there.
    header = read_gguf_header(str(path))
    entries = iter_gguf_entries(header, model_config.arch)
    shapes = {name: info.shape for name, info, _ in entries if len(info.shape) == 2}
    experts = {name for name in shapes if ".experts." in name}
    assert len(experts) == 2 * 4 * 3 - (12 if arch == "qwen3moe" else 0)
    assert unroutable_tensors(dense, shapes) == experts

    kept = load_model(model_config, torch.device("cpu"), keep_weight_blocks=True)
    blocks = quantized_linear_blocks(kept, model_config)
    routers = {n for n, _ in kept.named_modules() if n.endswith(("mlp.gate", "shared_expert_gate"))}
    linears = {n for n, m in kept.named_modules() if isinstance(m, LinearBase)}
    assert set(blocks) == linears - routers  # attention, dense/shared MLPs, the LM head
    reference = dict(dense.named_parameters())
    for name, param in kept.named_parameters():
        if name.endswith((".w13", ".w2")):
            assert torch.equal(param, reference[name]), name
    backend = CpuSdpaBackend(torch.device("cpu"))
    float32 = full_logits(dense, model_config.arch, backend, PROMPT).log_softmax(-1)
    assert install_int4_kernels(kept, blocks) == len(blocks)
    got = full_logits(kept, model_config.arch, backend, PROMPT).log_softmax(-1)
    # The same kernels over the blocks read again from the ordinarily loaded model.
    assert install_int4_kernels(dense, quantized_linear_blocks(dense, model_config)) == len(blocks)
    expected = full_logits(dense, model_config.arch, backend, PROMPT).log_softmax(-1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # The int4 kernel rounds activations to bf16 (these weights are larger than a trained
    # model's: 0.02 here, 0.002 at the default initializer range).
    assert (got - float32).abs().max() < 0.05
