"""YaRN rope scaling against transformers: logits of tiny random checkpoints whose prompts
run past the pretraining length (fp32, the paged CPU backend, prefill and decodes); the
context it serves; DeepSeek's mscale attention factor; partial rotation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_utils import PagedRunner
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.layers.rope_frequencies import rope_attention_factor
from pagedlm.model_executor.loader import load_model
from tiny_checkpoints import PROMPT_LENS, model_config, save_with_reference_logits

ORIGINAL = 16
"""The pretraining length: PROMPT_LENS reach 40, so most positions are past it."""
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
CASES = {
    "llama": ("LlamaConfig", {"rope_parameters": {**YARN, "original_max_position_embeddings": ORIGINAL}}),
    "qwen2_top_level_original": (
        "Qwen2Config",
        {"rope_parameters": YARN, "original_max_position_embeddings": ORIGINAL},
    ),
    "llama_mscale": (
        "LlamaConfig",
        {
            "rope_parameters": {
                **YARN,
                "original_max_position_embeddings": ORIGINAL,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "beta_fast": 16,
                "beta_slow": 2,
            }
        },
    ),
    "phi_partial": (
        "PhiConfig",
        {
            "rope_parameters": {
                **YARN,
                "original_max_position_embeddings": ORIGINAL,
                "partial_rotary_factor": 0.5,
            },
        },
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    prompts, expected = save_with_reference_logits(path, *CASES[request.param])
    return load_model(model_config(path, 128), torch.device("cpu")), prompts, expected


def test_prefill_and_decodes_match_transformers(case) -> None:
    model, prompts, expected = case
    runner = PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), 4)
    got = runner.step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)
    decoded = PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), 4).chunk_then_decodes(prompts)
    torch.testing.assert_close(torch.cat(decoded), torch.cat(expected), atol=1e-4, rtol=0)


def test_the_served_context_is_the_pretraining_length_times_the_factor(tmp_path: Path) -> None:
    overrides = {"rope_parameters": YARN, "max_position_embeddings": 40}
    save_with_reference_logits(
        tmp_path, "LlamaConfig", {**overrides, "original_max_position_embeddings": 64}
    )
    config, _ = EngineArgs(model=str(tmp_path), load_format="dummy").create_engine_config()
    assert config.model.max_model_len == 64 * 4
    with pytest.raises(ValueError, match="at most 256"):
        EngineArgs(
            model=str(tmp_path), max_model_len=257, load_format="dummy"
        ).create_engine_config()


def test_attention_factors() -> None:
    assert rope_attention_factor(None) == 1.0
    assert rope_attention_factor({"rope_type": "yarn", "factor": 4.0}) == pytest.approx(
        0.1 * torch.tensor(4.0).log().item() + 1
    )
    assert (
        rope_attention_factor({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.5}) == 0.5
    )
    deepseek = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert rope_attention_factor(deepseek) == 1.0  # equal terms cancel


def test_llm_greedy_matches_transformers_past_the_pretraining_length(tmp_path: Path) -> None:
    """Through ``LLM`` (the CPU platform's fused rotary and decode kernels read the table
    with the attention factor in it): transformers' tokens, 24 past a 40-token prompt."""
    from pagedlm import LLM, SamplingParams
    from tiny_checkpoints import hf_greedy, load_hf_model, random_prompts

    save_with_reference_logits(tmp_path, *CASES["llama"])
    prompts = random_prompts([40, 9])
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = hf_greedy(load_hf_model(tmp_path), prompts, 24)
    assert [o.outputs[0].token_ids for o in outs] == expected
