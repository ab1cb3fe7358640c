"""Real weights on CPU: the embedded SmolLM2-135M-Instruct asked to repeat or edit a given
paragraph, with n-gram speculation. Greedy outputs must equal those without speculation and
the mean acceptance length must reach 2; the tok/s ratio is printed (``-s`` shows it)."""

from __future__ import annotations

import time

import pytest

from pagedlm import LLM, SamplingParams

PARAGRAPH = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper "
    "climbed the ninety steps, trimmed the wick and wound the clockwork that turned the lens. "
    "Ships passing the reef saw the beam sweep the water every twelve seconds, and knew to "
    "steer east until the light fell behind them."
)
REQUESTS = [
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Rewrite the following paragraph, replacing 'lighthouse' with 'tower':\n\n{PARAGRAPH}",
    f"Copy this paragraph, then write its first sentence again:\n\n{PARAGRAPH}",
    f"Fix the capitalization only and return the paragraph:\n\n{PARAGRAPH.lower()}",
]


def _run(path: str, speculative_config) -> tuple[list[list[int]], float, object]:
    llm = LLM(path, dtype="float32", max_model_len=1024, speculative_config=speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=96)
    conversations = [[{"role": "user", "content": text}] for text in REQUESTS]
    llm.chat(conversations[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.llm_engine.engine_core.make_stats().spec_decoding
    tokens = [o.outputs[0].token_ids for o in outputs]
    llm.llm_engine.shutdown()
    return tokens, sum(map(len, tokens)) / elapsed, stats


@pytest.mark.slow
def test_ngram_on_repeat_and_edit_prompts(smollm2_path) -> None:
    plain, plain_rate, _ = _run(smollm2_path, None)
    config = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    spec, spec_rate, stats = _run(smollm2_path, config)
    print(
        f"\nSmolLM2 + ngram: mean acceptance length {stats.mean_acceptance_length:.2f}, "
        f"accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafted, "
        f"{plain_rate:.1f} -> {spec_rate:.1f} tok/s ({spec_rate / plain_rate:.2f}x)"
    )
    assert spec == plain
    assert stats.mean_acceptance_length >= 2.0
