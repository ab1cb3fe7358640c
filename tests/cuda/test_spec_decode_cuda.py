"""Speculative decoding on the GPU: verification steps (1 + k tokens per request) and the
draft model / EAGLE forwards replayed from CUDA graphs give the tokens of eager runs, and
close to those without speculation. Run on the lent GPU with ``-m cuda`` (not run in CI).

Verification attends with the verification kernel where decoding uses the decode kernel, so
float32 (tf32 dots) outputs may part ways after a near-tie; graphs against eager, with
the same kernels, must agree exactly.
"""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from spec_decode.tiny_heads import write_eagle, write_eagle3, write_llama

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 17, 33, 8] * 8 + [1, 2], [9, 10, 11], list(range(20, 90)), [3, 4, 5, 6] * 10]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec-cuda")
    return {
        "target": str(write_llama(root / "target", num_layers=4, seed=0)),
        "eagle": str(write_eagle(root / "eagle")),
        "eagle3": str(write_eagle3(root / "eagle3", aux_layers=[0, 2, 3])),
    }


def _generate(models, speculative_config, enforce_eager: bool):
    llm = LLM(
        models["target"],
        platform="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        num_kv_blocks=64,
        enforce_eager=enforce_eager,
        speculative_config=speculative_config,
    )
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    stats = llm.llm_engine.engine_core.make_stats().spec_decoding
    llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outputs], stats


CONFIGS = {
    "ngram": lambda m: {"method": "ngram", "prompt_lookup_min": 2},
    "draft_model": lambda m: {"method": "draft_model", "model": m["target"]},
    "eagle": lambda m: {"method": "eagle", "model": m["eagle"]},
    "eagle3": lambda m: {"method": "eagle3", "model": m["eagle3"]},
}


@pytest.mark.parametrize("method", list(CONFIGS))
def test_graphs_give_the_eager_tokens_and_close_to_no_speculation(models, method: str) -> None:
    config = {**CONFIGS[method](models), "num_speculative_tokens": 3, "min_acceptance_rate": 0}
    plain, _ = _generate(models, None, enforce_eager=False)
    graphs, stats = _generate(models, config, enforce_eager=False)
    eager, _ = _generate(models, config, enforce_eager=True)
    assert graphs == eager
    assert stats.num_drafts > 0
    agreeing = sum(
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        for x, y in zip(plain, graphs)
    )
    assert agreeing >= 0.8 * sum(len(x) for x in plain)
    if method == "draft_model":
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
