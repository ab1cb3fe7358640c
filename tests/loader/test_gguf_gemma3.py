"""GGUF for gemma3 (text) and gemma (1): tiny random transformers models written the way
llama.cpp's converter writes them (every norm ``1 + w``, no ``output`` tensor; Gemma 3's
global rope base in ``rope.freq_base`` with its linear scaling, the local base in
``rope.freq_base_swa``, the window but not the layer pattern: llama.cpp makes every
sixth layer global). pagedlm's logits are compared with transformers on the same weights.

A Gemma 3 multimodal model converts to the same text file (its vision tower goes to a
separate mmproj file, which is refused); a file that carries the vision tower too
(``v.*``, ``mm.*``) loads its text model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from tiny_gguf import finish, tiny_causal_lm, write_gguf

from model_utils import full_logits
from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.gguf_loader import gguf_arch_config, iter_gguf_weights
from pagedlm_cpu.attention import CpuSdpaBackend

PROMPT = [1, 5, 17, 33, 2, 64, 90, 7, 7, 41, 12, 3, 88, 60, 25, 9]
HEAD_DIM = 16
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def tiny_gemma3():
    """Six layers (the sixth global, as llama.cpp assumes), a window shorter than PROMPT,
    local base 10k, global base 1M scaled linearly by 8 (Gemma 3 4B and larger)."""
    return tiny_causal_lm(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        norm_center=0.0,  # Gemma stores 1 + w: a missing or doubled +1 must show
        num_hidden_layers=6,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=8,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
    )


def tiny_gemma():
    return tiny_causal_lm(
        transformers.GemmaConfig,
        transformers.GemmaForCausalLM,
        norm_center=0.0,
        head_dim=HEAD_DIM,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
    )


_MODELS = {"gemma3": tiny_gemma3, "gemma": tiny_gemma}


def write_converted(path: Path, arch: str, config, model, qtype: str, **kwargs):
    """Norms as ``1 + w``, the tied head left out; returns the weights the file holds (HF
    names, norms as the model keeps them)."""
    state_dict = {
        name: value + 1.0 if name.endswith("norm.weight") else value
        for name, value in model.state_dict().items()
        if name != "lm_head.weight"
    }
    held = write_gguf(path, arch, config, state_dict, qtype, **kwargs)
    return {name: v - 1.0 if name.endswith("norm.weight") else v for name, v in held.items()}


def pagedlm_logits(path: Path, arch: ArchConfig | None = None) -> torch.Tensor:
    arch = arch or gguf_arch_config(str(path))
    model = load_model(ModelConfig(str(path), None, arch, torch.float32, 64), torch.device("cpu"))
    return full_logits(model, arch, CpuSdpaBackend(torch.device("cpu")), PROMPT)


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ["gemma3", "gemma"])
def test_logits_match_transformers(tmp_path: Path, arch: str, qtype: str) -> None:
    config, model = _MODELS[arch]()
    path = tmp_path / f"{arch}-{qtype}.gguf"
    held = write_converted(path, arch, config, model, qtype)
    if qtype != "F32":  # transformers on the dequantized weights the file holds
        missing, unexpected = model.load_state_dict(held, strict=False)
        assert set(missing) == {"lm_head.weight"} and not unexpected
        model.tie_weights()
    torch.testing.assert_close(pagedlm_logits(path), hf_logits(model), rtol=0, atol=1e-4)


def test_gemma3_config_and_weights(tmp_path: Path) -> None:
    config, model = tiny_gemma3()
    path = tmp_path / "gemma3.gguf"
    write_converted(path, "gemma3", config, model, "F32")
    arch = gguf_arch_config(str(path))
    assert arch.architecture == "Gemma3ForCausalLM"
    assert (arch.head_dim, arch.sliding_window, arch.tie_word_embeddings) == (HEAD_DIM, 8, True)
    assert arch.raw["layer_types"] == LAYER_TYPES == config.layer_types
    assert (arch.rope_theta, arch.raw["rope_local_base_freq"]) == (1e6, 1e4)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert arch.raw["query_pre_attn_scalar"] == HEAD_DIM
    assert arch.raw["final_logit_softcapping"] is None
    weights = dict(iter_gguf_weights(str(path), arch))
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        # The stored 1 + w loses at most one float32 ulp of 1 when the offset comes off.
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-7, msg=name)


def test_gemma3_layer_pattern_and_rope_settings_change_the_logits(tmp_path: Path) -> None:
    """The parity above would not see a wrong layer pattern, local base or global scaling
    if the tiny model were insensitive to them: each must move the logits."""
    config, model = tiny_gemma3()
    path = tmp_path / "gemma3.gguf"
    write_converted(path, "gemma3", config, model, "F32")
    arch = gguf_arch_config(str(path))
    reference = hf_logits(model)
    wrong = [
        {"raw": {**arch.raw, "layer_types": ["sliding_attention"] * 6}},
        {"raw": {**arch.raw, "rope_local_base_freq": 1e6}},
        {"rope_scaling": None},
    ]
    for change in wrong:
        logits = pagedlm_logits(path, dataclasses.replace(arch, **change))
        assert (logits - reference).abs().max() > 1e-2, change


def test_gemma3_file_with_its_vision_tower_loads_the_text_model(tmp_path: Path) -> None:
    config, model = tiny_gemma3()

    def vision_tower(writer: gguf.GGUFWriter) -> None:
        writer.add_uint32("gemma3.vision.block_count", 1)
        rng = np.random.default_rng(0)
        for name, shape in [
            ("v.patch_embd.weight", (32, 48)),
            ("v.blk.0.attn_q.weight", (32, 32)),
            ("v.post_ln.weight", (32,)),
            ("mm.input_projection.weight", (32, 64)),
            ("mm.soft_emb_norm.weight", (32,)),
        ]:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    text, both = tmp_path / "text.gguf", tmp_path / "with-vision.gguf"
    write_converted(text, "gemma3", config, model, "Q8_0")
    write_converted(both, "gemma3", config, model, "Q8_0", add_extras=vision_tower)
    assert gguf_arch_config(str(both)) == gguf_arch_config(str(text))
    torch.testing.assert_close(pagedlm_logits(both), pagedlm_logits(text), rtol=0, atol=0)


def test_an_mmproj_file_is_refused_with_what_to_pass(tmp_path: Path) -> None:
    path = tmp_path / "mmproj-gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_tensor("v.patch_embd.weight", np.zeros((4, 4), dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match=r"mmproj.*main \.gguf"):
        gguf_arch_config(str(path))
