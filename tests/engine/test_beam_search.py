"""``LLM.beam_search`` (vLLM's): against a beam search over transformers' float32 logits on
a tiny random model, width 1 as greedy decoding, and the search itself over a scripted
step (end-of-sequence beams, the length penalty, ``max_model_len``)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
import transformers

from pagedlm import LLM, BeamSearchParams, SamplingParams
from pagedlm.beam_search import BeamSearchSequence, beam_score, engine_step, search
from pagedlm.outputs import CompletionOutput, Logprob, RequestOutput

PROMPTS = [[5, 17, 33, 8, 2], [9, 10, 11]]


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", num_kv_blocks=128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield llm, hf
    llm.llm_engine.shutdown()


def _reference(hf, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """The same search, every step's candidates from transformers' log-softmax."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        grown = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1].double()
            top = logits.log_softmax(-1).topk(2 * width)
            grown += [(tokens + [int(t)], cum + float(lp)) for lp, t in zip(*top, strict=True)]
        beams = sorted(grown, key=lambda b: b[1] / len(b[0]), reverse=True)[:width]
    return beams


def test_beams_match_a_search_over_transformers_logits(setup):
    llm, hf = setup
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        want = _reference(hf, prompt, 3, 5)
        got = [(s.tokens, s.cum_logprob) for s in output.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        for (_, cum), (_, want_cum) in zip(got, want, strict=True):
            assert abs(cum - want_cum) < 1e-3
        assert all(len(s.logprobs) == 5 and s.finish_reason == "length" for s in output.sequences)
        assert output.sequences[0].text is None  # no tokenizer


def test_width_one_is_greedy_decoding(setup):
    llm, _ = setup
    (beam,) = llm.beam_search(
        {"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(1, 6, ignore_eos=True)
    )[0].sequences
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    (greedy,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    completion = greedy.outputs[0]
    assert beam.tokens == PROMPTS[0] + completion.token_ids
    total = sum(lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs))
    assert abs(beam.cum_logprob - total) < 1e-4


def test_beams_carry_their_prompts_cache_salt(setup):
    # Every beam is a request of its own: one without the prompt's salt shared prefix-cache
    # blocks with unsalted requests, which a salt exists to prevent.
    llm, _ = setup
    scheduler = llm.llm_engine.engine_core.scheduler
    seen: list[tuple[list[int], str | None]] = []
    add_request = scheduler.add_request

    def recording(request):
        seen.append((request.prompt_token_ids, request.cache_salt))
        add_request(request)

    scheduler.add_request = recording
    try:
        params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
        unsalted = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        prompts = [
            {"prompt_token_ids": PROMPTS[0], "cache_salt": "alice"},
            {"prompt_token_ids": PROMPTS[1]},
            {"prompt_token_ids": PROMPTS[0], "cache_salt": "bob"},
        ]
        seen.clear()
        outputs = llm.beam_search(prompts, params)
    finally:
        del scheduler.add_request
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.beam_search({"prompt_token_ids": PROMPTS[0], "cache_salt": ["x"]}, params)
    salts_of = {0: {"alice", "bob"}, 1: {None}}
    for tokens, salt in seen:
        index = 0 if tokens[: len(PROMPTS[0])] == PROMPTS[0] else 1
        assert salt in salts_of[index]
    assert {salt for _, salt in seen} == {"alice", "bob", None}
    # The salt changes what is shared, never the beams; results stay in prompt order.
    expected = [unsalted[0], unsalted[1], unsalted[0]]
    for got, want in zip(outputs, expected, strict=True):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]


def test_async_beam_steps_carry_the_cache_salt():
    prompts = []

    async def generate(prompt, sampling, request_id, priority, lora_request):
        prompts.append(prompt)
        logprobs = [{7: Logprob(-0.5, 1), 8: Logprob(-1.0, 2)}]
        completion = CompletionOutput(0, "", [7], -0.5, logprobs, "length")
        yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None, [completion], True)

    step = engine_step(generate, "r", None, "alice")
    asyncio.run(step([[1, 2], [1, 3]], SamplingParams(max_tokens=1, logprobs=2), 0))
    assert [p.get("cache_salt") for p in prompts] == ["alice", "alice"]


def test_async_beam_search_refuses_images_and_embeddings():
    # Each beam runs as a token prompt: an image prompt's beams were generated from its
    # placeholder ids as text (the image dropped), and shared blocks across images.
    from pagedlm.engine.async_llm import AsyncLLM

    engine = SimpleNamespace(
        _check_alive=lambda: None,
        input_processor=SimpleNamespace(tokenize=lambda prompt: ("<image>", [3, 3, 3])),
    )
    prompts = [
        {"prompt": "<image>", "multi_modal_data": {"image": [object()]}},
        {"prompt_embeds": object()},
    ]
    for prompt in prompts:
        search = AsyncLLM.beam_search(engine, prompt, "r", BeamSearchParams(2, 2))
        with pytest.raises(ValueError, match="use_beam_search takes text or token prompts"):
            asyncio.run(anext(search))


def test_bad_parameters_name_the_fix(setup):
    llm, _ = setup
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="beam_width must be a positive integer"):
            BeamSearchParams(beam_width=bad, max_tokens=4)
    with pytest.raises(ValueError, match="max_logprobs=20; use at most 10"):
        llm.beam_search({"prompt_token_ids": [1, 2]}, BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    for bad in (math.nan, math.inf, "1"):
        with pytest.raises(ValueError, match="length_penalty must be a"):
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=bad)
    with pytest.raises(TypeError, match="beam_search takes a BeamSearchParams"):
        llm.beam_search({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=4))


def _scripted(table: dict[int, dict[int, float]]):
    """A step whose candidates depend on the beam's last token only."""

    def step(beams, sampling):
        assert sampling.max_tokens == 1 and sampling.logprobs in (2, 4)
        return [
            {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(table[b[-1]].items(), 1)}
            for b in beams
        ]

    return step


def test_an_end_of_sequence_candidate_finishes_its_beam_and_lengths_are_penalized():
    eos = 0
    table = {
        1: {eos: math.log(0.5), 2: math.log(0.3), 3: math.log(0.2)},
        2: {4: math.log(0.9), eos: math.log(0.1)},
        3: {4: math.log(0.6), 2: math.log(0.4)},
        4: {4: math.log(0.99), eos: math.log(0.01)},
        eos: {4: math.log(0.5), 2: math.log(0.5)},  # read only with ignore_eos
    }
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    (output,) = search([[1]], params, _scripted(table), {eos}, 100, None)
    # Scores divide by the length: [1, 2, 4, 4] (log 0.3 * 0.9 * 0.99 over 4 tokens, -0.33)
    # beats [1, eos] (log 0.5 over 1 token: the eos does not count, -0.69).
    assert [s.tokens for s in output.sequences] == [[1, 2, 4, 4], [1, 3, 4, 4]]
    assert output.sequences[0].cum_logprob == pytest.approx(math.log(0.3 * 0.9 * 0.99))
    assert all(s.finish_reason == "length" for s in output.sequences)
    # A length penalty of 0 scores by the cumulative logprob alone: the early stop wins.
    flat = BeamSearchParams(2, 3, length_penalty=0.0)
    (output,) = search([[1]], flat, _scripted(table), {eos}, 100, None)
    assert [s.tokens for s in output.sequences] == [[1, eos], [1, 2, 4, 4]]
    assert [s.finish_reason for s in output.sequences] == ["stop", "length"]
    # ignore_eos: eos is an ordinary token, so nothing stops early.
    kept = BeamSearchParams(2, 3, length_penalty=0.0, ignore_eos=True)
    (output,) = search([[1]], kept, _scripted(table), {eos}, 100, None)
    assert all(s.finish_reason == "length" and len(s.tokens) == 4 for s in output.sequences)


def test_max_model_len_ends_beams():
    table = {1: {1: -0.1, 2: -0.2}, 2: {1: -0.1, 2: -0.2}}
    (output,) = search([[1, 2]], BeamSearchParams(1, 10), _scripted(table), set(), 4, None)
    (beam,) = output.sequences
    assert len(beam.tokens) == 4 and beam.finish_reason == "length"


def test_extreme_length_penalties_score_by_their_limits():
    # length ** length_penalty past a float's range raised OverflowError (a 500 over HTTP).
    beam = BeamSearchSequence([1, 2, 3], cum_logprob=-2.0)
    assert beam_score(beam, set(), 1e308) == 0.0
    assert beam_score(beam, set(), -1e308) == -math.inf
    assert beam_score(BeamSearchSequence([1], cum_logprob=-2.0), set(), 1e308) == -2.0
    table = {1: {1: -0.1, 2: -0.2}, 2: {1: -0.1, 2: -0.2}}
    for penalty in (1e308, -1e308):
        params = BeamSearchParams(2, 3, length_penalty=penalty)
        (output,) = search([[1, 2]], params, _scripted(table), set(), 100, None)
        assert [len(s.tokens) for s in output.sequences] == [5, 5]


def test_beam_score_drops_a_final_end_of_sequence_token():
    beam = BeamSearchSequence([1, 2, 0], cum_logprob=-2.0)
    assert beam_score(beam, {0}, 1.0) == -1.0
    assert beam_score(beam, set(), 1.0) == pytest.approx(-2 / 3)
