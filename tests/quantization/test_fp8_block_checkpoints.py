"""Block-scaled FP8 checkpoints (vLLM's ``fp8`` with ``weight_block_size``, as Qwen3-FP8
and DeepSeek-V3 ship): written here from a tiny random llama with a float32
``weight_scale_inv`` per block, edge blocks partial. Loaded, each weight is exactly
``codes * scale`` of its block, and the model is what quantizing those weights at load
gives (``quantization="fp8"``: per-row scales)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_utils import full_logits
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.quantization import fp8
from pagedlm.model_executor.quantization.fp8_checkpoint import (
    dequantize_blocks,
    fp8_checkpoint_scheme,
)
from pagedlm_cpu.attention import CpuSdpaBackend
from tiny_checkpoints import model_config, random_prompts, save_random_model

_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.weight$")
BLOCK = (32, 64)
"""Rows x columns per scale: 96-wide layers end in a partial block."""
CPU = torch.device("cpu")


def _write(source: Path, block_target: Path, float_target: Path) -> dict[str, torch.Tensor]:
    """The block-scaled checkpoint, and beside it a float one holding exactly the weights
    it stands for; returns those weights."""
    state = load_file(source / "model.safetensors")
    floats, dequantized = dict(state), {}
    for name in [n for n in state if _LINEAR.match(n)]:
        weight = state.pop(name)
        rows, cols = weight.shape
        grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
        padded = torch.zeros(grid[0] * BLOCK[0], grid[1] * BLOCK[1])
        padded[:rows, :cols] = weight
        blocks = padded.view(grid[0], BLOCK[0], grid[1], BLOCK[1])
        scale = blocks.abs().amax(dim=(1, 3)) / fp8.FP8_MAX  # [grid rows, grid cols]
        spread = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
        codes = (padded / spread).to(fp8.FP8_DTYPE)[:rows, :cols].contiguous()
        state[name], state[name + "_scale_inv"] = codes, scale
        dequantized[name] = codes.float() * spread[:rows, :cols]
        floats[name] = dequantized[name]
    config = json.loads((source / "config.json").read_text())
    for target, tensors in ((block_target, state), (float_target, floats)):
        target.mkdir()
        save_file(tensors, target / "model.safetensors")
        (target / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (block_target / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fp8-blocks")
    save_random_model(root / "source", "LlamaConfig", {"architectures": ["LlamaForCausalLM"]})
    dequantized = _write(root / "source", root / "blocks", root / "float")
    return root / "blocks", root / "float", dequantized


def test_the_stream_dequantizes_each_block_exactly(checkpoints) -> None:
    blocks, _, dequantized = checkpoints
    scheme = fp8_checkpoint_scheme(json.loads((blocks / "config.json").read_text()))
    assert scheme.block_size == BLOCK and scheme.method == "fp8"
    out = dict(dequantize_blocks(load_file(blocks / "model.safetensors").items(), BLOCK))
    assert not any(name.endswith("_scale_inv") for name in out)
    for name, weight in dequantized.items():
        assert torch.equal(out[name], weight)


def test_a_block_checkpoint_is_its_weights_quantized_per_row(checkpoints) -> None:
    blocks, floats, _ = checkpoints
    config, _ = EngineArgs(model=str(blocks), skip_tokenizer_init=True, dtype="float32")\
        .create_engine_config()  # fmt: skip
    assert config.model.quantization == "fp8"
    loaded = load_model(config.model, CPU)
    online = load_model(replace(model_config(floats), quantization="fp8"), CPU)
    layers = {n: m for n, m in loaded.named_modules() if fp8.is_fp8_layer(m)}
    assert len(layers) == 8
    for name, module in online.named_modules():
        if name in layers:
            assert torch.equal(
                layers[name].weight.view(torch.uint8), module.weight.view(torch.uint8)
            )
    backend, prompt = CpuSdpaBackend(CPU), random_prompts()[2]
    with torch.no_grad():
        got = full_logits(loaded, config.model.arch, backend, prompt)
        want = full_logits(online, config.model.arch, backend, prompt)
    assert torch.equal(got, want)


def test_static_activations_with_blocks_and_a_missing_scale_are_refused(
    checkpoints, tmp_path: Path
) -> None:
    raw = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                   "weight_block_size": [128, 128]}}  # fmt: skip
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_checkpoint_scheme(raw)
    blocks, _, _ = checkpoints
    tensors = load_file(blocks / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match="down_proj's codes but not its scale"):
        list(dequantize_blocks(tensors.items(), BLOCK))
