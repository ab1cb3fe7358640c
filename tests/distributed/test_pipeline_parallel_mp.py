"""Pipeline parallelism over two stages (gloo): each holds one layer, hidden states and
residuals go stage to stage, two batches in flight at once; the tokens are one worker's."""

from __future__ import annotations

import torch
from parity import assert_same_run, greedy_run, processes_gone

from pagedlm import LLM, SamplingParams

PROMPT_LENS = [30, 5, 22, 17, 9, 26]
MAX_TOKENS = [24, 3, 16, 24, 7, 20]


def _generate(engine, requests, abort_in_flight: str | None = None) -> dict[str, list[int]]:
    """Drive ``engine`` step by step; abort ``abort_in_flight`` once a step in flight holds
    it and it has two tokens. Returns each request's tokens."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {}
    core = engine.engine_core
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        if abort_in_flight in tokens and len(tokens[abort_in_flight]) >= 2:
            in_flight = [step.scheduler_output.req_ids for step in core._batch_queue]
            if any(abort_in_flight in ids for ids in in_flight):
                engine.abort_request([abort_in_flight])
                abort_in_flight = None
    assert not engine.has_unfinished_requests() and not core.has_step_in_flight
    return tokens


def test_two_pipeline_stages(llama, llama_reference):
    """The parity run (prompt logprobs included), then a token budget that splits the
    requests into two batches and a cache too small for all of them: two steps in flight
    at once, requests preempted and finishing while the other batch computes, one aborted
    in flight; the tokens are one worker's. (One engine: starting one takes long here.)"""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    requests = [(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params, strict=True))]
    common = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=8)
    reference = LLM(str(llama), num_kv_blocks=64, **common)
    try:
        expected = _generate(reference.llm_engine, requests)
    finally:
        reference.llm_engine.shutdown()
    victim = ("victim", prompts[0][:12], SamplingParams(max_tokens=60, ignore_eos=True))
    llm = LLM(
        str(llama),
        num_kv_blocks=8,
        max_num_batched_tokens=32,
        pipeline_parallel_size=2,
        **common,
    )
    core = llm.llm_engine.engine_core
    pids = list(core.executor.worker_pids)
    try:
        assert_same_run(greedy_run(llm), llama_reference)
        got = _generate(llm.llm_engine, [*requests, victim], abort_in_flight="victim")
        assert core.max_steps_in_flight_seen == 2
        assert core.scheduler.num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()
    assert 2 <= len(got.pop("victim")) < 60
    assert got == expected
    assert len(pids) == 2 and processes_gone(pids)
