"""Pausing generation with worker processes (TP=2 on gloo): requests kept through a pause
that clears the cache are preempted on every rank (the ranks hear of it with the next
step), recompute their KV on resume and give one worker's run; an aborting pause frees
every rank's requests."""

from __future__ import annotations

from parity import NEW_TOKENS, PROMPTS, assert_same_run, make_llm, processes_gone

from pagedlm import SamplingParams


def test_kept_requests_continue_on_every_rank(llama, llama_reference):
    llm = make_llm(llama, tensor_parallel_size=2)
    engine = llm.llm_engine
    core = engine.engine_core
    pids = list(core.executor.worker_pids)
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, prompt_logprobs=0, ignore_eos=True
    )
    finals = {}

    def run(outputs) -> None:
        for output in outputs:
            if output.finished:
                finals[output.request_id] = output

    try:
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
        for _ in range(3):
            run(engine.step())
        outputs = core.pause("keep", clear_cache=True)
        run(engine.output_processor.process_outputs(outputs).request_outputs)
        assert core.make_stats().num_running_reqs == 0  # preempted, their blocks freed
        core.resume()
        for _ in range(100):  # bounded
            run(engine.step())
            if not engine.has_unfinished_requests():
                break
        assert_same_run([finals[str(i)] for i in range(len(PROMPTS))], llama_reference)

        engine.add_request("aborted", {"prompt_token_ids": PROMPTS[0]}, params)
        engine.step()
        outputs = core.pause("abort")
        assert [o.finish_reason for o in outputs if o.finished] == ["abort"]
        core.resume()
        engine.output_processor.process_outputs(outputs)
        assert_same_run(
            llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False),
            llama_reference[1:2],
        )
    finally:
        engine.shutdown()
    assert processes_gone(pids)
