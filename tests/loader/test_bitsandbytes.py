"""quantization="bitsandbytes" on CPU: 4-bit (nf4, fp4) and 8-bit linear layers.

Tolerances. 4-bit: bitsandbytes maps each weight to the nearest of 16 code values times
its block's absmax (64 weights per block). The widest gap between neighbouring codes is
0.30 (nf4, between -1 and -0.696) and 0.33 (fp4, between 2/3 and 1), so no weight moves by
more than 0.17 x its block absmax; the model must compute exactly with those weights.
8-bit: weights and activations are rounded to 1/127 of their row's absmax; on these tiny
random models the logits move by less than 0.1 of their standard deviation (measured 0.06).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import bitsandbytes.functional as bnb_functional
import pytest
import torch
import transformers

from model_utils import full_logits
from pagedlm import LLM, SamplingParams
from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead
from pagedlm.model_executor.loader import load_model
from pagedlm_cpu.attention import CpuSdpaBackend

PROMPT = list(range(1, 30))
_BLOCK_ERROR = 0.17


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bnb-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_bias=True, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def load(path: Path, quant_type: str | None = None) -> torch.nn.Module:
    arch = ArchConfig.from_directory(path)
    extra = {"quantization": "bitsandbytes", "bnb_quant_type": quant_type} if quant_type else {}
    return load_model(
        ModelConfig(str(path), None, arch, torch.float32, 64, **extra), torch.device("cpu")
    )


def logits(model: torch.nn.Module, path: Path) -> torch.Tensor:
    arch = ArchConfig.from_directory(path)
    return full_logits(model, arch, CpuSdpaBackend(torch.device("cpu")), PROMPT)


def linear_layers(model: torch.nn.Module) -> dict[str, LinearBase]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, LinearBase) and not isinstance(module, ParallelLMHead)
    }


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_model_computes_with_the_dequantized_weights(
    checkpoint: Path, quant_type: str
) -> None:
    quantized, reference = load(checkpoint, quant_type), load(checkpoint)
    layers, float_layers = linear_layers(quantized), linear_layers(reference)
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down per layer; the LM head stays float
    with torch.no_grad():
        for name, layer in layers.items():
            assert layer.weight.dtype == torch.uint8
            kernel = layer.kernel
            weight = bnb_functional.dequantize_4bit(kernel.packed, kernel.quant_state)
            original = float_layers[name].weight
            blocks, dequantized = original.reshape(-1, 64), weight.reshape(-1, 64)
            bound = blocks.abs().amax(dim=1, keepdim=True) * _BLOCK_ERROR
            assert bool(((dequantized - blocks).abs() <= bound).all()), name
            float_layers[name].weight.copy_(weight)
    torch.testing.assert_close(
        logits(quantized, checkpoint), logits(reference, checkpoint), rtol=1e-4, atol=1e-5
    )


def test_8bit_logits_stay_close(checkpoint: Path) -> None:
    quantized, reference = load(checkpoint, "int8"), load(checkpoint)
    assert all(layer.weight.dtype == torch.int8 for layer in linear_layers(quantized).values())
    got, expected = logits(quantized, checkpoint), logits(reference, checkpoint)
    assert (got - expected).abs().max() < 0.1 * expected.std()
    assert (got - expected).abs().max() > 0, "8-bit should not be lossless on random weights"


@pytest.mark.parametrize(
    ("quant_type", "bytes_per_weight"), [("nf4", 0.5), ("fp4", 0.5), ("int8", 1)]
)
def test_weight_memory_shrinks(checkpoint: Path, quant_type: str, bytes_per_weight: float) -> None:
    reference = linear_layers(load(checkpoint))
    float_bytes = sum(layer.weight.numel() * 4 for layer in reference.values())
    quantized_bytes = 0
    for layer in linear_layers(load(checkpoint, quant_type)).values():
        for tensor in (layer.weight, layer.weight_scales):
            quantized_bytes += tensor.numel() * tensor.element_size()
    num_weights = float_bytes // 4
    # Scales: one float32 per 64-weight block (4-bit) or per output row (8-bit).
    scale_bytes = 4 / 64 if quant_type != "int8" else 0
    expected = num_weights * (bytes_per_weight + scale_bytes)
    assert expected <= quantized_bytes <= expected * 1.05
    assert quantized_bytes < float_bytes * (0.15 if quant_type != "int8" else 0.27)


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_llm_generates_with_bitsandbytes(checkpoint: Path, quant_type: str) -> None:
    llm = LLM(model=str(checkpoint), quantization="bitsandbytes", bnb_quant_type=quant_type,
              skip_tokenizer_init=True, num_kv_blocks=16, max_model_len=64)  # fmt: skip
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPT[:5]}, {"prompt_token_ids": PROMPT[:11]}],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )
    assert [len(out.outputs[0].token_ids) for out in outputs] == [6, 6]


def save_prequantized(source: Path, target: Path, quant_type: str) -> None:
    """The checkpoint transformers writes for a bitsandbytes model: packed weights with their
    QuantState (4-bit) or SCB row scales (8-bit) and ``quantization_config`` in config.json."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        is_linear = name.endswith("_proj.weight")
        if is_linear and quant_type == "int8":
            codes, scales, _ = bnb_functional.int8_vectorwise_quant(tensor)
            tensors[name], tensors[name.removesuffix(".weight") + ".SCB"] = codes, scales
        elif is_linear:
            packed, state = bnb_functional.quantize_4bit(
                tensor, blocksize=64, quant_type=quant_type, compress_statistics=True
            )
            tensors[name] = packed
            for part, value in state.as_dict(packed=True).items():
                tensors[f"{name}.{part}"] = value
        else:
            tensors[name] = tensor
    save_file(tensors, target / "model.safetensors")
    if quant_type == "int8":
        config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    else:
        config["quantization_config"] = {
            "quant_method": "bitsandbytes", "load_in_4bit": True,
            "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": True,
        }  # fmt: skip
    (target / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_prequantized_checkpoint_loads(checkpoint: Path, tmp_path: Path, quant_type: str) -> None:
    from pagedlm.engine.arg_utils import EngineArgs

    save_prequantized(checkpoint, tmp_path, quant_type)
    config, _ = EngineArgs(model=str(tmp_path), dtype="float32").create_engine_config()
    assert (config.model.quantization, config.model.bnb_quant_type) == ("bitsandbytes", quant_type)
    model = load_model(config.model, torch.device("cpu"))
    # Without quantization the same file loads as float32: its dequantized weights.
    dequantized = load_model(replace(config.model, quantization=None), torch.device("cpu"))
    got, expected = logits(model, checkpoint), logits(dequantized, checkpoint)
    if quant_type == "nf4":
        # Dequantize -> quantize reproduces the saved codes exactly (whole rows are merged),
        # so the model computes with exactly the checkpoint's weights.
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    else:
        assert (got - expected).abs().max() < 0.1 * expected.std()
    original = logits(load(checkpoint), checkpoint)
    assert (got - original).abs().max() < 1.0 * original.std()


def test_other_quantized_checkpoints_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    from pagedlm.engine.arg_utils import EngineArgs

    for file in checkpoint.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with 'hqq', which pagedlm cannot load"):
        EngineArgs(model=str(tmp_path)).create_engine_config()
