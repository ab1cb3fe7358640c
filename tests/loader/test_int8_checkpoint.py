"""compressed-tensors int8 checkpoints ("int-quantized": llm-compressor's W8A8; the
activation rounding is not applied): a tiny random Llama's projections rounded to int8 per
tensor, per channel or per group (with zero points), written as such; pagedlm's logits
against transformers' on the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loader.test_int_checkpoint import PROJECTIONS, _config, _logits, save_with_reference
from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.quantization.int8_checkpoint import (
    dequantize_int8,
    int8_checkpoint_scheme,
)
from tiny_checkpoints import hf_greedy, hf_logits, random_prompts, save_random_model

CASES = {
    "tensor": ("tensor", None, True),
    "channel_w8a8": ("channel", None, True),
    "group_asymmetric": ("group", 32, False),
}


def _round(weight: torch.Tensor, strategy: str, group_size: int | None, symmetric: bool):
    """int8 codes [out, in]; scales (bf16 values, as stored) and int8 zero points shaped as
    the checkpoint stores them ([1], [out, 1] or [out, groups]); the dequantized weight."""
    out_features, in_features = weight.shape
    shape = {
        "tensor": (1, 1, -1),
        "channel": (out_features, 1, in_features),
        "group": (out_features, -1, group_size),
    }[strategy]
    grouped = weight.reshape(shape)
    low, high = grouped.amin(-1), grouped.amax(-1)
    if symmetric:
        scale, zero = torch.maximum(low.abs(), high.abs()) / 127, torch.zeros_like(low)
    else:
        scale = (high - low) / 255
        zero = torch.round(-128 - low / scale)
    scale = scale.to(torch.bfloat16).float()
    codes = torch.clamp(torch.round(grouped / scale[..., None]) + zero[..., None], -128, 127)
    dequantized = ((codes - zero[..., None]) * scale[..., None]).reshape(weight.shape)
    stored_shape = (1,) if strategy == "tensor" else tuple(scale.shape)
    return (
        codes.reshape(weight.shape).to(torch.int8),
        scale.reshape(stored_shape),
        zero.reshape(stored_shape).to(torch.int8),
        dequantized,
    )


def _write(path: Path, strategy: str, group_size: int | None, symmetric: bool):
    save_random_model(path, "LlamaConfig", {"intermediate_size": 96})
    tensors = load_file(path / "model.safetensors")
    dequantized_tensors = dict(tensors)
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        codes, scale, zero, dequantized = _round(tensors[name], strategy, group_size, symmetric)
        layer = name.removesuffix(".weight")
        tensors[name] = codes
        tensors[f"{layer}.weight_scale"] = scale
        dequantized_tensors[name] = dequantized
        tensors[f"{layer}.input_scale"] = torch.tensor([0.02])  # static activations: dropped
        if not symmetric:
            tensors[f"{layer}.weight_zero_point"] = zero
    weights = {"num_bits": 8, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group_size}  # fmt: skip
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                   "strategy": "token"}  # fmt: skip
    quantization_config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": activations}},
        "ignore": ["lm_head"],
    }  # fmt: skip
    return save_with_reference(path, tensors, dequantized_tensors, quantization_config)


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = _write(path, *CASES[request.param])
    prompts = random_prompts()
    return path, prompts, [hf_logits(hf_model, p) for p in prompts], hf_model


def test_int8_layers_load_as_their_dequantized_weights(checkpoint) -> None:
    path, prompts, expected, _ = checkpoint
    config = _config(path)
    assert config.quantization is None and not config.has_weight_blocks
    model = load_model(config, torch.device("cpu"))
    torch.testing.assert_close(_logits(model, prompts), torch.cat(expected), atol=1e-4, rtol=0)


def test_generation_matches_transformers_and_fp8_storage_loads(checkpoint) -> None:
    path, prompts, _, hf_model = checkpoint
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(hf_model, prompts, 6)
    config, _ = EngineArgs(model=str(path), quantization="fp8").create_engine_config()
    assert config.model.quantization == "fp8"
    with pytest.raises(ValueError, match="load as float weights; quantization='awq'"):
        EngineArgs(model=str(path), quantization="awq").create_engine_config()


def test_a_layer_without_its_scale_is_named() -> None:
    scheme = int8_checkpoint_scheme(
        {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                 "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8,
                                                                     "strategy": "channel"}}}}}
    )  # fmt: skip
    assert scheme is not None and scheme.symmetric
    stream = [("model.layers.0.mlp.up_proj.weight", torch.zeros(4, 8, dtype=torch.int8))]
    with pytest.raises(ValueError, match=r"up_proj's \['codes'\] but not its \['weight_scale'\]"):
        list(dequantize_int8(stream, scheme))
