"""The quantized GPU benchmark's CPU-checkable parts: its random Q4_0 GGUF is a file the
loader reads with every linear layer in affine blocks, and its flags parse with the W2
defaults. The timings themselves run on the H200 only."""

from __future__ import annotations

import argparse
import os

import torch

from pagedlm.benchmarks import quantized_gpu
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.gguf_quantized import gguf_linear_blocks

TINY = {
    **quantized_gpu.SHAPE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


def test_random_q4_0_gguf_loads_with_every_linear_in_blocks(tmp_path) -> None:
    path = tmp_path / "tiny-q4_0.gguf"
    size = quantized_gpu.write_random_q4_0_gguf(path, TINY)
    assert size > 0
    config, _ = EngineArgs(model=str(path), dtype="float32").create_engine_config()
    assert config.model.arch.hidden_size == 64 and not config.model.arch.tie_word_embeddings
    model = load_model(config.model, torch.device("cpu"))
    blocks = gguf_linear_blocks(model, str(path))
    linears = [n for n, m in model.named_modules() if isinstance(m, LinearBase)]
    assert sorted(blocks) == sorted(linears)
    down = blocks["model.layers.1.mlp.down_proj"]
    assert torch.equal(down.mins, -8 * down.scales)  # Q4_0: the minimum is -8 d
    assert torch.isfinite(model.lm_head.weight).all()


def test_flags_default_to_w2() -> None:
    parser = argparse.ArgumentParser()
    quantized_gpu.add_args(parser)
    args = parser.parse_args(["--parts", "fp8", "--output-json", "out.json"])
    assert (args.model, args.batch_size, args.input_len, args.output_len) == (
        "llama-3-8b", 1, 1024, 256,
    )  # fmt: skip
    assert args.parts == ["fp8"] and args.quantization is None


def test_tiles_from_a_file_apply_inside_the_block_only(tmp_path, monkeypatch) -> None:
    """``--gemv-configs``: W2 runs once with the default tiles, once with the file's; the
    environment and the parsed table are back as they were after each."""
    from pagedlm_cuda.kernels import gemv as gemv_module

    monkeypatch.delenv(gemv_module.CONFIGS_ENV, raising=False)
    table = tmp_path / "best.json"
    table.write_text('{"4096,4096,gguf4": [8, 256, 1, 3, 4]}')
    parser = argparse.ArgumentParser()
    quantized_gpu.add_args(parser)
    args = parser.parse_args(["--parts", "gguf", "--gemv-configs", str(table)])
    assert quantized_gpu._tile_tables(args) == [None, str(table)]
    default = gemv_module.gemv_config(4096, 4096, "gguf4")
    assert default != (8, 256, 1, 3, 4)
    with quantized_gpu._tiles(str(table)):
        assert gemv_module.gemv_config(4096, 4096, "gguf4") == (8, 256, 1, 3, 4)
    assert gemv_module.CONFIGS_ENV not in os.environ
    assert gemv_module.gemv_config(4096, 4096, "gguf4") == default
    with quantized_gpu._tiles(None):
        assert gemv_module.gemv_config(4096, 4096, "gguf4") == default
