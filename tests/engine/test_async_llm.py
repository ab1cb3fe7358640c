"""AsyncLLM against a real engine-core process on a tiny random model with a real tokenizer."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from pagedlm import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs

NUM_KV_BLOCKS = 48
"""768 tokens of KV cache: 20 short requests fit at once, a 900-token one never does."""
ENGINE_KWARGS = dict(num_kv_blocks=NUM_KV_BLOCKS, max_model_len=1024, block_size=16)
PROMPTS = [
    "Hello world, this is",
    "The quick brown fox",
    "Café, résumé",
    "日本語のテキスト",
    "Emoji: 😀 🎉",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, bpe_tokenizer):
    """A tiny Llama whose vocabulary is the byte-level BPE tokenizer's, saved together."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(bpe_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
        eos_token_id=bpe_tokenizer.eos_token_id,
    )
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama-bpe")
    model.save_pretrained(path)
    bpe_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), **ENGINE_KWARGS))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), **ENGINE_KWARGS)


async def _collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def _assert_idle(engine):
    stats = await engine.get_scheduler_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    assert stats.kv_cache_usage == 0.0
    metrics = {(m.name, tuple(m.labels.items())): m.value for m in engine.get_metrics()}
    assert metrics[("pagedlm:num_requests_running", (("engine", "0"),))] == 0
    assert metrics[("pagedlm:kv_cache_usage_perc", (("engine", "0"),))] == 0.0


def test_config_and_tokenizer(engine, model_dir):
    assert engine.config.model.model == str(model_dir)
    assert engine.config.model.max_model_len == 1024
    assert engine.get_tokenizer() is not None
    assert not engine.errored
    asyncio.run(engine.check_health())


def test_delta_and_cumulative_streams_agree(engine):
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    delta_params = SamplingParams(**base, output_kind=RequestOutputKind.DELTA)
    cumulative_params = SamplingParams(**base, output_kind=RequestOutputKind.CUMULATIVE)
    final_params = SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY)

    async def main():
        return await asyncio.gather(
            _collect(engine, PROMPTS[0], delta_params, "delta"),
            _collect(engine, PROMPTS[0], cumulative_params, "cumulative"),
            _collect(engine, PROMPTS[0], final_params, "final"),
        )

    delta, cumulative, final = asyncio.run(main())
    assert len(final) == 1 and final[0].finished
    expected = final[0].outputs[0]
    assert len(expected.token_ids) == 12
    assert all(not out.finished for out in delta[:-1]) and delta[-1].finished
    assert "".join(out.outputs[0].text for out in delta) == expected.text
    assert [t for out in delta for t in out.outputs[0].token_ids] == expected.token_ids
    assert len(delta) >= 2, "DELTA must stream more than one output"
    assert cumulative[-1].outputs[0].text == expected.text
    assert cumulative[-1].outputs[0].token_ids == expected.token_ids
    lengths = [len(out.outputs[0].token_ids) for out in cumulative]
    assert lengths == sorted(lengths) and lengths[-1] == 12


def test_a_consumer_that_falls_behind_gets_merged_deltas(engine):
    """While the event loop is held, the core keeps stepping; when it is free again the
    waiting steps reach the consumer as a few merged outputs, not one per step, and the
    tokens are exactly the undisturbed run's."""
    import time

    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def main():
        expected = await _collect(engine, PROMPTS[1], params, "steady")
        outputs = []
        async for output in engine.generate(PROMPTS[1], params, "held"):
            if not outputs:
                time.sleep(3.0)  # hold the loop (a busy server): the steps queue up
            outputs.append(output)
        return expected, outputs

    expected, held = asyncio.run(main())
    tokens = [t for out in held for t in out.outputs[0].token_ids]
    assert tokens == [t for out in expected for t in out.outputs[0].token_ids]
    assert "".join(o.outputs[0].text for o in held) == "".join(o.outputs[0].text for o in expected)
    assert len(held) < len(expected) / 2, [len(o.outputs[0].token_ids) for o in held]


def test_concurrent_greedy_requests_match_llm(engine, llm):
    """20 concurrent requests (mixed lengths, a stop string, n=2) equal LLM's results."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(20)]
    params = [
        SamplingParams(temperature=0, max_tokens=4 + i % 7, ignore_eos=True, logprobs=i % 3)
        for i in range(20)
    ]
    params[3] = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=6, ignore_eos=True)
    reference = llm.generate(prompts, params, use_tqdm=False)
    # A stop string taken from the middle of a greedy output makes the front end abort the
    # request in the core.
    stop_text = reference[5].outputs[0].text
    params[5] = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, stop=[stop_text[len(stop_text) // 2 :]]
    )
    reference[5] = llm.generate(prompts[5], params[5], use_tqdm=False)[0]
    assert reference[5].outputs[0].finish_reason == "stop"

    async def main():
        tasks = [
            _collect(engine, prompt, p, f"c{i}")
            for i, (prompt, p) in enumerate(zip(prompts, params))
        ]
        results = await asyncio.gather(*tasks)
        await _assert_idle(engine)
        return results

    results = asyncio.run(main())
    for i, (outputs, expected) in enumerate(zip(results, reference)):
        final = outputs[-1]
        assert final.finished and final.request_id == f"c{i}"
        assert final.prompt_token_ids == expected.prompt_token_ids
        got = [(c.index, c.token_ids, c.text, c.finish_reason) for c in final.outputs]
        want = [(c.index, c.token_ids, c.text, c.finish_reason) for c in expected.outputs]
        assert got == want, f"request {i}"
        if params[i].logprobs:
            got_lp = [[sorted(d) for d in c.logprobs] for c in final.outputs]
            want_lp = [[sorted(d) for d in c.logprobs] for c in expected.outputs]
            assert got_lp == want_lp


def test_abort_paths_free_the_kv_cache(engine):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def first_output(request_id):
        generator = engine.generate(PROMPTS[1], long, request_id)
        first = await generator.__anext__()
        return generator, first

    async def main():
        # 1. abort(): the iterator ends without another output.
        explicit, first = await first_output("explicit")
        assert not first.finished
        await engine.abort("explicit")
        assert [out async for out in explicit] == []
        # 1b. several at once, as vLLM's abort takes them.
        (one, _), (two, _) = [await first_output(name) for name in ("one", "two")]
        await engine.abort(["one", "two", "unknown"])
        for stream in (one, two):  # outputs queued before the abort, then the end
            assert not any([out.finished async for out in stream])
        # 2. the consumer closes the iterator (a client disconnecting).
        closed, _ = await first_output("closed")
        await closed.aclose()
        # 3. the consumer's task is cancelled mid-stream.
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPTS[2], long, "cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _assert_idle(engine)
        # The engine keeps serving afterwards.
        final = (await _collect(engine, PROMPTS[0], SamplingParams(max_tokens=3), "after"))[-1]
        assert final.finished and len(final.outputs[0].token_ids) == 3

    asyncio.run(main())


def test_bad_requests_raise_value_error_at_first_anext(engine):
    async def main():
        generator = engine.generate(PROMPTS[0], SamplingParams(max_tokens=2000), "too-long")
        with pytest.raises(ValueError, match="max_model_len"):
            await generator.__anext__()
        # Fits the context but can never fit in the KV cache: rejected by the core.
        with pytest.raises(ValueError, match="never fit in the KV cache"):
            await _collect(engine, PROMPTS[0], SamplingParams(max_tokens=900), "huge")
        with pytest.raises(ValueError, match="token id"):
            await _collect(engine, {"prompt_token_ids": [10**6]}, SamplingParams(), "bad-id")
        for token_ids in (5, [1.5]):
            with pytest.raises(ValueError, match="prompt_token_ids must be a list of token"):
                await _collect(engine, {"prompt_token_ids": token_ids}, SamplingParams(), "ids")
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
            await _collect(engine, PROMPTS[0], None, "no-params")
        # Not a string: the core failed to decode the request and died.
        with pytest.raises(TypeError, match="request_id must be a string"):
            await _collect(engine, PROMPTS[0], SamplingParams(), 5)
        as_array = {"prompt_token_ids": np.array([1, 2])}
        outputs = await _collect(engine, as_array, SamplingParams(max_tokens=2), "array")
        assert outputs[-1].finished
        # A duplicate id while the first request is still running.
        running = engine.generate(PROMPTS[0], SamplingParams(max_tokens=50), "dup")
        await running.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, PROMPTS[0], SamplingParams(), "dup")
        await running.aclose()
        await _assert_idle(engine)
        assert not engine.errored

    asyncio.run(main())


def test_long_prompt_is_tokenized_off_the_event_loop(engine):
    """A prompt too long for the model is still tokenized first (to count it); that must
    not stall the event loop, which streams other requests and answers health checks."""
    prompt = "Hello world, this is a test of streaming text. " * 20000  # ~1M characters
    started = time.perf_counter()
    engine.get_tokenizer().encode(prompt)
    tokenize_s = time.perf_counter() - started

    async def main():
        gaps = []

        async def tick():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="leaves no room to generate"):
            await _collect(engine, prompt, SamplingParams(max_tokens=1), "too-long")
        await asyncio.sleep(0.05)  # the ticker records the pause it is in, if any
        ticker.cancel()
        return max(gaps)

    worst_gap = asyncio.run(main())
    print(f"tokenizing took {tokenize_s:.2f} s; the event loop's longest pause {worst_gap:.3f} s")
    assert worst_gap < max(0.1, tokenize_s / 3)


def test_the_log_lines_hit_rate_window_sees_every_step(engine):
    """The front end feeds each step's scheduler snapshot to the log line's hit-rate
    windows (``EngineMetrics.hit_rates``): after a reset, two requests with one prompt
    are the whole window, the second hitting the first's full blocks."""
    prompt = " ".join(["shared"] * 40)
    params = SamplingParams(temperature=0, max_tokens=2)

    async def main():
        assert await engine.reset_prefix_cache()
        await _collect(engine, prompt, params, "window-1")
        await _collect(engine, prompt, params, "window-2")

    asyncio.run(main())
    window = engine.metrics.hit_rates.engines[0].prefix_cache
    num_tokens = len(engine.get_tokenizer()(prompt).input_ids)
    cached = (num_tokens - 1) // 16 * 16
    assert cached > 0
    assert (window.requests, window.queries, window.hits) == (2, 2 * num_tokens, cached)
