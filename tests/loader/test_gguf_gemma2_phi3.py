"""GGUF for gemma2 and phi3: tiny random HF models written the way llama.cpp's converter does.

Gemma 2: every norm weight stored as ``1 + w``, soft caps and the sliding window in metadata,
no ``output`` tensor (tied head). Phi-3: fused ``attn_qkv`` and ``ffn_up`` (gate and up),
partial rotation in ``rope.dimension_count``, LongRoPE factors as ``rope_factors_long`` /
``rope_factors_short`` tensors. pagedlm's logits are compared with the original HF model and
with transformers loading the same file through its own GGUF path.
"""

from __future__ import annotations

import json
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
ROTARY_DIM = 12  # Phi-3 partial rotation: 0.75 of each head
ORIGINAL_CONTEXT = 128


def tiny_gemma2():
    return tiny_causal_lm(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        norm_center=0.0,  # Gemma stores 1 + w: a missing or doubled +1 must show
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=8,  # shorter than PROMPT, so the sliding layer really slides
        # Larger than default weights and small caps, so that both caps change the logits
        # (at the default 0.02 the attention scores never come near 5).
        initializer_range=0.1,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        rms_norm_eps=1e-6,
        attn_implementation="eager",  # transformers' SDPA path ignores the attention cap
    )


def tiny_phi3():
    rng = np.random.default_rng(0)
    return tiny_causal_lm(
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        original_max_position_embeddings=ORIGINAL_CONTEXT,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": ROTARY_DIM / HEAD_DIM,
            "long_factor": rng.uniform(1.0, 8.0, ROTARY_DIM // 2).tolist(),
            "short_factor": rng.uniform(0.8, 1.5, ROTARY_DIM // 2).tolist(),
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
    )


def write_converted_gguf(path: Path, arch: str, config, model, qtype_name: str) -> None:
    """What convert_hf_to_gguf writes for ``arch`` (the parts pagedlm and transformers read)."""
    state_dict = dict(model.state_dict())
    if arch == "gemma2":
        state_dict.pop("lm_head.weight")  # tied: the file has no ``output`` tensor
        state_dict = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in state_dict.items()}

        def add_extras(writer: gguf.GGUFWriter) -> None:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
            writer.add_sliding_window(config.sliding_window)

        write_gguf(path, arch, config, state_dict, qtype_name, add_extras=add_extras)
        return

    def add_rope_scaling(writer: gguf.GGUFWriter) -> None:
        factor = config.max_position_embeddings / ORIGINAL_CONTEXT
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL_CONTEXT)
        writer.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(factor) / np.log(ORIGINAL_CONTEXT)))
        )
        for kind in ("long", "short"):
            factors = np.asarray(config.rope_parameters[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)

    write_gguf(
        path,
        arch,
        config,
        state_dict,
        qtype_name,
        rope_dims=ROTARY_DIM,
        add_extras=add_rope_scaling,
    )


def pagedlm_logits(path: Path, max_model_len: int = 64) -> torch.Tensor:
    arch = gguf_arch_config(str(path))
    config = ModelConfig(str(path), None, arch, torch.float32, max_model_len)
    model = load_model(config, torch.device("cpu"))
    return full_logits(model, arch, CpuSdpaBackend(torch.device("cpu")), PROMPT)


def transformers_gguf_logits(path: Path, model_class, config) -> torch.Tensor:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = model_class(config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    model = model_class(config).eval()
    state = {k: v.float() for k, v in parsed["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Gemma ties the head, so the file has no lm_head tensor.
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    if missing:
        model.tie_weights()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


_MODELS = {"gemma2": tiny_gemma2, "phi3": tiny_phi3}


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_logits_match_hf_and_transformers_gguf(tmp_path: Path, arch: str, qtype: str) -> None:
    config, model = _MODELS[arch]()
    path = tmp_path / f"{arch}-{qtype}.gguf"
    write_converted_gguf(path, arch, config, model, qtype)
    ours = pagedlm_logits(path)
    reference = transformers_gguf_logits(path, type(model), config)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    if qtype == "F32":
        with torch.no_grad():
            original = model(torch.tensor([PROMPT])).logits[0]
        torch.testing.assert_close(ours, original, rtol=0, atol=1e-4)


def test_gemma2_config_and_norms(tmp_path: Path) -> None:
    config, model = tiny_gemma2()
    path = tmp_path / "gemma2.gguf"
    write_converted_gguf(path, "gemma2", config, model, "F32")
    arch = gguf_arch_config(str(path))
    assert arch.architecture == "Gemma2ForCausalLM"
    assert (arch.head_dim, arch.sliding_window) == (HEAD_DIM, 8)
    assert arch.raw["attn_logit_softcapping"] == 5.0
    assert arch.raw["final_logit_softcapping"] == 3.0
    assert arch.raw["query_pre_attn_scalar"] == HEAD_DIM
    assert arch.tie_word_embeddings
    weights = dict(iter_gguf_weights(str(path), arch))
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        # The stored 1 + w loses at most one float32 ulp of 1 when the offset comes off.
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-7, msg=name)


def test_phi3_longrope_config_and_long_factors(tmp_path: Path) -> None:
    config, model = tiny_phi3()
    path = tmp_path / "phi3.gguf"
    write_converted_gguf(path, "phi3", config, model, "F32")
    arch = gguf_arch_config(str(path))
    assert arch.architecture == "Phi3ForCausalLM"
    assert arch.raw["partial_rotary_factor"] == ROTARY_DIM / HEAD_DIM
    scaling = arch.rope_scaling
    assert scaling is not None and scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == ORIGINAL_CONTEXT
    for kind in ("long", "short"):
        np.testing.assert_allclose(
            scaling[f"{kind}_factor"], config.rope_parameters[f"{kind}_factor"], rtol=1e-6
        )
    names = {name for name, _ in iter_gguf_weights(str(path), arch)}
    assert names == set(model.state_dict())  # the rope factors are config, not weights
    # Serving past the pretraining length switches pagedlm to the long factors: the GGUF
    # must then give what the same model gives from its HF directory.
    directory = tmp_path / "hf"
    model.save_pretrained(directory)
    hf_arch = ArchConfig.from_hf_dict(json.loads((directory / "config.json").read_text()))
    hf_model = load_model(
        ModelConfig(str(directory), None, hf_arch, torch.float32, 256), torch.device("cpu")
    )
    from_hf = full_logits(hf_model, hf_arch, CpuSdpaBackend(torch.device("cpu")), PROMPT)
    long_gguf = pagedlm_logits(path, max_model_len=256)
    torch.testing.assert_close(long_gguf, from_hf, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(long_gguf, pagedlm_logits(path, max_model_len=64), atol=1e-3)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    finish(writer)
    with pytest.raises(ValueError, match=r"'falcon'.*gemma2, phi3"):
        gguf_arch_config(str(path))
