"""GGUF reading on tiny random llama checkpoints: config, names, layout, dequantization."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny_gguf import finish, interleave_rotary_rows

from pagedlm.config import ArchConfig
from pagedlm.model_executor.loader.gguf_loader import (
    gguf_arch_config,
    iter_gguf_weights,
    read_gguf_header,
    unpermute_rotary_rows,
)


def load(path) -> dict[str, torch.Tensor]:
    path = str(path)
    return dict(iter_gguf_weights(path, gguf_arch_config(path)))


def transformers_gguf_tensors(path, num_layers: int) -> dict[str, torch.Tensor]:
    """transformers' own GGUF reading (GGUFReader + its llama q/k reverse permutation)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # Only parameter names matter to the name mapping; shapes come from the file.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(
            LlamaConfig(num_hidden_layers=num_layers, vocab_size=8, hidden_size=8,
                        intermediate_size=8, num_attention_heads=2, num_key_value_heads=1)
        )  # fmt: skip
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    return parsed["tensors"]


@pytest.mark.parametrize("tie", [False, True])
def test_arch_config_matches_hf_config(llama_gguf_factory, tie):
    path, config, _ = llama_gguf_factory("F32", tie)
    expected = ArchConfig.from_hf_dict({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    got = gguf_arch_config(str(path))
    for field in dataclasses.fields(ArchConfig):
        if field.name not in ("torch_dtype", "raw"):
            assert getattr(got, field.name) == getattr(expected, field.name), field.name
    assert got.torch_dtype is None
    assert got.tie_word_embeddings is tie
    assert got.raw["general.architecture"] == "llama"


@pytest.mark.parametrize("tie", [False, True])
def test_f32_weights_are_exact_in_hf_layout(llama_gguf_factory, tie):
    path, _, state_dict = llama_gguf_factory("F32", tie)
    weights = load(path)
    assert set(weights) == set(state_dict)
    assert ("lm_head.weight" in weights) is not tie
    for name, expected in state_dict.items():
        assert weights[name].dtype == torch.float32
        assert weights[name].is_contiguous()
        torch.testing.assert_close(weights[name], expected, rtol=0, atol=0, msg=name)


def test_f16_weights_equal_half_rounding(llama_gguf_factory):
    path, _, state_dict = llama_gguf_factory("F16")
    weights = load(path)
    for name, expected in state_dict.items():
        # 2-D weights went through float16; 1-D norms were written as F32.
        rounded = expected.half().float() if expected.ndim == 2 else expected
        torch.testing.assert_close(weights[name], rounded, rtol=0, atol=0, msg=name)


# Worst-case error per 32-value block, as a fraction of the block's largest magnitude. Q8_0
# rounds to steps of absmax/127 (error <= half a step; we allow a whole step for the float16
# scale). Q4_0 maps the signed extreme to -8, so the other sign may clip at +7: one step of
# absmax/8. Q4_1 spans [min, max] in 15 steps, <= 2*absmax/15 per step.
_BLOCK_ERROR = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 2 / 15}


@pytest.mark.parametrize("qtype", sorted(_BLOCK_ERROR))
def test_quantized_weights_within_block_error(llama_gguf_factory, qtype):
    path, _, state_dict = llama_gguf_factory(qtype)
    weights = load(path)
    for name, expected in state_dict.items():
        if expected.ndim == 1:
            torch.testing.assert_close(weights[name], expected, rtol=0, atol=0, msg=name)
            continue
        blocks = expected.reshape(-1, 32)
        error = (weights[name].reshape(-1, 32) - blocks).abs()
        bound = blocks.abs().amax(dim=1, keepdim=True) * _BLOCK_ERROR[qtype] * 1.01
        assert bool((error <= bound).all()), f"{name}: {(error - bound).max()}"
        assert error.max() > 0, "quantization should not be lossless on random weights"


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_matches_transformers_gguf_loader(llama_gguf_factory, qtype):
    path, config, _ = llama_gguf_factory(qtype)
    reference = transformers_gguf_tensors(path, config.num_hidden_layers)
    weights = load(path)
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference[name].float(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("num_heads", "head_dim", "columns"), [(4, 16, 8), (3, 64, 1), (1, 2, 5)])
def test_unpermute_inverts_llama_cpp_permutation(num_heads, head_dim, columns):
    torch.manual_seed(0)
    shape = (num_heads * head_dim, columns) if columns > 1 else (num_heads * head_dim,)
    original = torch.randn(shape)
    permuted = torch.from_numpy(interleave_rotary_rows(original.numpy(), num_heads))
    assert not torch.equal(permuted, original) or head_dim == 2
    torch.testing.assert_close(unpermute_rotary_rows(permuted, num_heads), original, rtol=0, atol=0)


def test_unpermute_rejects_odd_heads():
    with pytest.raises(ValueError, match="heads"):
        unpermute_rotary_rows(torch.zeros(12, 4), 4)


def _write(path, arch: str, tensors: dict[str, np.ndarray], **metadata) -> str:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_key_value(key, *value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    finish(writer)
    return str(path)


def test_other_architecture_is_rejected(tmp_path):
    import gguf

    path = _write(
        tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 8), np.float32)},
        **{"gpt2.block_count": (1, gguf.GGUFValueType.UINT32)},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"'gpt2'.*supports llama"):
        gguf_arch_config(path)
    with pytest.raises(ValueError, match="'gpt2'"):
        next(iter_gguf_weights(path, None))  # type: ignore[arg-type]


def test_llama3_rope_freqs_are_rejected(llama_gguf_factory, tmp_path):
    import gguf

    source, _, _ = llama_gguf_factory("F32")
    header = read_gguf_header(str(source))
    u32 = gguf.GGUFValueType.UINT32
    metadata = {key: (value, u32) for key, value in header.metadata.items() if "count" in key}
    path = _write(
        tmp_path / "llama3.gguf", "llama", {"rope_freqs.weight": np.ones(8, np.float32)}, **metadata
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_arch_config(path)


def test_unknown_tensor_name_is_an_error(tmp_path, llama_gguf_factory):
    arch = gguf_arch_config(str(llama_gguf_factory("F32")[0]))
    fused = {"blk.0.attn_qkv.weight": np.zeros((4, 4), np.float32)}
    path = _write(tmp_path / "fused.gguf", "llama", fused)
    with pytest.raises(ValueError, match="attn_qkv"):
        list(iter_gguf_weights(path, arch))


def test_reader_matches_gguf_reader_on_every_value_type(tmp_path):
    import gguf

    types = gguf.GGUFValueType
    metadata = {
        "t.u8": (200, types.UINT8), "t.i8": (-5, types.INT8), "t.u16": (60000, types.UINT16),
        "t.i16": (-3000, types.INT16), "t.u32": (4_000_000_000, types.UINT32),
        "t.i32": (-7, types.INT32), "t.f32": (0.1, types.FLOAT32), "t.bool": (True, types.BOOL),
        "t.str": ("héllo wörld", types.STRING), "t.u64": (2**60, types.UINT64),
        "t.i64": (-(2**40), types.INT64), "t.f64": (1 / 3, types.FLOAT64),
        "t.strs": (["a", "", "ü b"], types.ARRAY), "t.ints": ([1, -2, 3], types.ARRAY),
        "t.floats": ([0.5, -1.25], types.ARRAY), "t.bools": ([True, False], types.ARRAY),
    }  # fmt: skip
    path = _write(
        tmp_path / "types.gguf", "llama", {"x.weight": np.arange(6, dtype=np.float32)}, **metadata
    )
    ours = read_gguf_header(path).metadata
    reference = gguf.GGUFReader(path)
    for key, (value, _) in metadata.items():
        if key == "t.f32":
            # Same float32 bits; we report the decimal that was written (0.1, not 0.10000000149).
            assert np.float32(ours[key]) == np.float32(reference.fields[key].contents())
            assert ours[key] == 0.1
        else:
            assert ours[key] == reference.fields[key].contents() == value, key
    assert ours["t.f64"] == 1 / 3


def test_not_a_gguf_and_truncated_files(tmp_path, llama_gguf_factory):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_header(str(junk))

    source, _, _ = llama_gguf_factory("F32")
    data = source.read_bytes()
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:200])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_header(str(head))
    tail = tmp_path / "tail.gguf"
    tail.write_bytes(data[:-1000])
    with pytest.raises(ValueError, match="truncated"):
        load(tail)


def test_importing_the_loader_does_not_import_gguf():
    code = (
        "import sys, pagedlm, pagedlm.tokenizer, pagedlm.model_executor.loader.gguf_loader, "
        "pagedlm.model_executor.loader.default_model; "
        "assert 'gguf' not in sys.modules, 'gguf imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
