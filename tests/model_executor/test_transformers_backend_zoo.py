"""Architectures forced through the Transformers modeling backend against transformers
itself (tiny random fp32 checkpoints): greedy tokens equal, prompt logprobs within 1e-4.

Each brings something the backend must carry from transformers' own modules: Qwen3's
per-head q/k norms, Gemma 2's scaled embedding, (1 + weight) norms, attention and final
logit soft caps and alternating sliding windows, Phi-3's packed q/k/v and gate/up, OLMo 2's
whole-projection q/k norms after the projections, Cohere's LayerNorm and logit scale,
Granite's multipliers, StarCoder2's biased GELU MLP, GPT-NeoX's interleaved q/k/v and
parallel residual, Qwen2-MoE's and Mixtral's experts saved one by one and fused on load.
The engine chunks the prompts (8-token steps over 4-token blocks).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

from pagedlm import LLM, SamplingParams
from pagedlm.model_executor.models.transformers_checkpoint import (
    ExpertMerges,
    checkpoint_renames,
    renamed,
)
from pagedlm.model_executor.models.transformers_layers import tensor_parallel_refusal
from tiny_checkpoints import SMALL, hf_greedy, hf_logits, random_prompts, save_random_model

NEW_TOKENS = 5
LENS = [1, 9, 30, 4]
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, **IDS)  # fmt: skip
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, **IDS)
CASES = {
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 30.0,
         "final_logit_softcapping": 20.0, "query_pre_attn_scalar": 16, **IDS},
    ),
    "phi3": ("Phi3Config", {**IDS}),
    "olmo2": ("Olmo2Config", {**IDS}),
    "cohere": ("CohereConfig", {"logit_scale": 0.5, **IDS}),
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 4.0,
         "attention_multiplier": 0.2},
    ),
    "starcoder2": ("Starcoder2Config", {**IDS}),
    # GPT-NeoX attends with every head as kv head: config.json must not say otherwise.
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.5, "num_key_value_heads": 4, **IDS}),
    # Experts saved one by one (mlp.experts.0.gate_proj.weight, ...), merged on load into
    # transformers' fused experts; Qwen2-MoE adds a gated shared expert.
    "qwen2_moe": ("Qwen2MoeConfig", QWEN2_MOE),
    "mixtral": ("MixtralConfig", MIXTRAL),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_forced_through_the_backend_matches_transformers(case: str, tmp_path: Path) -> None:
    config_class, overrides = CASES[case]
    hf_model = save_random_model(tmp_path, config_class, overrides)
    prompts = random_prompts(LENS)
    llm = LLM(
        str(tmp_path),
        model_impl="transformers",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=8,
        num_kv_blocks=64,
    )
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(
        hf_model, prompts, NEW_TOKENS
    )
    for output, prompt in zip(outputs, prompts, strict=True):
        if len(prompt) < 2:
            continue
        want = torch.log_softmax(hf_logits(hf_model, prompt), -1)[:-1]
        want = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = torch.tensor([d[t].logprob for d, t in zip(output.prompt_logprobs[1:], prompt[1:])])
        # GPU kernels take float32 dots in TF32 (seen: up to 3.5e-3, Gemma 2, an H100)
        atol = 1e-4 if llm.llm_engine.config.platform == "cpu" else 5e-3
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_a_config_whose_head_counts_the_model_ignores_is_refused(tmp_path: Path) -> None:
    """GPT-NeoX ignores num_key_value_heads; a config.json that gives one would size the
    KV cache for heads the model does not have: refused, naming the fix."""
    save_random_model(tmp_path, "GPTNeoXConfig", {"num_key_value_heads": 2, **IDS})
    params = SamplingParams(max_tokens=2)
    # Refused at the first forward: the GPU's memory profiling at start-up, the CPU's step.
    with pytest.raises(ValueError, match=r"4 query and 4 key/value heads.*sized for 4 and 2"):
        llm = LLM(str(tmp_path), model_impl="transformers", dtype="float32",
                  skip_tokenizer_init=True, max_model_len=64, num_kv_blocks=16)  # fmt: skip
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)


def test_experts_are_merged_as_transformers_saved_them(tmp_path: Path) -> None:
    """The checkpoint holds each expert's projections apart; the backend's fused
    parameters equal transformers' own, bit for bit."""
    hf_model = save_random_model(tmp_path, "Qwen2MoeConfig", QWEN2_MOE)
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved
    assert not any("gate_up_proj" in name for name in saved)
    llm = LLM(str(tmp_path), model_impl="transformers", dtype="float32",
              skip_tokenizer_init=True, max_model_len=64, num_kv_blocks=16)  # fmt: skip
    ours = dict(llm.llm_engine.engine_core.executor.worker.model_runner.model.hf.named_parameters())
    for name, param in hf_model.named_parameters():
        if ".experts." in name:
            assert torch.equal(ours[name].cpu(), param.detach()), name


def test_experts_missing_from_the_checkpoint_are_refused(tmp_path: Path) -> None:
    """A checkpoint lacking one expert's tensor would leave part of a fused parameter
    unset: refused, naming the parameter and what was seen."""
    save_random_model(tmp_path, "Qwen2MoeConfig", QWEN2_MOE)
    path = tmp_path / "model.safetensors"
    tensors = safetensors.torch.load_file(path)
    del tensors["model.layers.0.mlp.experts.2.down_proj.weight"]
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"3 of the 4 tensors.*model\.layers\.0\.mlp\.experts\.down_proj"
    ):
        LLM(str(tmp_path), model_impl="transformers", dtype="float32", skip_tokenizer_init=True,
            max_model_len=64, num_kv_blocks=16)  # fmt: skip


def test_experts_arriving_in_any_order_are_held_only_until_complete(tmp_path: Path) -> None:
    """Shuffled saved tensors (Mixtral's, renamed from block_sparse_moe): each fused
    parameter comes out once its last expert arrives, equal to transformers', and only
    incomplete targets stay held."""
    hf_model = save_random_model(tmp_path, "MixtralConfig", MIXTRAL)
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in saved
    merges, renames = ExpertMerges(hf_model), checkpoint_renames(hf_model)
    names = sorted(saved)
    random.Random(0).shuffle(names)
    merged: dict[str, torch.Tensor] = {}
    for saved_name in names:
        merge = merges.target_of(renamed(saved_name, renames))
        if merge is not None:
            merged.update(merges.add(saved_name, merge, saved[saved_name]))
        assert all(len(p.sources) < p.expected for p in merges.pending.values())
    merges.finish()
    fused = {n: p for n, p in hf_model.named_parameters() if ".experts." in n}
    assert merged.keys() == fused.keys()
    for name, param in fused.items():
        assert torch.equal(merged[name], param.detach()), name


@pytest.mark.parametrize(("config_class", "overrides"), [("Qwen2MoeConfig", QWEN2_MOE),
                                                          ("MixtralConfig", MIXTRAL)])  # fmt: skip
def test_fused_experts_refuse_tensor_parallelism(config_class: str, overrides: dict) -> None:
    """Fused experts are not split across ranks, whatever the model's plan says of them
    (transformers 5.25's Mixtral plan names only attention, 5.17's an expert style)."""
    config = getattr(transformers, config_class)(**{**SMALL, **overrides})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    refusal = tensor_parallel_refusal(model.base_model, model.config, 2)
    assert refusal is not None and "fused in layers.0.mlp.experts.gate_up_proj" in refusal
    assert tensor_parallel_refusal(model.base_model, model.config, 1) is None
