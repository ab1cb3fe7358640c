"""vLLM's ``prompt_tokens_by_source`` through the offline engine with a KV connector (the
host-memory pool, vLLM's ``OffloadingConnector``): a prompt whose prefix the device cache
lost to other prompts loads it from host memory, and the loaded tokens count as
"external_kv_transfer", the rest of the cached ones as "local_cache_hit" (tiny random
Llama, CPU)."""

from __future__ import annotations

from pagedlm import LLM, SamplingParams
from tiny_checkpoints import random_prompts


def by_source(llm: LLM) -> dict[str, float]:
    return {
        m.labels["source"]: m.value
        for m in llm.get_metrics()
        if m.name == "pagedlm:prompt_tokens_by_source"
    }


def test_loaded_tokens_count_as_external_kv_transfer(tiny_checkpoint):
    llm = LLM(
        str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=16,
        max_num_batched_tokens=32,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": 64},
        },
        disable_log_stats=False,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def run(prompts: list[list[int]]):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    first, *others = random_prompts([21, 21, 21, 21], seed=11)
    run([first])
    assert by_source(llm) == {"local_compute": 21, "local_cache_hit": 0, "external_kv_transfer": 0}
    run(others)  # 6 blocks each through 16 device blocks: the first prompt's are reused
    before = by_source(llm)
    (again,) = run([first])
    loaded = llm.llm_engine.engine_core.scheduler.external.num_loaded_tokens
    assert loaded > 0 and again.num_cached_tokens == 20
    after = by_source(llm)
    delta = {source: after[source] - before[source] for source in after}
    # Its last token is computed again (20 of 21 cached): vLLM counts it as computed and
    # as a local cache hit.
    assert delta == {
        "local_compute": 1,
        "local_cache_hit": 20 - loaded + 1,
        "external_kv_transfer": loaded,
    }
