"""A GGUF file with YaRN rope scaling (qwen2, as llama.cpp's converter writes Qwen2.5's
long-context settings): logits past the pretraining length equal transformers' on the same
weights; a file that names no original context length falls back to the training one, as
llama.cpp does."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
import transformers
from tiny_gguf import tiny_causal_lm, write_gguf

from model_utils import full_logits
from pagedlm.config import ModelConfig
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.gguf_loader import gguf_arch_config
from pagedlm_cpu.attention import CpuSdpaBackend

PROMPT = [1, 5, 17, 33, 2, 64, 90, 7, 7, 41, 12, 3, 88, 60, 25, 9] * 3
ORIGINAL = 16
"""The pretraining length: PROMPT runs three times past it."""


def _write(path: Path, original: int | None):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    config, model = tiny_causal_lm(
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        rope_parameters={**rope, "original_max_position_embeddings": ORIGINAL},
        tie_word_embeddings=False,
    )

    def yarn(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        if original is not None:
            writer.add_rope_scaling_orig_ctx_len(original)

    write_gguf(path, "qwen2", config, model.state_dict(), "F32", tokenizer_pre=None,
               add_extras=yarn)  # fmt: skip
    return model


def test_yarn_logits_match_transformers_past_the_pretraining_length(tmp_path: Path) -> None:
    model = _write(tmp_path / "yarn.gguf", ORIGINAL)
    arch = gguf_arch_config(str(tmp_path / "yarn.gguf"))
    assert arch.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    config = ModelConfig(str(tmp_path / "yarn.gguf"), None, arch, torch.float32, 64)
    paged = load_model(config, torch.device("cpu"))
    got = full_logits(paged, arch, CpuSdpaBackend(torch.device("cpu")), PROMPT)
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_no_original_length_falls_back_to_the_training_context(tmp_path: Path) -> None:
    _write(tmp_path / "yarn.gguf", None)
    arch = gguf_arch_config(str(tmp_path / "yarn.gguf"))
    assert arch.rope_scaling["original_max_position_embeddings"] == arch.max_position_embeddings
