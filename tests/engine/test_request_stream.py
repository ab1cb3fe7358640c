"""RequestStream: a consumer that falls behind takes merged outputs, and loses nothing."""

import asyncio

import pytest

from pagedlm.engine.request_stream import RequestStream
from pagedlm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedlm.sampling_params import RequestOutputKind


def _output(samples, finished=False, prompt_logprobs=None):
    return RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=[1, 2],
        prompt_logprobs=prompt_logprobs,
        outputs=samples,
        finished=finished,
    )


def _sample(index, text, ids, finish=None, logprobs=None):
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=ids,
        cumulative_logprob=-float(len(ids)),
        logprobs=logprobs,
        finish_reason=finish,
    )


def _drain(stream):
    async def take_all():
        items = []
        while stream._items:
            items.append(await stream.get())
        return items

    return asyncio.run(take_all())


def test_delta_outputs_merge_while_the_consumer_is_behind():
    stream = RequestStream(RequestOutputKind.DELTA, 2)
    lp = [{5: Logprob(-0.1, 1)}]
    stream.put(
        _output([_sample(0, "a", [5], logprobs=lp)], prompt_logprobs=[None, {2: Logprob(-1.0)}])
    )
    stream.put(_output([_sample(1, "x", [7], logprobs=[{7: Logprob(-0.2, 1)}])]))
    stream.put(
        _output([_sample(0, "bc", [6, 8], logprobs=[{6: Logprob(-0.3, 1)}, {8: Logprob(-0.4, 2)}])])
    )
    stream.put(
        _output(
            [_sample(0, "", [], finish="stop"), _sample(1, "y", [9], finish="length")],
            finished=True,
        )
    )
    (merged,) = _drain(stream)
    assert merged.finished
    assert merged.prompt_logprobs == [None, {2: Logprob(-1.0)}]
    first, second = merged.outputs
    assert (first.index, first.text, first.token_ids, first.finish_reason) == (
        0,
        "abc",
        [5, 6, 8],
        "stop",
    )
    assert [list(row) for row in first.logprobs] == [[5], [6], [8]]
    assert (second.index, second.text, second.token_ids, second.finish_reason) == (
        1,
        "xy",
        [7, 9],
        "length",
    )
    assert first.cumulative_logprob == 0.0  # the newest delta's (an empty one here)


def test_a_consumer_that_keeps_up_sees_every_step():
    stream = RequestStream(RequestOutputKind.DELTA, 2)

    async def run():
        seen = []
        for text in ("a", "b", "c"):
            stream.put(_output([_sample(0, text, [1])], finished=text == "c"))
            seen.append((await stream.get()).outputs[0].text)
        return seen

    assert asyncio.run(run()) == ["a", "b", "c"]


def test_cumulative_snapshots_replace_and_errors_are_never_merged():
    stream = RequestStream(RequestOutputKind.CUMULATIVE, 2)
    stream.put(_output([_sample(0, "a", [1])]))
    stream.put(_output([_sample(0, "ab", [1, 2])]))
    stream.put(ValueError("boom"))
    stream.put(_output([_sample(0, "abc", [1, 2, 3])]))
    stream.put(None)
    items = []

    async def run():
        for _ in range(4):
            try:
                items.append(await stream.get())
            except ValueError as error:
                items.append(error)

    asyncio.run(run())
    assert items[0].outputs[0].text == "ab"
    assert isinstance(items[1], ValueError)
    assert items[2].outputs[0].text == "abc"
    assert items[3] is None


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_nothing_merges_into_a_finished_output(kind):
    stream = RequestStream(kind, 2)
    stream.put(_output([_sample(0, "a", [1], finish="stop")], finished=True))
    stream.put(None)
    items = _drain(stream)
    assert items[0].finished and items[1] is None
