"""Logprob rows -> dicts, cumulative logprob, and prompt logprobs gathered across chunks."""

from __future__ import annotations

import math

import pytest

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.engine.logprobs_processor import TokenTextCache, logprobs_row_to_dict
from pagedlm.engine.output_processor import OutputProcessor
from pagedlm.outputs import Logprob
from pagedlm.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.step import LogprobsLists


def rows(*entries: tuple[list[int], list[float], int]) -> LogprobsLists:
    return LogprobsLists(
        token_ids=[e[0] for e in entries],
        logprobs=[e[1] for e in entries],
        ranks=[e[2] for e in entries],
    )


def test_row_holds_the_chosen_token_with_its_rank_and_the_top_k(bpe_tokenizer):
    texts = TokenTextCache(bpe_tokenizer)
    hello = bpe_tokenizer.encode("Hello")[0]
    row = logprobs_row_to_dict([hello, 0, 7], [-3.0, -0.1, -0.5], 4, texts)
    assert row == {
        hello: Logprob(-3.0, 4, bpe_tokenizer.decode([hello])),
        0: Logprob(-0.1, 1, "<|endoftext|>"),
        7: Logprob(-0.5, 2, bpe_tokenizer.decode([7])),
    }
    # The sampled token among the top-k appears once.
    assert logprobs_row_to_dict([7, 7, 0], [-0.2, -0.2, -1.0], 1, None) == {
        7: Logprob(-0.2, 1, None),
        0: Logprob(-1.0, 2, None),
    }


def test_token_texts_are_decoded_in_one_batch_and_cached(bpe_tokenizer):
    texts = TokenTextCache(bpe_tokenizer)
    texts.prefetch([5, 6, 5])
    assert texts._texts == {5: bpe_tokenizer.decode([5]), 6: bpe_tokenizer.decode([6])}
    assert texts.get(10**6) == ""  # outside the vocabulary


def test_sample_logprobs_and_cumulative_logprob(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    params = SamplingParams(logprobs=1, output_kind=RequestOutputKind.DELTA)
    processor.add_request("r", None, [1, 2, 3], params, ["r"], 0.0)
    first = rows(([5, 5], [-0.5, -0.5], 1), ([6, 9], [-1.5, -0.2], 2))
    out1 = processor.process_outputs([EngineCoreOutput("r", [5, 6], new_logprobs=first)])
    second = rows(([7, 8], [-2.0, -0.1], 3))
    out2 = processor.process_outputs([EngineCoreOutput("r", [7], "length", new_logprobs=second)])
    c1 = out1.request_outputs[0].outputs[0]
    c2 = out2.request_outputs[0].outputs[0]
    assert [sorted(d) for d in c1.logprobs] == [[5], [6, 9]]
    assert c1.logprobs[1][6] == Logprob(-1.5, 2, bpe_tokenizer.decode([6]))
    assert c1.logprobs[1][9].rank == 1
    assert math.isclose(c1.cumulative_logprob, -2.0)
    assert [sorted(d) for d in c2.logprobs] == [[7, 8]]  # DELTA: only the new position
    assert math.isclose(c2.cumulative_logprob, -4.0)


def test_logprob_rows_after_a_stop_string_are_dropped(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    ids = bpe_tokenizer.encode("ab. cd")
    params = SamplingParams(logprobs=0, stop=["."])
    processor.add_request("r", None, [1], params, ["r"], 0.0)
    lists = rows(*[([t], [-1.0], 1) for t in ids])
    result = processor.process_outputs([EngineCoreOutput("r", ids, new_logprobs=lists)])
    completion = result.request_outputs[0].outputs[0]
    assert completion.text == "ab"
    assert len(completion.logprobs) == len(completion.token_ids) < len(ids)
    assert math.isclose(completion.cumulative_logprob, -len(completion.token_ids))


def test_no_logprobs_requested_means_none(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    processor.add_request("r", None, [1], SamplingParams(), ["r"], 0.0)
    result = processor.process_outputs([EngineCoreOutput("r", [5], "length")])
    completion = result.request_outputs[0].outputs[0]
    assert completion.logprobs is None and completion.cumulative_logprob is None
    assert result.request_outputs[0].prompt_logprobs is None


def test_missing_logprob_rows_are_an_error(bpe_tokenizer):
    processor = OutputProcessor(bpe_tokenizer)
    processor.add_request("r", None, [1], SamplingParams(logprobs=2), ["r"], 0.0)
    with pytest.raises(ValueError, match="logprob rows"):
        processor.process_outputs([EngineCoreOutput("r", [5])])


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_prompt_logprobs_arrive_in_chunks_and_go_out_with_the_first_output(bpe_tokenizer, kind):
    processor = OutputProcessor(bpe_tokenizer)
    prompt = [3, 4, 5, 6, 7]
    params = SamplingParams(prompt_logprobs=1, output_kind=kind)
    processor.add_request("r", "p", prompt, params, ["r"], 0.0)
    chunk1 = rows(([4, 9], [-1.0, -0.5], 2), ([5, 5], [-0.3, -0.3], 1))
    chunk2 = rows(([6, 1], [-2.0, -0.1], 3), ([7, 7], [-0.2, -0.2], 1))
    first = processor.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=chunk1)])
    assert first.request_outputs == []  # nothing sampled yet
    second = processor.process_outputs([EngineCoreOutput("r", [8], new_prompt_logprobs=chunk2)])
    third = processor.process_outputs([EngineCoreOutput("r", [9], "length")])
    outputs = second.request_outputs + third.request_outputs
    prompt_logprobs = outputs[0].prompt_logprobs
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1
    else:
        assert len(outputs) == 2
        later = outputs[1].prompt_logprobs
        assert later is None if kind is RequestOutputKind.DELTA else later == prompt_logprobs
    assert prompt_logprobs[0] is None
    assert [sorted(d) for d in prompt_logprobs[1:]] == [[4, 9], [5], [1, 6], [7]]
    assert prompt_logprobs[1][4] == Logprob(-1.0, 2, bpe_tokenizer.decode([4]))
    assert prompt_logprobs[3][1].rank == 1


def test_without_text_decoded_token_is_none(bpe_tokenizer):
    for tokenizer, params in [(None, SamplingParams(logprobs=0)), (bpe_tokenizer, None)]:
        params = params or SamplingParams(logprobs=0, detokenize=False)
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", None, [1], params, ["r"], 0.0)
        lists = rows(([5], [-1.0], 1))
        result = processor.process_outputs([EngineCoreOutput("r", [5], new_logprobs=lists)])
        assert result.request_outputs[0].outputs[0].logprobs == [{5: Logprob(-1.0, 1, None)}]
