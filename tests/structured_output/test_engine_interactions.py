"""Structured outputs where they meet the rest of the engine, one focused case per bug the
engine-level fuzz test (``test_engine_fuzz.py``) found, on the tiny byte-level llama."""

from __future__ import annotations

import pytest

from pagedlm import LLM
from pagedlm.structured_output.backend import GrammarSpec
from server.server_utils import write_chat_checkpoint

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
