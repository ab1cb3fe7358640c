"""load_model's safetensors path, its checks, and the model registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.safetensors_loader import iter_safetensors_weights
from pagedlm.model_executor.models import SUPPORTED_ARCHITECTURES, get_model_class

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def save_tiny_llama(path: Path, **overrides: object) -> dict[str, torch.Tensor]:
    """Saves a random Llama in ``path``; returns its state dict."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def config_for(path: Path, max_model_len: int = 64) -> ModelConfig:
    arch = ArchConfig.from_directory(path)
    return ModelConfig(str(path), None, arch, torch.float32, max_model_len)


def test_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="'BertForMaskedLM' is not supported") as error:
        get_model_class("BertForMaskedLM")
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(error.value)


@pytest.mark.parametrize("architecture", sorted(SUPPORTED_ARCHITECTURES))
def test_every_registered_class_imports(architecture: str) -> None:
    assert get_model_class(architecture).__name__ == architecture


def test_loaded_parameters_equal_the_checkpoint(tmp_path: Path) -> None:
    state = save_tiny_llama(tmp_path)
    model = load_model(config_for(tmp_path), torch.device("cpu"))
    assert not model.training
    params = dict(model.named_parameters())
    attn = "model.layers.1.self_attn"
    torch.testing.assert_close(
        params[f"{attn}.qkv_proj.weight"],
        torch.cat([state[f"{attn}.{p}_proj.weight"] for p in "qkv"]),
    )
    mlp = "model.layers.0.mlp"
    torch.testing.assert_close(
        params[f"{mlp}.gate_up_proj.weight"],
        torch.cat([state[f"{mlp}.gate_proj.weight"], state[f"{mlp}.up_proj.weight"]]),
    )
    torch.testing.assert_close(params["lm_head.weight"], state["lm_head.weight"])
    torch.testing.assert_close(params["model.norm.weight"], state["model.norm.weight"])


def test_sharded_checkpoint_uses_its_index(tmp_path: Path) -> None:
    transformers_model_state = save_tiny_llama(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    # A stray copy of the weights in another layout must not be read.
    save_file({"bogus.weight": torch.zeros(1)}, str(sharded / "consolidated.safetensors"))
    names = {name for name, _ in iter_safetensors_weights(sharded)}
    assert names == set(transformers_model_state)
    load_model(config_for(sharded), torch.device("cpu"))


def test_tied_checkpoint_ignores_a_stored_lm_head(tmp_path: Path) -> None:
    state = save_tiny_llama(tmp_path, tie_word_embeddings=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = torch.full_like(state["model.embed_tokens.weight"], 7.0)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_model(config_for(tmp_path), torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, state["model.embed_tokens.weight"])


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 parameters.*layers\.1\.post_attention_layernorm"):
        load_model(config_for(tmp_path), torch.device("cpu"))


def test_untied_config_without_lm_head_says_how_to_fix(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, tie_word_embeddings=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lm_head\.weight.*tie_word_embeddings: true"):
        load_model(config_for(tmp_path), torch.device("cpu"))


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.self_attn\.q_norm\.weight' has no param"
    ):
        load_model(config_for(tmp_path), torch.device("cpu"))


def test_directory_without_safetensors_is_explained(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        load_model(config_for(tmp_path), torch.device("cpu"))


def test_sliding_window_reaches_every_attention_layer(tmp_path: Path) -> None:
    """Contexts longer than the window load (the backend applies it; parity is tested in
    tests/entrypoints/test_llm_parity_zoo.py)."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(**TINY, sliding_window=16)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    model = load_model(config_for(tmp_path, max_model_len=64), torch.device("cpu"))
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [16] * TINY["num_hidden_layers"]


def test_default_dtype_is_restored_when_construction_fails(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, hidden_act="gelu")
    config = config_for(tmp_path)
    bf16 = ModelConfig(config.model, None, config.arch, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        load_model(bf16, torch.device("cpu"))
    assert torch.get_default_dtype() == torch.float32
