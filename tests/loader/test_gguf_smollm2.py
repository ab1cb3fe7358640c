"""The real SmolLM2-135M-Instruct Q4_1 file against transformers' own GGUF reading."""

from __future__ import annotations

import pytest
import torch

from pagedlm.model_executor.loader.gguf_loader import gguf_arch_config, iter_gguf_weights


@pytest.fixture(scope="module")
def transformers_checkpoint(smollm2_path):
    """transformers' parsed config and all dequantized, un-permuted tensors (15-30 s)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(
            LlamaConfig(num_hidden_layers=30, vocab_size=8, hidden_size=8,
                        intermediate_size=8, num_attention_heads=2, num_key_value_heads=1)
        )  # fmt: skip
    return load_gguf_checkpoint(smollm2_path, return_tensors=True, model_to_load=skeleton)


def test_arch_config(smollm2_path):
    arch = gguf_arch_config(smollm2_path)
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (49152, 576, 1536)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (
        30,
        9,
        3,
    )
    assert arch.head_dim == 64
    assert arch.rms_norm_eps == 1e-5
    assert arch.rope_theta == 100000.0
    assert arch.rope_scaling is None
    assert arch.max_position_embeddings == 8192
    assert arch.tie_word_embeddings is True
    assert (arch.bos_token_id, arch.eos_token_id) == (1, 2)  # <|im_start|>, <|im_end|>
    assert arch.torch_dtype is None


def test_attention_weights_match_transformers_processor(smollm2_path):
    """A few tensors through transformers' llama GGUF tensor processor (its q/k un-permutation)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    wanted = {
        f"blk.{layer}.{kind}.weight": f"model.layers.{layer}.self_attn.{proj}.weight"
        for layer in (0, 29)
        for kind, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"))
    }
    wanted["token_embd.weight"] = "model.embed_tokens.weight"
    ours = {
        name: tensor
        for name, tensor in iter_gguf_weights(smollm2_path, gguf_arch_config(smollm2_path))
        if name in wanted.values()
    }
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for tensor in gguf.GGUFReader(smollm2_path).tensors:
        if tensor.name in wanted:
            values = gguf.dequantize(tensor.data, tensor.tensor_type)
            expected = torch.from_numpy(processor.process(values, tensor.name).weights.copy())
            hf_name = wanted.pop(tensor.name)
            torch.testing.assert_close(ours[hf_name], expected, rtol=0, atol=1e-6, msg=hf_name)
    assert not wanted, f"not found in the file: {wanted}"


@pytest.mark.slow
def test_arch_config_agrees_with_transformers(smollm2_path, transformers_checkpoint):
    arch = gguf_arch_config(smollm2_path)
    config = transformers_checkpoint["config"]
    for ours, theirs in [
        ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
        ("num_hidden_layers", "num_hidden_layers"), ("num_attention_heads", "num_attention_heads"),
        ("num_key_value_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
        ("intermediate_size", "intermediate_size"), ("rope_theta", "rope_theta"),
        ("max_position_embeddings", "max_position_embeddings"),
        ("tie_word_embeddings", "tie_word_embeddings"), ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
    ]:  # fmt: skip
        assert getattr(arch, ours) == config[theirs], ours
    assert arch.rms_norm_eps == pytest.approx(config["rms_norm_eps"], rel=1e-6)


@pytest.mark.slow
def test_all_weights_match_transformers(smollm2_path, transformers_checkpoint):
    reference = transformers_checkpoint["tensors"]
    seen = set()
    for name, tensor in iter_gguf_weights(smollm2_path, gguf_arch_config(smollm2_path)):
        expected = reference[name]
        assert tensor.dtype == torch.float32 and tensor.shape == expected.shape, name
        # q_proj / k_proj (9 and 3 heads) check the row un-permutation on a real file.
        torch.testing.assert_close(tensor, expected.float(), rtol=0, atol=1e-6, msg=name)
        seen.add(name)
    assert seen == set(reference)
    assert "lm_head.weight" not in seen  # tied to the embeddings
    assert {"model.layers.29.self_attn.q_proj.weight", "model.norm.weight"} <= seen
