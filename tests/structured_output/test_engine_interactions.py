"""Structured outputs where they meet the rest of the engine, one focused case per bug the
engine-level fuzz test (``test_engine_fuzz.py``) found, on the tiny byte-level llama."""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams, StructuredOutputsParams
from pagedlm.structured_output.backend import GrammarSpec
from server.server_utils import EOS_ID, write_chat_checkpoint

SPECULATIVE = {
    "none": None,
    "draft_model": "draft_model",
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(write_chat_checkpoint(tmp_path_factory.mktemp("so-interactions")))


def _llm(model_path: str, speculative: str, **engine_args) -> LLM:
    config = SPECULATIVE[speculative]
    if config == "draft_model":  # the target drafts for itself: long accepted runs
        config = {"method": "draft_model", "model": model_path, "num_speculative_tokens": 3}
    return LLM(
        model_path, max_model_len=128, dtype="float32", speculative_config=config, **engine_args
    )


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("regex", "\t[a-z]+"),
        GrammarSpec("choice", '["café", "naïve"]'),
        GrammarSpec("json", '{"enum": ["é", "ü"]}'),
    ],
)
def test_outlines_takes_tabs_and_non_ascii(spec: GrammarSpec) -> None:
    # Was: "The vocabulary provided is incompatible with the regex": validation compiled
    # against printable ASCII only, though byte-level vocabularies spell any byte.
    from pagedlm.structured_output.outlines_backend import OutlinesBackend

    OutlinesBackend.validate(spec)


@pytest.mark.parametrize("speculative", ["none", "draft_model", "ngram"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_yields_to_a_grammar_that_has_ended(
    model_path: str, speculative: str, async_scheduling: bool
) -> None:
    # Was: once "zz" matched, the grammar allowed only EOS and min_tokens masked it, so
    # the row sampled from all -inf (token 0), which was emitted before an abort.
    llm = _llm(model_path, speculative, async_scheduling=async_scheduling)
    choice = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        min_tokens=6,
        logprobs=1,
        structured_outputs=StructuredOutputsParams(choice=["zz", "ab"]),
    )
    # A grammar that can go on still keeps EOS masked until min_tokens.
    repeated = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=12,
        min_tokens=6,
        structured_outputs=StructuredOutputsParams(regex="(ab)+"),
    )
    ended, going_on = llm.generate(["zz zz zz", "abababab"], [choice, repeated], use_tqdm=False)
    llm.llm_engine.shutdown()
    out = ended.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("zz", "stop", None)
    assert out.token_ids[-1] == EOS_ID and len(out.logprobs) == len(out.token_ids)
    assert all(row[t].logprob > float("-inf") for t, row in zip(out.token_ids, out.logprobs))
    out = going_on.outputs[0]
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) >= 6
    assert out.text == "ab" * (len(out.text) // 2) and len(out.text) >= 6


@pytest.mark.parametrize("speculative", ["none", "draft_model"])
def test_a_token_the_grammar_forbids_is_never_emitted(model_path: str, speculative: str) -> None:
    # allowed_token_ids leave no token the grammar allows. Was: the token sampled from an
    # all -inf row was emitted (finish "abort", stop reason "sampled a token the grammar
    # does not allow"); the output kept text that breaks the grammar.
    llm = _llm(model_path, speculative)
    conflicting = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        allowed_token_ids=[70, 71],
        structured_outputs=StructuredOutputsParams(choice=["zz"]),
    )
    free = SamplingParams(temperature=0.0, max_tokens=8)
    bad, good = llm.generate(["zz", "hello"], [conflicting, free], use_tqdm=False)
    alone = llm.generate(["hello"], free, use_tqdm=False)[0]
    llm.llm_engine.shutdown()
    out = bad.outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([], "", "abort")
    assert "allowed_token_ids" in out.stop_reason
    assert good.outputs[0].token_ids == alone.outputs[0].token_ids


def _accepts(backend, spec: GrammarSpec, text: str, end: bool = True) -> bool:
    """Whether a fresh matcher of ``spec`` takes ``text`` (then EOS, with ``end``)."""
    matcher = backend.make_matcher(backend.compile(spec))
    token_ids = backend.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in token_ids + [EOS_ID] * end)


@pytest.fixture(scope="module")
def tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (GrammarSpec("regex", "(ab)+"), "abab"),
        (GrammarSpec("regex", "[0-9]+(\\.[0-9]+)?"), "12.5"),
        (GrammarSpec("choice", '["yes", "yes please"]'), "yes please"),
        (GrammarSpec("regex", "a|b|ab"), "ab"),
    ],
)
def test_outlines_goes_on_past_a_point_where_the_regex_may_end(
    tokenizer, spec: GrammarSpec, text: str
) -> None:
    # Was: outlines-core dropped every token leading from a point where the regex may
    # end to one where it may not, so "(ab)+" stopped at "ab", a number never took its
    # decimals and "yes please" could not follow "yes".
    from pagedlm.structured_output.outlines_backend import OutlinesBackend

    backend = OutlinesBackend(tokenizer, 384, [EOS_ID])
    assert _accepts(backend, spec, text)
    assert not _accepts(backend, spec, text + "!", end=False)


def test_xgrammar_json_object_is_an_object(tokenizer) -> None:
    # Was: xgrammar's builtin JSON grammar, which takes any JSON value (a fuzz case
    # emitted "[-0e2325]") and free whitespace under disable_any_whitespace.
    from pagedlm.structured_output.xgrammar_backend import XgrammarBackend

    backend = XgrammarBackend(tokenizer, 384, [EOS_ID])
    compact, spaced = GrammarSpec("json_object", "", True), GrammarSpec("json_object", "")
    assert _accepts(backend, compact, '{"a": [1, "x"]}')
    assert _accepts(backend, spaced, '{ "a" :\n1 }')
    for not_an_object in ("[1]", "-0e2", '"x"', "true"):
        assert not _accepts(backend, spaced, not_an_object, end=False)
    assert not _accepts(backend, compact, '{ "a": 1}', end=False)
