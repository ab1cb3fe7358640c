"""Speculative decoding through the CUDA platform's step path, on the CPU: the Triton
attention backend and sampler under the interpreter, verification and decode steps replayed
from (emulated) CUDA graphs with padding rows, in-flight rejections corrected on the device
(the backend reads device lengths only). Greedy tokens must be those without speculation,
and a draft model that is the target itself must have every draft accepted (slow: the
interpreter takes ~40 s per engine). Fast: the Triton backend's verification steps
(``1 + k`` queries per request over a context) through its graph hooks, padding rows
included, against the float64 reference of the conformance kit."""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from spec_decode.tiny_heads import write_llama
from spec_decode.triton_cpu import NAME, ON_GPU, triton_cpu_platform

pytestmark = pytest.mark.skipif(ON_GPU, reason="the GPU runs tests/cuda/test_spec_decode_cuda.py")

PROMPTS = [[5, 17, 33, 8] * 5 + [1, 2], [9, 10, 11], [3, 4, 5, 6] * 4]
K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(write_llama(tmp_path_factory.mktemp("spec-triton") / "target", 2, seed=0))


def _generate(target: str, speculative_config, async_scheduling: bool):
    with triton_cpu_platform() as platform:
        llm = LLM(
            target,
            platform=NAME,
            skip_tokenizer_init=True,
            max_model_len=128,
            max_num_seqs=4,
            block_size=16,
            num_kv_blocks=24,
            async_scheduling=async_scheduling,
            speculative_config=speculative_config,
            # float32 whatever the CPU (auto is bf16 where it is native): the verification
            # and decode kernels round differently, and bf16 near-ties could flip tokens.
            dtype="float32",
        )
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        stats = llm.llm_engine.engine_core.make_stats().spec_decoding
        llm.llm_engine.shutdown()
        replays = {q: sum(g.num_replays(q) for g in platform.graph_runners) for q in (1, 1 + K)}
    return [o.outputs[0].token_ids for o in outputs], stats, replays


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    tokens, _, replays = _generate(target, None, async_scheduling=True)
    assert replays[1] > 0  # decode steps ran from graphs
    return tokens


def test_verification_steps_replay_with_padding_rows(monkeypatch) -> None:
    from pagedlm.testing import AttentionTarget, HeadShape, graph_checks
    from pagedlm_cuda.attention import TritonAttentionBackend

    # The kit's graph check at the verification's query length; head_dim 8 as the tiny
    # models' (below tl.dot's minimum K of 16 on the GPU: the kernels pad it).
    monkeypatch.setattr(graph_checks, "GRAPH_QUERY_LENS", (1 + K,))
    target = AttentionTarget(
        TritonAttentionBackend, block_sizes=(16,), head_shapes=(HeadShape(4, 2, 8),)
    )
    graph_checks.check_graph_replay(target)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_self_draft_accepts_every_draft_and_keeps_greedy_tokens(
    target, plain, async_scheduling: bool
) -> None:
    config = {"method": "draft_model", "model": target, "num_speculative_tokens": K}
    tokens, stats, replays = _generate(target, config, async_scheduling)
    assert tokens == plain
    assert stats is not None and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert replays[1 + K] > 0  # verification steps ran from graphs


@pytest.mark.slow
def test_ngram_keeps_greedy_tokens(target, plain) -> None:
    config = {
        "method": "ngram",
        "prompt_lookup_min": 2,
        "num_speculative_tokens": K,
        "min_acceptance_rate": 0,
    }
    tokens, stats, _ = _generate(target, config, async_scheduling=True)
    assert tokens == plain
    assert stats is not None and stats.num_drafts > 0
