"""OutputProcessor: text, stop strings, streaming kinds, n>1 and aborts, on a real tokenizer."""

from __future__ import annotations

import random

import pytest

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.engine.output_processor import OutputProcessor
from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import RequestOutputKind, SamplingParams

DELTA = RequestOutputKind.DELTA
CUMULATIVE = RequestOutputKind.CUMULATIVE
FINAL_ONLY = RequestOutputKind.FINAL_ONLY
EOS = 0  # "<|endoftext|>" in the test tokenizer


def add(processor, params, request_id="r", children=None, prompt="Hi", prompt_ids=(5, 6)):
    processor.add_request(
        request_id, prompt, list(prompt_ids), params, children or [request_id], arrival_time=0.0
    )


def feed(processor, req_id, token_ids, finish_reason=None, stop_reason=None, **kwargs):
    output = EngineCoreOutput(req_id, list(token_ids), finish_reason, stop_reason, **kwargs)
    return processor.process_outputs([output])


def run_steps(processor, req_id, steps, finish_reason="length", stop_reason=None):
    """Feed ``steps`` (lists of ids), the last one finishing; returns each step's result."""
    results = []
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        results.append(
            feed(
                processor,
                req_id,
                step,
                finish_reason if last else None,
                stop_reason if last else None,
            )
        )
    return results


def texts(results) -> list[str]:
    return [out.outputs[0].text for result in results for out in result.request_outputs]


def test_text_equals_full_decode_and_eos_text_is_left_out(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(skip_special_tokens=False, output_kind=FINAL_ONLY))
    ids = bpe_tokenizer.encode("Café 日本 😀 done")
    results = run_steps(processor, "r", [[t] for t in ids] + [[EOS]], "stop")
    [final] = [out for result in results for out in result.request_outputs]
    completion = final.outputs[0]
    assert final.finished and final.prompt == "Hi" and final.prompt_token_ids == [5, 6]
    assert completion.token_ids == [*ids, EOS]
    assert completion.text == "Café 日本 😀 done"  # no "<|endoftext|>"
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    assert not processor.has_unfinished_requests()


def test_stop_token_text_is_kept_with_include_stop_str_in_output(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    add(processor, params)
    [result] = run_steps(processor, "r", [[*bpe_tokenizer.encode("ok"), 2]], "stop", 2)
    completion = result.request_outputs[0].outputs[0]
    assert completion.text == "ok<|im_end|>"
    assert completion.stop_reason == 2


def test_stop_string_across_tokens_finishes_and_aborts_the_child(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(stop=["o w"]), children=["c0"])
    hel, lo, w, orld = (bpe_tokenizer.encode(p) for p in ["Hel", "lo", " w", "orld"])
    assert bpe_tokenizer.decode(hel + lo + w + orld) == "Hello world"
    first = feed(processor, "c0", hel + lo)
    assert first.reqs_to_abort == []
    assert first.request_outputs[0].outputs[0].text == "Hell"  # "o" could start "o w"
    second = feed(processor, "c0", w + orld)  # " w" completes the stop; "orld" is dropped
    assert second.reqs_to_abort == ["c0"]
    completion = second.request_outputs[0].outputs[0]
    assert completion.text == "Hell"
    assert completion.token_ids == hel + lo + w
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "o w")
    assert second.request_outputs[0].finished
    # The core may still report a step it ran before the abort: ignored.
    assert feed(processor, "c0", [7]) == ([], [])


def test_include_stop_str_in_output_keeps_the_stop_string(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(stop=["o w"], include_stop_str_in_output=True))
    [result] = run_steps(processor, "r", [bpe_tokenizer.encode("Hello world")], None)
    completion = result.request_outputs[0].outputs[0]
    assert completion.text == "Hello w"
    assert result.reqs_to_abort == ["r"]


def test_stop_string_found_in_the_finishing_step_needs_no_abort(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(stop=["end"]))
    [result] = run_steps(processor, "r", [bpe_tokenizer.encode("The end")], "length")
    completion = result.request_outputs[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (
        "The ",
        "stop",
        "end",
    )
    assert result.reqs_to_abort == []


def test_stop_strings_inside_the_first_min_tokens_are_ignored(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    ids = bpe_tokenizer.encode("ab ab ab")
    add(processor, SamplingParams(stop=["ab"], min_tokens=len(ids) - 1))
    results = run_steps(processor, "r", [[t] for t in ids], None)
    completion = results[-1].request_outputs[0].outputs[0]
    # The first two "ab" end inside the first min_tokens tokens; the third one counts.
    assert (completion.text, completion.stop_reason) == ("ab ab ", "ab")


@pytest.mark.parametrize("seed", range(8))
def test_delta_never_leaks_a_stop_string_and_adds_up_to_cumulative(bpe_tokenizer, seed):
    rng = random.Random(seed)
    source = "Hello world, Café déjà vu. 日本語のテキスト! Emoji: 😀🎉 — STOP here. The end."
    ids = bpe_tokenizer.encode(source)
    start = rng.randrange(4, len(source) - 6)
    stop_hit = source[start : start + rng.randrange(2, 6)]
    # Decoys that share a prefix with the text but never complete.
    stop = [stop_hit, stop_hit[:-1] + "\x00", "Hello world, Café X"]
    processors = {kind: OutputProcessor(bpe_tokenizer) for kind in (DELTA, CUMULATIVE)}
    for kind, processor in processors.items():
        add(processor, SamplingParams(stop=stop, output_kind=kind))
    streamed, position, aborts = "", 0, []
    while position < len(ids):
        size = rng.randrange(1, 4)
        step = ids[position : position + size]
        position += size
        finish = "length" if position >= len(ids) else None
        delta = feed(processors[DELTA], "r", step, finish)
        cumulative = feed(processors[CUMULATIVE], "r", step, finish)
        assert delta.reqs_to_abort == cumulative.reqs_to_abort
        aborts += delta.reqs_to_abort
        if not delta.request_outputs:
            break  # finished by the stop string in an earlier step
        streamed += delta.request_outputs[0].outputs[0].text
        cumulative_text = cumulative.request_outputs[0].outputs[0].text
        assert streamed == cumulative_text
        assert not any(s in streamed for s in stop)
        if delta.request_outputs[0].finished:
            break
    completion = cumulative.request_outputs[0].outputs[0]
    assert completion.text == source[: source.index(stop_hit)]
    assert completion.stop_reason == stop_hit
    assert completion.token_ids == ids[: len(completion.token_ids)]
    assert stop_hit in bpe_tokenizer.decode(completion.token_ids)
    assert aborts in (["r"], [])  # none if the match came in the core's final step


def test_delta_releases_held_back_text_when_it_stops_matching(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(stop=["STOP!"], output_kind=DELTA))
    steps = [bpe_tokenizer.encode("Go ST"), bpe_tokenizer.encode("OP"), bpe_tokenizer.encode(".")]
    results = run_steps(processor, "r", steps)
    assert texts(results) == ["Go ", "", "STOP."]
    token_deltas = [r.request_outputs[0].outputs[0].token_ids for r in results]
    assert token_deltas == steps


def test_n_greater_than_one_aggregates_children_per_kind(bpe_tokenizer):
    a, b = bpe_tokenizer.encode("yes"), bpe_tokenizer.encode("no")
    for kind in (DELTA, CUMULATIVE, FINAL_ONLY):
        processor = OutputProcessor(bpe_tokenizer)
        add(processor, SamplingParams(n=2, output_kind=kind), children=["0_r", "1_r"])
        step1 = processor.process_outputs([EngineCoreOutput("0_r", a)])
        step2 = processor.process_outputs(
            [EngineCoreOutput("1_r", b, "length"), EngineCoreOutput("0_r", [EOS], "stop")]
        )
        if kind is FINAL_ONLY:
            assert step1.request_outputs == []
        else:
            [out] = step1.request_outputs
            assert not out.finished
            expected = [(0, "yes")] if kind is DELTA else [(0, "yes"), (1, "")]
            assert [(c.index, c.text) for c in out.outputs] == expected
        [out] = step2.request_outputs
        assert out.finished and out.request_id == "r"
        by_index = {c.index: c for c in out.outputs}
        assert sorted(by_index) == [0, 1]
        assert by_index[1].text == "no" and by_index[1].finish_reason == "length"
        assert by_index[0].finish_reason == "stop"
        assert by_index[0].text == ("" if kind is DELTA else "yes")
        assert by_index[0].token_ids == ([EOS] if kind is DELTA else [*a, EOS])
        assert not processor.has_unfinished_requests()


def test_parent_finishes_only_when_every_child_has(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(n=2, output_kind=DELTA), children=["0_r", "1_r"])
    first = feed(processor, "0_r", [7], "length").request_outputs[0]
    assert not first.finished and [c.index for c in first.outputs] == [0]
    assert processor.get_num_unfinished_requests() == 1
    last = feed(processor, "1_r", [8], "length").request_outputs[0]
    assert last.finished and [c.index for c in last.outputs] == [1]
    assert processor.get_num_unfinished_requests() == 0


def test_abort_maps_parents_to_their_unfinished_children(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(n=3), request_id="p", children=["0_p", "1_p", "2_p"])
    add(processor, SamplingParams(), request_id="q")
    feed(processor, "1_p", [7], "length")
    assert processor.abort_requests(["p", "unknown"]) == ["0_p", "2_p"]
    assert processor.get_num_unfinished_requests() == 1
    assert feed(processor, "0_p", [7]) == ([], [])
    assert processor.abort_requests(["p"]) == []


def test_request_ids_must_be_unique(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(), request_id="r")
    with pytest.raises(ValueError, match="already in use"):
        add(processor, SamplingParams(), request_id="r")
    with pytest.raises(ValueError, match="already in use"):
        add(processor, SamplingParams(), request_id="s", children=["r"])


def test_without_tokenizer_there_is_no_text(bpe_tokenizer):
    processor = OutputProcessor(None)
    add(processor, SamplingParams(output_kind=FINAL_ONLY))
    [result] = run_steps(processor, "r", [[11, 12]])
    completion = result.request_outputs[0].outputs[0]
    assert (completion.text, completion.token_ids) == ("", [11, 12])
    with pytest.raises(ValueError, match="stop_token_ids"):
        add(processor, SamplingParams(stop=["x"]), request_id="s")


def test_detokenize_false_gives_empty_text(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(detokenize=False))
    [result] = run_steps(processor, "r", [bpe_tokenizer.encode("hello")])
    assert result.request_outputs[0].outputs[0].text == ""


def test_cached_tokens_and_metrics_are_reported(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams())
    first = feed(processor, "r", [7], num_cached_tokens=16).request_outputs[0]
    last = feed(processor, "r", [8], "length").request_outputs[0]
    assert isinstance(last, RequestOutput)
    assert first.num_cached_tokens == last.num_cached_tokens == 16
    assert set(first.metrics) == {
        "arrival_time",
        "first_token_time",
        "time_to_first_token",
        "last_token_time",
    }
    assert last.metrics["finished_time"] >= last.metrics["first_token_time"]
    assert last.metrics["num_generation_tokens"] == 2.0


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL_ONLY])
def test_n_samples_report_the_most_cached_tokens_of_any_child(bpe_tokenizer, kind):
    """The samples share the prompt's blocks: the first child computes them and the later
    ones find them cached. The parent reported its first child's count (0) whatever the
    others were served; it reports the largest, as vLLM's final output does when the
    children finish together (it carries the last child's count)."""
    processor = OutputProcessor(bpe_tokenizer)
    add(processor, SamplingParams(n=3, output_kind=kind), children=["0_r", "1_r", "2_r"])
    step = processor.process_outputs(
        [
            EngineCoreOutput("0_r", [7], num_cached_tokens=0),
            EngineCoreOutput("1_r", [8], num_cached_tokens=32),
            EngineCoreOutput("2_r", [9], num_cached_tokens=16),
        ]
    )
    last = processor.process_outputs([EngineCoreOutput(f"{i}_r", [EOS], "stop") for i in range(3)])
    outputs = step.request_outputs + last.request_outputs
    assert outputs and all(out.num_cached_tokens == 32 for out in outputs)


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_stream_interval_speaks_on_the_first_tokens_then_every_n(bpe_tokenizer, kind):
    ids = bpe_tokenizer.encode("one two three four five six seven")
    processor = OutputProcessor(bpe_tokenizer, stream_interval=3)
    add(processor, SamplingParams(output_kind=kind, max_tokens=99))
    results = run_steps(processor, "r", [[t] for t in ids])
    spoke = [i for i, result in enumerate(results) if result.request_outputs]
    # the first token, then after 3 more each time, and the finishing step whatever it holds
    assert len(ids) > 7 and spoke == sorted({*range(0, len(ids) - 1, 3), len(ids) - 1})
    outputs = [out.outputs[0] for result in results for out in result.request_outputs]
    if kind is DELTA:
        assert [t for out in outputs for t in out.token_ids] == ids
        assert "".join(out.text for out in outputs) == bpe_tokenizer.decode(ids)
        assert [len(out.token_ids) for out in outputs[:3]] == [1, 3, 3]
    else:
        assert outputs[-1].token_ids == ids and outputs[1].token_ids == ids[:4]


def test_stream_interval_keeps_every_held_child_of_n(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer, stream_interval=4)
    add(processor, SamplingParams(n=2, output_kind=DELTA), children=["a", "b"])
    a, b = bpe_tokenizer.encode("alpha beta gamma"), bpe_tokenizer.encode("one two three")
    assert feed(processor, "a", a[:1]).request_outputs  # the first tokens speak
    assert not feed(processor, "b", b[:1]).request_outputs  # 1 held
    assert not feed(processor, "a", a[1:2]).request_outputs  # 2 held
    [out] = feed(processor, "b", b[1:3]).request_outputs  # 4: both children, all they held
    assert {(c.index, tuple(c.token_ids)) for c in out.outputs} == {
        (0, tuple(a[1:2])), (1, tuple(b[:3])),
    }  # fmt: skip
    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(bpe_tokenizer, stream_interval=0)


def test_stop_string_completed_by_a_token_that_begins_a_character_stops_there():
    # "déj" + the first byte of "à" is one token: it completes the stop string "déj", so
    # the sample ends with it (and the core is told to abort) rather than a token later.
    from offline_tokenizers import byte_level_bpe

    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("déjà vu")
    assert tokenizer.decode(ids[:2]) == "déj\ufffd"
    processor = OutputProcessor(tokenizer)
    add(processor, SamplingParams(stop=["déj"], output_kind=DELTA))
    results = [feed(processor, "r", [token_id]) for token_id in ids]
    assert results[1].reqs_to_abort == ["r"]
    completion = results[1].request_outputs[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "déj")
    assert texts(results) == ["", ""]
    token_ids = [t for r in results for out in r.request_outputs for t in out.outputs[0].token_ids]
    assert token_ids == ids[:2]
