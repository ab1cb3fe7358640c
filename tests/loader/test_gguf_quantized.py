"""The GGUF file's blocks routed into each linear layer's layout (stacked, un-permuted, tied)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_gguf import tiny_causal_lm, write_gguf

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.gguf_quantized import gguf_linear_blocks

# One type per 2-D tensor, in state-dict order: embed, then q k v o gate up down per layer,
# then lm_head. Layer 0 mixes types inside qkv (v in Q6_K, which has no affine form) and
# inside gate_up (Q4_0 + Q4_1); the LM head is F16.
MIXED = [
    "Q8_0",
    *("Q4_K", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "Q4_1", "Q5_0"),
    *("Q5_1", "Q8_0", "Q4_1", "Q4_K", "Q5_K", "Q8_0", "Q4_0"),
    "F16",
]


def _load(tmp_path: Path, qtypes, tie: bool, dtype: str = "float32"):
    from transformers import LlamaConfig, LlamaForCausalLM

    # Rows of 256 so that K-quants (256-weight super-blocks) fit.
    _, hf_model = tiny_causal_lm(
        LlamaConfig,
        LlamaForCausalLM,
        hidden_size=256,
        intermediate_size=512,
        vocab_size=64,
        tie_word_embeddings=tie,
    )
    state_dict = dict(hf_model.state_dict())
    if tie:
        state_dict.pop("lm_head.weight")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", hf_model.config, state_dict, qtypes, tokenizer_pre=None)
    config, _ = EngineArgs(model=str(path), dtype=dtype, platform="cpu").create_engine_config()
    return load_model(config.model, torch.device("cpu")), str(path)


def _linears(model) -> dict[str, LinearBase]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_layer_gets_its_blocks_and_the_weights_stay(tmp_path, dtype):
    model, path = _load(tmp_path, ["Q8_0", "Q4_0", "Q5_1", "Q4_K"], tie=False, dtype=dtype)
    before = {name: p.clone() for name, p in model.named_parameters()}
    found = gguf_linear_blocks(model, path)
    assert set(found) == set(_linears(model))  # qkv and gate_up included, and the LM head
    for name, module in _linears(model).items():
        blocks = found[name]
        assert blocks.codes.shape == module.weight.shape
        assert torch.equal(blocks.dequantize().to(module.weight.dtype), module.weight)
    # The stand-ins are gone: same parameters, same values.
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    assert all(torch.equal(after[name], value) for name, value in before.items())


def test_a_tied_head_gets_the_embedding_blocks(tmp_path):
    model, path = _load(tmp_path, "Q8_0", tie=True)
    found = gguf_linear_blocks(model, path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head" in found
    assert torch.equal(found["lm_head"].dequantize(), model.lm_head.weight)
    assert int(found["lm_head"].codes.max()) > 15  # 8-bit codes


def test_layers_fed_by_a_type_without_affine_form_are_left_out(tmp_path):
    model, path = _load(tmp_path, MIXED, tie=False)
    found = gguf_linear_blocks(model, path)
    assert "model.layers.0.self_attn.qkv_proj" not in found  # v_proj is Q6_K
    assert "lm_head" not in found  # F16
    expected = set(_linears(model)) - {"model.layers.0.self_attn.qkv_proj", "lm_head"}
    assert set(found) == expected
    for name in expected:
        weight = _linears(model)[name].weight
        assert torch.equal(found[name].dequantize(), weight)


def _load_keeping_blocks(path: str, dtype: str = "float32", groups_of_16: bool = False):
    config, _ = EngineArgs(model=path, dtype=dtype, platform="cpu").create_engine_config()
    return load_model(
        config.model, torch.device("cpu"), keep_weight_blocks=True, gguf_groups_of_16=groups_of_16
    )


@pytest.mark.parametrize(
    ("qtypes", "tie", "groups_of_16"),
    [(MIXED, False, False), ("Q8_0", True, False), (MIXED, False, True)],
)
def test_loading_that_keeps_the_blocks_routes_the_same_blocks(tmp_path, qtypes, tie, groups_of_16):
    model, path = _load(tmp_path, qtypes, tie=tie)
    expected = gguf_linear_blocks(model, path, groups_of_16)
    if groups_of_16:  # layer 0's qkv (v in Q6_K) joins, with a scale per 16 columns
        assert expected["model.layers.0.self_attn.qkv_proj"].group_size == 16
    kept_model = _load_keeping_blocks(path, groups_of_16=groups_of_16)
    kept = gguf_linear_blocks(kept_model, path)
    assert set(kept) == set(expected)
    for name, blocks in expected.items():
        for part in ("codes", "scales", "mins"):
            assert torch.equal(getattr(kept[name], part), getattr(blocks, part)), (name, part)
    # Every parameter outside the kept, unshared layers holds the ordinary load's values
    # (norms, the embedding a tied head shares, layers fed by a type without blocks).
    unfilled = {f"{name}.weight" for name in kept if not (tie and name == "lm_head")}
    reference = dict(model.named_parameters())
    for name, param in kept_model.named_parameters():
        if name not in unfilled:
            assert torch.equal(param, reference[name]), name
    # The hand-over happens once; a second call reads the file and checks the weights.
    assert set(gguf_linear_blocks(model, path, groups_of_16)) == set(expected)


def test_kept_blocks_are_handed_over_once(tmp_path):
    _, path = _load(tmp_path, "Q8_0", tie=True)
    model = _load_keeping_blocks(path)
    kept = gguf_linear_blocks(model, path)
    assert "lm_head" in kept
    # The other kept layers' weights are uninitialized memory, which may hold the very
    # values the first load freed: overwrite them, as the kernels that replace them do.
    with torch.no_grad():
        for name in kept.keys() - {"lm_head"}:
            model.get_submodule(name).weight.fill_(float("nan"))
    # Read again from the file: only the tied head has a float weight to reproduce.
    assert set(gguf_linear_blocks(model, path)) == {"lm_head"}


def test_groups_of_16_bring_in_q6_k_and_stay_only_where_needed(tmp_path):
    """For kernels that take a scale per 16 columns (CUDA): layer 0's qkv, whose v rows are
    Q6_K, gets its blocks with groups of 16 (q/k's scales repeated); every other layer keeps
    a scale per 32; each still reproduces its weight exactly."""
    qtypes = [*MIXED[:-1], "Q6_K"]  # the LM head in Q6_K as well
    model, path = _load(tmp_path, qtypes, tie=False)
    plain = gguf_linear_blocks(model, path)
    found = gguf_linear_blocks(model, path, groups_of_16=True)
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert set(found) == set(_linears(model)) and set(found) - set(plain) == {qkv, "lm_head"}
    assert found[qkv].group_size == 16 and found["lm_head"].group_size == 16
    for name, module in _linears(model).items():
        assert torch.equal(found[name].dequantize(), module.weight), name
        if name in plain:
            assert found[name].group_size == 32
            for part in ("codes", "scales", "mins"):
                assert torch.equal(getattr(found[name], part), getattr(plain[name], part))


def test_keeping_the_blocks_never_allocates_the_kept_weights(tmp_path):
    """Linear weights are built on the meta device; those of kept layers end up empty, the
    rest (layer 0's qkv fed by Q6_K, the F16 head) allocated and filled as usual."""
    model, path = _load(tmp_path, MIXED, tie=False)
    kept_model = _load_keeping_blocks(path)
    assert not any(p.is_meta for p in kept_model.parameters())
    kept = gguf_linear_blocks(kept_model, path)
    reference = _linears(model)
    assert set(kept) == set(reference) - {"model.layers.0.self_attn.qkv_proj", "lm_head"}
    for name, module in _linears(kept_model).items():
        if name in kept:
            assert module.weight.numel() == 0
        else:
            assert torch.equal(module.weight, reference[name].weight), name
