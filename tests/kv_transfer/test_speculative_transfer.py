"""KV connectors beside n-gram speculative decoding, on CPU: a verifying step feeds drafts
past the request's known tokens, and under asynchronous scheduling its start assumes the
step in flight accepted all of its drafts; neither may put a draft's KV into a saved block.

Repetitive prompts make the proposer draft (and some drafts get rejected); each engine's
greedy tokens must equal an engine's without a connector, on the run that saves and on the
one that loads (the offloading pool's generated blocks, another engine's stored prompt).
"""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from tiny_checkpoints import save_random_model

BLOCK = 4
ENGINE = dict(skip_tokenizer_init=True, max_model_len=64, block_size=BLOCK, num_kv_blocks=32)
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "min_acceptance_rate": 0,
}
PROMPTS = [[5, 9, 2] * 6 + [7], [11, 3] * 8 + [1, 2], [4, 4, 8, 1, 4, 4, 8] * 2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("speculative-transfer-llama")
    save_random_model(path, "LlamaConfig", {"vocab_size": 64})
    return str(path)


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    return generate(LLM(model, enable_prefix_caching=False, **ENGINE), PROMPTS)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def external(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.external


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offloaded_blocks_of_a_speculating_engine_hold_no_draft(model, expected, async_scheduling):
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": 64},
    }
    llm = LLM(
        model,
        kv_transfer_config=transfer,
        speculative_config=SPECULATIVE,
        async_scheduling=async_scheduling,
        enable_prefix_caching=False,
        **ENGINE,
    )
    assert generate(llm, PROMPTS) == expected
    stats = llm.llm_engine.engine_core.scheduler.speculation.stats()
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # drafts and rejections
    # The next turn: each prompt and its continuation, loaded (generated blocks included).
    turns = [prompt + output for prompt, output in zip(PROMPTS, expected, strict=True)]
    reference = generate(LLM(model, enable_prefix_caching=False, **ENGINE), turns)
    assert generate(llm, turns) == reference
    assert external(llm).num_loaded_tokens > sum(len(p) for p in PROMPTS) // 2
    assert external(llm).num_failed_tokens == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_speculating_consumer_loads_what_a_speculating_producer_stored(
    model, expected, tmp_path, async_scheduling
):
    def engine(role: str) -> LLM:
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        }
        return LLM(
            model,
            kv_transfer_config=transfer,
            speculative_config=SPECULATIVE,
            async_scheduling=async_scheduling,
            **ENGINE,
        )

    assert generate(engine("kv_producer"), PROMPTS) == expected
    consumer = engine("kv_consumer")
    assert generate(consumer, PROMPTS) == expected
    # Every full prompt block but the one of the last prompt token.
    loadable = sum((len(p) - 1) // BLOCK * BLOCK for p in PROMPTS)
    assert external(consumer).num_loaded_tokens == loadable
