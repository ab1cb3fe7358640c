"""Property-based fuzz of incremental detokenization and stop strings (hypothesis).

On real tokenizers built offline (``offline_tokenizers``: byte-level BPE, byte-fallback
BPE, Metaspace, each with added special and non-special tokens) and the embedded SmolLM2
tokenizer when it is cached, scripted token ids go through the detokenizers and the
``OutputProcessor``; the result must agree with a reference computed from whole decodes:

- streamed text adds up to ``decode(prompt suffix + output)`` minus the prompt suffix's
  text, and after every token it is the longest prefix of that decode that ends on a whole
  character (so no "\\ufffd" for a character split across tokens, while invalid bytes
  still show);
- a stop string ends the sample at the token whose text completes its first occurrence
  (after ``min_tokens`` tokens), the text ending just before or just after it; DELTA
  outputs add up to the final text, CUMULATIVE ones only grow; ``finish_reason`` and
  ``stop_reason``; each logprob's ``decoded_token`` is the token decoded alone;
- with ``n`` > 1 and ``stream_interval`` > 1 too.

The default run takes a few seconds; ``-m slow`` runs many more examples and the tiny chat
model end to end through ``LLM``. The server's streaming runs over a fake engine core.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from offline_tokenizers import BUILDERS

from pagedlm.core.outputs import EngineCoreOutput, LogprobsLists
from pagedlm.engine.detokenizer import (
    DetokenizerFactory,
    IncrementalDetokenizer,
    OffsetIncrementalDetokenizer,
)
from pagedlm.engine.output_processor import OutputProcessor
from pagedlm.outputs import CompletionOutput
from pagedlm.sampling_params import RequestOutputKind, SamplingParams

FAST_EXAMPLES = 40
SLOW_EXAMPLES = 1500
FUZZ_SETTINGS = dict(
    deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
SNIPPETS = [
    "Hello 日本 😀 <tool> Stop<|sp|> 日x",
    "Café déjà vu",
    "こんにちは世界。日本語のテキスト",
    " Stop. The end",
    "<|im_start|>user",
    "STOP. Stop here",
]
STOP_CANDIDATES = ["Stop", "St", "STOP.", "本", "😀", "\ufffd", "e", " ", "<tool>", "<|sp|>"]
TOKENIZER_NAMES = [*BUILDERS, "smollm2"]
HELD = "\ufffd"


def load_tokenizer(name: str):
    if name != "smollm2":
        return BUILDERS[name]()
    from pagedlm.model_executor.loader.default_model import DEFAULT_MODEL_FILE, cache_dir
    from pagedlm.tokenizer import get_tokenizer

    path = cache_dir() / DEFAULT_MODEL_FILE
    if not path.is_file():
        pytest.skip("the SmolLM2 GGUF is not cached (nothing is downloaded here)")
    return get_tokenizer(str(path))


@pytest.fixture(scope="module", params=TOKENIZER_NAMES)
def tokenizer(request):
    return load_tokenizer(request.param)


def random_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Slices of real text's tokens mixed with any id (added and special ones included)."""
    vocab_size = len(tokenizer)
    ids: list[int] = []
    while len(ids) < length:
        if rng.random() < 0.6:
            snippet = tokenizer.encode(rng.choice(SNIPPETS), add_special_tokens=False)
            start = rng.randrange(len(snippet))
            ids += snippet[start : start + rng.randrange(1, 10)]
        else:
            ids.append(rng.randrange(vocab_size))
    return ids[:length]


def decode(tokenizer, ids: list[int], skip: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip)


@dataclass
class Reference:
    """Released text after each detokenized token (None: not derivable), and in the end."""

    texts: list[str]
    final: str


def reference_texts(tokenizer, context: list[int], ids: list[int], skip: bool) -> Reference | None:
    """What a correct detokenizer releases for ``ids`` after ``context``, from whole
    decodes; None where the decoder is not monotonic there (byte fallback turns a whole
    run of byte tokens into "\\ufffd"s once it holds an invalid sequence)."""
    prefix = decode(tokenizer, context, skip)
    texts = [""]
    for k in range(1, len(ids) + 1):
        full = decode(tokenizer, context + ids[:k], skip)
        if not full.startswith(prefix):
            return None
        texts.append(full[len(prefix) :])
    final = texts[-1]
    released = [text.rstrip(HELD) for text in texts]
    for before, after in zip(released, [*released[1:], final], strict=True):
        if not after.startswith(before):
            return None
    return Reference(released, final)


# ---- the detokenizers ------------------------------------------------------------------


def make_detokenizer(
    tokenizer, kind: str, prompt: list[int], params: SamplingParams
) -> IncrementalDetokenizer:
    factory = DetokenizerFactory(tokenizer)
    if kind == "fast":
        detokenizer = factory.create(prompt, params)
        assert detokenizer is not None
        return detokenizer
    skip = params.skip_special_tokens
    context = factory._prime_ids(prompt, skip)
    return OffsetIncrementalDetokenizer(lambda ids: decode(tokenizer, ids, skip), context)


@pytest.mark.parametrize("kind", ["fast", "offset"])
def test_streamed_text_is_the_whole_characters_of_the_decode(tokenizer, kind):
    check_detokenizer(tokenizer, kind, FAST_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fast", "offset"])
def test_streamed_text_is_the_whole_characters_of_the_decode_slow(tokenizer, kind):
    check_detokenizer(tokenizer, kind, SLOW_EXAMPLES)


def check_detokenizer(tokenizer, kind: str, examples: int) -> None:
    @settings(max_examples=examples, **FUZZ_SETTINGS)
    @given(rng=st.randoms(use_true_random=False), skip=st.booleans(), spaces=st.booleans())
    def run(rng: random.Random, skip: bool, spaces: bool) -> None:
        prompt = random_ids(tokenizer, rng, rng.randrange(0, 8))
        ids = random_ids(tokenizer, rng, rng.randrange(1, 30))
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        detokenizer = make_detokenizer(tokenizer, kind, prompt, params)
        context = DetokenizerFactory(tokenizer)._prime_ids(prompt, skip)
        reference = reference_texts(tokenizer, context, ids, skip)
        released = ""
        for k, token_id in enumerate(ids, start=1):
            released += detokenizer.decode_next(token_id)
            if reference is not None:
                assert released == reference.texts[k], (prompt, ids[:k])
        released += detokenizer.flush()
        if reference is not None:
            assert released == reference.final, (prompt, ids)
            if HELD not in reference.final:
                assert HELD not in released

    run()


# ---- the output processor ---------------------------------------------------------------


@dataclass
class Sample:
    """One child's scripted engine-core run and what it must come out as."""

    ids: list[int]
    finish_reason: str
    stop_reason: int | None
    text: str = ""
    token_ids: list[int] | None = None
    expected_finish: tuple[str, int | str | None] | None = None


def expect(tokenizer, prompt: list[int], sample: Sample, params: SamplingParams) -> bool:
    """Fill in ``sample``'s expected text, token ids and finish; False if not derivable."""
    skip = params.skip_special_tokens
    context = DetokenizerFactory(tokenizer)._prime_ids(prompt, skip)
    keeps_last_text = sample.finish_reason != "stop" or params.include_stop_str_in_output
    detokenized = sample.ids if keeps_last_text else sample.ids[:-1]
    reference = reference_texts(tokenizer, context, detokenized, skip)
    if reference is None:
        return False
    # Text released after each count of tokens; the final flush counts as the last token.
    steps = list(enumerate(reference.texts))
    steps.append((len(sample.ids), reference.final))
    for (_, before), (count, text) in itertools.pairwise(steps):
        if count <= params.min_tokens or not params.stop:
            continue
        best = None
        for stop in params.stop:
            start = text.find(stop, max(len(before) - len(stop) + 1, 0))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            end, start, stop = best
            sample.text = text[: end if params.include_stop_str_in_output else start]
            sample.token_ids = sample.ids[:count]
            sample.expected_finish = ("stop", stop)
            return True
    sample.text = reference.final
    sample.token_ids = sample.ids
    sample.expected_finish = (sample.finish_reason, sample.stop_reason)
    return True


def scripted_outputs(
    samples: list[Sample], rng: random.Random, num_logprobs: int | None, vocab_size: int
):
    """Steps of engine-core outputs: each child gets 0-3 tokens a step (several: accepted
    drafts), the last step of each carrying its finish."""
    positions = [0] * len(samples)
    while any(p < len(s.ids) for p, s in zip(positions, samples, strict=True)):
        step = []
        for index, sample in enumerate(samples):
            if positions[index] >= len(sample.ids) or rng.random() < 0.3:
                continue
            new = sample.ids[positions[index] : positions[index] + rng.choice([1, 1, 1, 2, 3])]
            positions[index] += len(new)
            last = positions[index] >= len(sample.ids)
            logprobs = None
            if num_logprobs is not None:
                logprobs = LogprobsLists(
                    [[t, (t + 1) % vocab_size] for t in new],
                    [[-1.0, -2.0] for _ in new],
                    [1] * len(new),
                )
            step.append(
                EngineCoreOutput(
                    f"{index}_r",
                    new,
                    sample.finish_reason if last else None,
                    sample.stop_reason if last else None,
                    logprobs,
                )
            )
        yield step


def run_kind(tokenizer, prompt, samples, params, kind, stream_interval, seed):
    processor = OutputProcessor(tokenizer, stream_interval=stream_interval)
    params = SamplingParams(**{**params, "output_kind": kind})
    children = [f"{index}_r" for index in range(len(samples))]
    processor.add_request("r", None, prompt, params, children, 0.0)
    outputs = []
    steps = scripted_outputs(samples, random.Random(seed), params.logprobs, len(tokenizer))
    for step in steps:
        outputs += processor.process_outputs(step).request_outputs
    assert not processor.has_unfinished_requests()
    return outputs


def of_child(outputs, index: int) -> list[CompletionOutput]:
    return [c for out in outputs for c in out.outputs if c.index == index]


def check_output_processor(tokenizer, examples: int) -> None:
    vocab_size = len(tokenizer)

    @settings(max_examples=examples, **FUZZ_SETTINGS)
    @given(
        rng=st.randoms(use_true_random=False),
        n=st.sampled_from([1, 1, 2]),
        include=st.booleans(),
        min_tokens=st.sampled_from([0, 0, 1, 3, 6]),
        skip=st.booleans(),
        spaces=st.booleans(),
        num_logprobs=st.sampled_from([None, 0, 2]),
        stream_interval=st.sampled_from([1, 1, 2, 3]),
    )
    def run(rng, n, include, min_tokens, skip, spaces, num_logprobs, stream_interval):
        prompt = random_ids(tokenizer, rng, rng.randrange(0, 8))
        samples = []
        for _ in range(n):
            ids = random_ids(tokenizer, rng, rng.randrange(1, 25))
            finish = rng.choice(["length", "eos", "stop_token"])
            if finish == "length":
                samples.append(Sample(ids, "length", None))
            elif finish == "eos":
                samples.append(Sample([*ids, tokenizer.eos_token_id], "stop", None))
            else:
                stop_token = rng.randrange(vocab_size)
                samples.append(Sample([*ids, stop_token], "stop", stop_token))
        # Stop strings: pieces of the first sample's text (across token boundaries and
        # inside characters), some of them prefixes of each other, and decoys.
        text = decode(tokenizer, samples[0].ids, True)
        stop = []
        for _ in range(rng.randrange(0, 4)):
            if text and rng.random() < 0.7:
                start = rng.randrange(len(text))
                stop.append(text[start : start + rng.randrange(1, 6)])
            else:
                stop.append(rng.choice(STOP_CANDIDATES))
        params = dict(
            n=n,
            stop=stop,
            include_stop_str_in_output=include,
            min_tokens=min_tokens,
            skip_special_tokens=skip,
            spaces_between_special_tokens=spaces,
            logprobs=num_logprobs,
        )
        checked = SamplingParams(**params)
        if not all(expect(tokenizer, prompt, sample, checked) for sample in samples):
            return
        seed = rng.randrange(2**32)
        results = {
            kind: run_kind(tokenizer, prompt, samples, params, kind, stream_interval, seed)
            for kind in RequestOutputKind
        }
        [final] = results[RequestOutputKind.FINAL_ONLY]
        assert final.finished and len(final.outputs) == n
        for index, sample in enumerate(samples):
            [completion] = of_child([final], index)
            got = (completion.text, completion.token_ids)
            assert got == (sample.text, sample.token_ids), (prompt, sample, stop)
            assert (completion.finish_reason, completion.stop_reason) == sample.expected_finish
            if num_logprobs is not None:
                assert completion.logprobs is not None
                assert len(completion.logprobs) == len(completion.token_ids)
                for token_id, row in zip(completion.token_ids, completion.logprobs, strict=True):
                    assert row[token_id].decoded_token == decode(tokenizer, [token_id], False)
            deltas = of_child(results[RequestOutputKind.DELTA], index)
            assert "".join(d.text for d in deltas) == sample.text
            assert [t for d in deltas for t in d.token_ids] == sample.token_ids
            assert [d.finish_reason is not None for d in deltas][-1]
            assert not any(d.finish_reason is not None for d in deltas[:-1])
            cumulative = [c.text for c in of_child(results[RequestOutputKind.CUMULATIVE], index)]
            assert all(b.startswith(a) for a, b in itertools.pairwise(cumulative))
            assert cumulative[-1] == sample.text

    run()


def test_output_processor_matches_the_reference(tokenizer):
    check_output_processor(tokenizer, FAST_EXAMPLES)


@pytest.mark.slow
def test_output_processor_matches_the_reference_slow(tokenizer):
    check_output_processor(tokenizer, SLOW_EXAMPLES)


# ---- end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_llm(chat_checkpoint):
    from pagedlm import LLM

    return LLM(str(chat_checkpoint), max_model_len=256, num_kv_blocks=64, dtype="float32")


@pytest.mark.slow  # about 30 s of CPU generation
def test_llm_stops_at_stop_strings_cut_from_its_own_text(chat_llm):
    # The tiny model writes random bytes (one token each, so characters span tokens);
    # stop strings are cut from what it wrote, and the rerun must end exactly there.
    tokenizer = chat_llm.get_tokenizer()
    prompts = ["Hello there", "日本語", "abc"]
    free = chat_llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0))
    rng = random.Random(0)
    checked = 0
    for prompt, output in zip(prompts, free, strict=True):
        text, ids = output.outputs[0].text, output.outputs[0].token_ids
        assert text == decode(tokenizer, ids, True)
        starts = [i for i in range(1, len(text) - 3) if "\ufffd" not in text[i : i + 3]]
        if not starts:
            continue
        checked += 1
        start = rng.choice(starts)
        stop = [text[start : start + 3], text[start : start + 2]]  # prefixes of each other
        for include in (False, True):
            params = SamplingParams(
                max_tokens=40, temperature=0.0, n=2, stop=stop, include_stop_str_in_output=include
            )
            [rerun] = chat_llm.generate([prompt], params)
            first = text.find(stop[1])
            for sample in rerun.outputs:
                assert (sample.finish_reason, sample.stop_reason) == ("stop", stop[1])
                assert sample.text == text[: first + (2 if include else 0)]
                num = len(sample.token_ids)
                assert sample.token_ids == ids[:num]
                assert stop[1] in decode(tokenizer, ids[:num], True)
                assert stop[1] not in decode(tokenizer, ids[: num - 1], True)
    assert checked


def test_server_stream_adds_up_with_n_stop_and_usage(chat_checkpoint):
    # The server's SSE chunks, per choice, add up to the non-streamed text (same fake
    # engine, same random tokens), finish with the same reasons, and the usage chunk
    # comes last with the same counts.
    import json

    from starlette.testclient import TestClient

    from pagedlm.entrypoints.openai.app import build_app
    from server.fake_engine import FakeEngine, fake_context

    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "n": 3, "stop": ["a", "ab", "é"]}

    def post(payload):
        with TestClient(build_app(fake_context(FakeEngine(chat_checkpoint, num_tokens=12)))) as c:
            return c.post("/v1/completions", json=payload)

    whole = post(body).json()
    stream = post({**body, "stream": True, "stream_options": {"include_usage": True}}).text
    events = [line[len("data: ") :] for line in stream.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert "\ufffd" not in "".join(c["text"] for c in mine[:-1]) or "\ufffd" in choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        assert mine[-1]["stop_reason"] == choice["stop_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
