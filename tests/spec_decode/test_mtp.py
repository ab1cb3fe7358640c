"""DeepSeek's multi-token-prediction layer as a proposer (``"mtp"``): the head computes
what the layer computes in a transformers-built reference (its block is transformers'
``DeepseekV3DecoderLayer``, the embedding and LM head the target's), in the expanded and
the latent cache form; greedy outputs with it are those without speculation; the
configuration refuses targets without such a layer."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_executor.test_zoo_models_deepseek import CASES, save_deepseek
from pagedlm import LLM, SamplingParams
from pagedlm.attention.backend import BatchLayout
from pagedlm.kv_cache.interface import TensorKVCache
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import model_kv_geometry
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.models.deepseek_mtp import DeepSeekMTP
from pagedlm_cpu.attention import CpuSdpaBackend
from tiny_checkpoints import model_config

CONFIG_CLASS, V3 = CASES["v3"]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def write_mtp_checkpoint(path: Path):
    """A tiny V3 checkpoint whose config declares one MTP layer and whose file holds it:
    transformers' decoder layer at index ``num_hidden_layers`` (MoE), the MTP parts, and
    the layer's own copies of the embedding and LM head, left random: the target's are
    the ones to use. Returns (the transformers target, the layer, the MTP tensors)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    hf_model = save_deepseek(path, CONFIG_CLASS, {**V3, "num_nextn_predict_layers": 1})
    config = hf_model.config
    index = config.num_hidden_layers
    torch.manual_seed(7)
    layer = DeepseekV3DecoderLayer(config, index).eval()
    hidden, vocab = config.hidden_size, config.vocab_size
    with torch.no_grad():
        for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.1, 0.1)
            else:
                tensor.normal_(0.0, 0.08)
    prefix = f"model.layers.{index}."
    parts = {
        "enorm.weight": torch.rand(hidden) + 0.5,
        "hnorm.weight": torch.rand(hidden) + 0.5,
        "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.08,
        "shared_head.norm.weight": torch.rand(hidden) + 0.5,
        "embed_tokens.weight": torch.randn(vocab, hidden),  # not read
        "shared_head.head.weight": torch.randn(vocab, hidden),  # not read
    }
    tensors = load_file(path / "model.safetensors")
    tensors.update({prefix + n: t.contiguous() for n, t in layer.state_dict().items()})
    tensors.update({prefix + n: t for n, t in parts.items()})
    save_file(tensors, path / "model.safetensors")
    return hf_model, layer, parts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp")
    return (path, *write_mtp_checkpoint(path))


def _reference(hf_model, layer, parts, tokens: list[int]):
    """The layer's outputs and draft logits for rows 0..T-2 (row p: token p+1, the target's
    final normed hidden state at p), as the MTP layer computes them."""
    ids = torch.tensor([tokens])
    rows = len(tokens) - 1
    with torch.no_grad():
        hidden = hf_model.model(ids).last_hidden_state[0, :rows]
        embeds = hf_model.model.embed_tokens(ids[0, 1:]).clone()
        embeds[0] = 0  # position 0
        x = torch.cat(
            [_rms(embeds, parts["enorm.weight"]), _rms(hidden, parts["hnorm.weight"])], -1
        )
        x = x @ parts["eh_proj.weight"].T
        positions = torch.arange(rows)[None]
        cos_sin = hf_model.model.rotary_emb(x[None], positions)
        mask = torch.full((rows, rows), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = layer(
            x[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
        )
        out = out[0] if isinstance(out, tuple) else out
        out = out[0]
        logits = _rms(out, parts["shared_head.norm.weight"]) @ hf_model.lm_head.weight.T
    return hidden, out, logits


@pytest.mark.parametrize("latent", [False, True], ids=["expanded", "latent"])
def test_the_head_computes_the_layer(checkpoint, latent: bool) -> None:
    path, hf_model, layer, parts = checkpoint
    tokens = torch.randint(0, 320, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    hidden, expected, expected_logits = _reference(hf_model, layer, parts, tokens)
    head = load_model(model_config(path), torch.device("cpu"), model_class=DeepSeekMTP)
    if latent:
        head.enable_latent_kv()
    rows, block_size = len(tokens) - 1, 4
    blocks = -(-rows // block_size)
    layout = BatchLayout.from_lists(
        [0, rows], [rows], [list(range(blocks))], range(rows), block_size
    )
    backend = CpuSdpaBackend(torch.device("cpu"))
    g = model_kv_geometry(head, 0, 0)
    assert g.shares_values == latent
    cache = TensorKVCache(
        backend.kv_cache_shape(blocks, block_size, g.num_kv_heads, g.head_dim),
        1,
        block_size,
        torch.float32,
        lambda shape, dtype: torch.zeros(shape, dtype=dtype),
        shares_values=g.shares_values,
    )
    ctx = ForwardContext(backend, backend.build_metadata(layout), cache)
    embeds_in = hf_model.model.embed_tokens(torch.tensor(tokens[1:]))  # the head zeroes row 0
    with torch.no_grad():
        out = head(embeds_in, hidden, torch.arange(rows, dtype=torch.int32), ctx)
        logits = _rms(out, parts["shared_head.norm.weight"]) @ hf_model.lm_head.weight.T
        torch.testing.assert_close(
            head.final_norm(out), _rms(out, parts["shared_head.norm.weight"])
        )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


PROMPTS = [[5, 17, 33, 8, 41, 12, 7, 29] * 3 + [1, 2], [9, 10, 11], [3, 4, 5, 6] * 6]


def _generate(path: Path, speculative_config=None):
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_batched_tokens=24,  # chunked prefill
        block_size=4,
        num_kv_blocks=64,
        speculative_config=speculative_config,
    )
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    stats = llm.llm_engine.engine_core.make_stats()
    llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.fixture(scope="module")
def without_speculation(checkpoint) -> list[list[int]]:
    """The greedy tokens of an engine without a proposer (one run for every case)."""
    return _generate(checkpoint[0])[0]


@pytest.mark.parametrize(("method", "num_tokens"), [("mtp", 1), ("mtp", 3), ("deepseek_mtp", 2)])
def test_greedy_outputs_are_those_without_speculation(
    checkpoint, without_speculation, method, num_tokens
) -> None:
    config = {"method": method, "num_speculative_tokens": num_tokens, "min_acceptance_rate": 0}
    tokens, stats = _generate(checkpoint[0], config)
    assert tokens == without_speculation
    spec = stats.spec_decoding
    assert spec is not None and spec.num_draft_tokens > 0


def test_targets_without_an_mtp_layer_are_refused(checkpoint, tmp_path, tiny_checkpoint) -> None:
    config = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="the target is LlamaForCausalLM"):
        LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, speculative_config=config)
    path = checkpoint[0]
    bare = tmp_path / "no_mtp"
    bare.mkdir()
    raw = json.loads((path / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    (bare / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match="has no multi-token-prediction layer"):
        LLM(str(bare), skip_tokenizer_init=True, speculative_config=config)
    with pytest.raises(ValueError, match="must be the target"):
        LLM(
            str(path),
            skip_tokenizer_init=True,
            speculative_config={**config, "model": str(tiny_checkpoint("llama"))},
        )


def test_several_mtp_layers_are_announced(checkpoint, tmp_path, caplog) -> None:
    """A checkpoint with two MTP layers: the proposer drafts with the first, and says so
    at start-up (vLLM would cycle through both)."""
    from pagedlm.engine.arg_utils import EngineArgs

    path = checkpoint[0]
    two = tmp_path / "two_mtp"
    two.mkdir()
    raw = json.loads((path / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 2}))
    (two / "model.safetensors").symlink_to(path / "model.safetensors")
    config = {"method": "mtp", "num_speculative_tokens": 2}
    with caplog.at_level("WARNING", logger="pagedlm.engine.speculative_args"):
        EngineArgs(
            model=str(two), skip_tokenizer_init=True, speculative_config=config
        ).create_engine_config()
    assert "2 multi-token-prediction layers" in caplog.text


def test_each_first_draft_is_the_layers_argmax(checkpoint, monkeypatch) -> None:
    """Through the engine: the draft for position n is the reference layer's prediction
    from row n - 2 (token n - 1 with the target's hidden state at n - 2), at every step."""
    from pagedlm.spec_decode.mtp import MTPProposer

    path, hf_model, layer, parts = checkpoint
    drafted: list[tuple[int, int]] = []
    original = MTPProposer.propose

    def recording(self, step, requests):
        drafts, counts = original(self, step, requests)
        for n, draft in zip(requests.num_tokens.tolist(), drafts[:, 0].tolist(), strict=True):
            drafted.append((n, draft))
        return drafts, counts

    monkeypatch.setattr(MTPProposer, "propose", recording)
    prompt = PROMPTS[0]
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=128, block_size=4,
              num_kv_blocks=64, speculative_config={"method": "mtp", "num_speculative_tokens": 1,
                                                    "min_acceptance_rate": 0})  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    llm.llm_engine.shutdown()
    tokens = prompt + list(output.outputs[0].token_ids)
    _, _, logits = _reference(hf_model, layer, parts, tokens)
    assert len(drafted) >= 8
    for n, draft in drafted:
        assert draft == int(logits[n - 2].argmax()), (n, draft)


def test_a_weight_update_from_disk_reloads_the_layer(checkpoint, tmp_path) -> None:
    path = checkpoint[0]
    moved = tmp_path / "step2"
    moved.mkdir()
    (moved / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    name = next(n for n in tensors if n.endswith(".enorm.weight"))
    tensors[name] = tensors[name] * 2
    save_file(tensors, moved / "model.safetensors")
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64, num_kv_blocks=32,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})  # fmt: skip

    def enorm(worker) -> torch.Tensor:
        return worker.runner.speculator.proposer.head.layer.enorm.weight.detach().clone()

    [before] = llm.collective_rpc(enorm)
    llm.update_weights_from_disk(str(moved))
    [after] = llm.collective_rpc(enorm)
    llm.llm_engine.shutdown()
    assert before.numel() > 0
    torch.testing.assert_close(after, before * 2)


def test_an_update_to_a_checkpoint_without_the_layer_keeps_it(checkpoint, tmp_path) -> None:
    """A trainer's checkpoint saved by transformers has no MTP layer: the target's weights
    are updated and the proposer keeps its layer (read again from the checkpoint that held
    it, through any number of such updates), until a checkpoint with the layer comes."""
    path = checkpoint[0]
    index = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    tensors = load_file(path / "model.safetensors")
    name = next(n for n in tensors if n.endswith(".enorm.weight"))
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "config.json").write_text((path / "config.json").read_text())
    without = {n: t for n, t in tensors.items() if not n.startswith(f"model.layers.{index}.")}
    norm = "model.norm.weight"
    save_file({**without, norm: without[norm] * 2}, trained / "model.safetensors")
    with_layer = tmp_path / "with_layer"
    with_layer.mkdir()
    (with_layer / "config.json").write_text((path / "config.json").read_text())
    save_file({**tensors, name: tensors[name] * 3}, with_layer / "model.safetensors")
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64, num_kv_blocks=32,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})  # fmt: skip

    def weights(worker) -> tuple[torch.Tensor, torch.Tensor]:
        runner = worker.runner
        return (
            runner.speculator.proposer.head.layer.enorm.weight.detach().clone(),
            runner.model.decoder.norm.weight.detach().clone(),
        )

    [(enorm, final_norm)] = llm.collective_rpc(weights)
    llm.update_weights_from_disk(str(trained))
    [(enorm_1, final_norm_1)] = llm.collective_rpc(weights)
    llm.update_weights_from_disk(str(trained))  # again: the layer's source is remembered
    [(enorm_2, _)] = llm.collective_rpc(weights)
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=4))
    llm.update_weights_from_disk(str(with_layer))
    [(enorm_3, final_norm_3)] = llm.collective_rpc(weights)
    llm.llm_engine.shutdown()
    torch.testing.assert_close(final_norm_1, final_norm * 2)
    assert torch.equal(enorm_1, enorm) and torch.equal(enorm_2, enorm)
    assert len(outputs[0].outputs[0].token_ids) == 4
    torch.testing.assert_close(enorm_3, enorm * 3)
    torch.testing.assert_close(final_norm_3, final_norm)


def test_a_weight_update_from_tensors_reaches_the_layer(checkpoint) -> None:
    """``update_weights_from_tensor`` with the checkpoint's names: the MTP layer takes its
    tensors from them (an RL loop's new policy), not from the files, and keeps none."""
    path = checkpoint[0]
    tensors = load_file(path / "model.safetensors")
    name = next(n for n in tensors if n.endswith(".enorm.weight"))
    tensors[name] = tensors[name] * 3
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64, num_kv_blocks=32,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})  # fmt: skip

    def enorm(worker) -> torch.Tensor:
        return worker.runner.speculator.proposer.head.layer.enorm.weight.detach().clone()

    [before] = llm.collective_rpc(enorm)
    llm.llm_engine.update_weights_from_tensor(tensors)
    [after] = llm.collective_rpc(enorm)
    # The engine keeps none of the caller's tensors (a second copy of the weights).
    alive = [weakref.ref(tensor) for tensor in tensors.values()]
    del tensors
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=4))
    llm.llm_engine.shutdown()
    torch.testing.assert_close(after, before * 3)
    assert len(outputs[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8"])
def test_the_head_loads_from_an_fp8_checkpoint(checkpoint, tmp_path, layout) -> None:
    """An FP8 checkpoint (per-channel or per-tensor codes, the MTP layer's projections
    included): the head reads its own layer's codes and scales, and none of the target's
    tensors (their layers are not the head's)."""
    import re

    from pagedlm.model_executor.quantization import fp8
    from quantization.test_fp8_checkpoints import write_fp8_checkpoint

    quantized = re.compile(
        r"model\.layers\.\d+\.(self_attn\.(q_b|kv_b|o)_proj|mlp\.(experts\.\d+\.|shared_experts\.)?"
        r"\w+_proj)\.weight$"
    )
    state = write_fp8_checkpoint(checkpoint[0], tmp_path / layout, layout, quantized)
    head = load_model(model_config(tmp_path / layout), torch.device("cpu"), model_class=DeepSeekMTP)
    index = json.loads((checkpoint[0] / "config.json").read_text())["num_hidden_layers"]
    layers = {n: m for n, m in head.named_modules() if fp8.is_fp8_layer(m)}
    o_proj = next(m for n, m in layers.items() if n.endswith("self_attn.o_proj"))
    codes = state[f"model.layers.{index}.self_attn.o_proj.weight"]
    assert torch.equal(o_proj.weight.view(torch.uint8), codes.view(torch.uint8))
