"""Prefix-cache hits and proposers whose KV reads the next token (EAGLE heads).

An EAGLE head's KV at position ``p`` is computed from the target's hidden state at ``p`` and
the token at ``p + 1``. A cached block's last position was therefore written with the next
token of the request that filled it, which the block's hash does not cover: a request that
shares the block but continues differently must compute that block again (vLLM's
``use_eagle``), or its drafts are made over another request's KV. Drafts are deterministic
functions of a request's tokens, so a request's drafts must not depend on what ran before.
"""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from spec_decode.tiny_heads import write_eagle, write_eagle3, write_llama

SHARED = [5, 17, 33, 8, 41, 12, 7, 29] * 2  # two blocks of 8
FIRST = SHARED + [1, 2, 3]
SECOND = SHARED + [60, 61, 62]  # the same two blocks, another next token


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefix-drafts")
    return {
        "target": str(write_llama(root / "target", num_layers=4, seed=0)),
        "eagle": str(write_eagle(root / "eagle")),
        "eagle3": str(write_eagle3(root / "eagle3", aux_layers=[0, 2, 3])),
    }


def _drafts_of_last(models: dict[str, str], method: str, prompts: list[list[int]]):
    """The last prompt's tokens and every draft its steps proposed, each prompt run alone
    in turn on one engine."""
    llm = LLM(
        models["target"],
        skip_tokenizer_init=True,
        max_model_len=128,
        block_size=8,
        num_kv_blocks=32,
        speculative_config={
            "method": method,
            "model": models[method],
            "num_speculative_tokens": 3,
            "min_acceptance_rate": 0,
        },
    )
    scheduler = llm.llm_engine.engine_core.scheduler
    drafts: dict[str, list[list[int]]] = {}
    update = scheduler.update_from_output

    def recording(scheduler_output, runner_output):
        for req_id, ids in (runner_output.draft_token_ids or {}).items():
            drafts.setdefault(req_id, []).append(list(ids))
        return update(scheduler_output, runner_output)

    scheduler.update_from_output = recording
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt in prompts:
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    hits = scheduler.kv_manager.prefix_cache_hits
    llm.llm_engine.shutdown()
    return output.outputs[0].token_ids, drafts[output.request_id], hits


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_do_not_depend_on_who_filled_the_cached_prefix(models, method):
    alone_tokens, alone_drafts, _ = _drafts_of_last(models, method, [SECOND])
    tokens, drafts, hits = _drafts_of_last(models, method, [FIRST, SECOND])
    assert tokens == alone_tokens
    assert drafts == alone_drafts
    assert hits == 8  # the first shared block is a hit; the second is computed again
