"""Speculative decoding end to end on tiny random models: greedy outputs (tokens and
logprobs) are those without speculation for every method, on a mixed batch with chunked
prefill, prefix hits and preemption, with asynchronous scheduling on and off; the heads are
loaded from the EAGLE authors' layouts."""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from spec_decode.tiny_heads import write_eagle, write_eagle3, write_llama

SHARED = [5, 17, 33, 8, 41, 12, 7, 29] * 4  # two blocks: prefix-cache hits
PROMPTS = [
    SHARED + [1, 2, 3],
    [9, 10, 11],
    SHARED + [60, 61],
    [3, 4, 5, 6, 7, 8] * 8 + [3, 4],  # repetitive: n-gram lookups find drafts
]


def _params() -> list[SamplingParams]:
    greedy = dict(temperature=0.0, ignore_eos=True)
    return [
        SamplingParams(max_tokens=32, logprobs=2, **greedy),
        SamplingParams(max_tokens=24, min_tokens=5, stop_token_ids=[91], **greedy),
        SamplingParams(max_tokens=28, **greedy),
        SamplingParams(max_tokens=30, **greedy),
    ]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": str(write_llama(root / "target", num_layers=4, seed=0)),
        "draft": str(write_llama(root / "draft", num_layers=1, seed=3)),
        "eagle": str(write_eagle(root / "eagle")),
        "eagle3": str(write_eagle3(root / "eagle3", aux_layers=[0, 2, 3])),
    }


def _generate(models: dict[str, str], speculative_config=None, **engine_args):
    llm = LLM(
        models["target"],
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_batched_tokens=40,  # chunked prefill of the longer prompts
        num_kv_blocks=10,  # too few for all four at full length: preemption
        block_size=16,
        speculative_config=speculative_config,
        **engine_args,
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    stats = llm.llm_engine.engine_core.make_stats()
    llm.llm_engine.shutdown()
    summary = []
    for out in outputs:
        completion = out.outputs[0]
        # Verification computes in other shapes than decoding: the last digits may differ.
        logprobs = completion.logprobs and [
            sorted((t, pytest.approx(lp.logprob, abs=1e-3)) for t, lp in row.items())
            for row in completion.logprobs
        ]
        summary.append((completion.token_ids, completion.finish_reason, logprobs))
    return summary, stats


@pytest.fixture(scope="module")
def expected(models) -> list:
    summary, stats = _generate(models)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return summary


METHODS = {
    "ngram": lambda m: {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    # The target as its own draft: every draft is right.
    "draft_model": lambda m: {"method": "draft_model", "model": m["target"]},
    "small_draft": lambda m: {"model": m["draft"]},  # method inferred, as vLLM does
    "eagle": lambda m: {"method": "eagle", "model": m["eagle"]},
    "eagle3": lambda m: {"method": "eagle3", "model": m["eagle3"]},
}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_outputs_are_those_without_speculation(
    models, expected, method: str, async_scheduling: bool
) -> None:
    config = {
        **METHODS[method](models),
        "num_speculative_tokens": 3,
        "min_acceptance_rate": 0,  # random heads are rarely right; keep them drafting
    }
    summary, stats = _generate(models, config, async_scheduling=async_scheduling)
    assert summary == expected
    spec = stats.spec_decoding
    assert spec is not None and spec.num_drafts > 0
    if method == "draft_model":
        assert spec.num_accepted_tokens == spec.num_draft_tokens
