"""xgrammar and outlines backends on the real SmolLM2 tokenizer (no model needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output.backend import backend_class, bitmask_width
from pagedlm.structured_output.params import grammar_spec
from pagedlm.structured_output.token_bytes import token_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from pagedlm.tokenizer import get_tokenizer

    return get_tokenizer(smollm2_path, None)


@pytest.fixture(scope="module", params=["xgrammar", "outlines"])
def backend(request, tokenizer):
    return backend_class(request.param)(tokenizer, 49152, [tokenizer.eos_token_id])


def _allowed(matcher, vocab_size: int = 49152) -> set[int]:
    bitmask = np.zeros((2, bitmask_width(vocab_size)), dtype=np.int32)
    matcher.fill_bitmask(bitmask, 1)
    bits = np.unpackbits(bitmask[1].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def _walk(backend, tokenizer, params: StructuredOutputsParams, text: str):
    """Feed ``text``'s tokens; each must be allowed by the mask and accepted."""
    matcher = backend.make_matcher(backend.compile(grammar_spec(params)))
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert token in _allowed(matcher), (text, tokenizer.decode([token]))
        assert matcher.accept_token(token)
    return matcher


@pytest.mark.parametrize(
    ("params", "text"),
    [
        (StructuredOutputsParams(json=SCHEMA), json.dumps({"name": "Ann", "age": 7})),
        (StructuredOutputsParams(choice=["red (dark)", "blue.green"]), "blue.green"),
        (StructuredOutputsParams(regex=r"\d{3}-[a-z]+"), "123-abc"),
    ],
)
def test_valid_text_is_allowed_then_terminates_on_eos(backend, tokenizer, params, text):
    matcher = _walk(backend, tokenizer, params, text)
    eos = tokenizer.eos_token_id
    assert eos in _allowed(matcher) and not matcher.is_terminated()
    assert matcher.accept_token(eos)
    assert matcher.is_terminated()


def test_forbidden_tokens_are_masked_and_rejected(backend, tokenizer):
    params = StructuredOutputsParams(json=SCHEMA)
    matcher = backend.make_matcher(backend.compile(grammar_spec(params)))
    eos = tokenizer.eos_token_id
    bracket = tokenizer.encode("[", add_special_tokens=False)[0]
    allowed = _allowed(matcher)
    assert bracket not in allowed and eos not in allowed
    assert not matcher.accept_token(bracket)
    # Out-of-range age: "1" then "2" then "1" would make 121 > maximum 120.
    matcher = _walk(backend, tokenizer, params, '{"name": "A", "age": 12')
    one = tokenizer.encode("1", add_special_tokens=False)[0]
    assert one not in _allowed(matcher)


def test_xgrammar_ebnf(tokenizer):
    backend = backend_class("xgrammar")(tokenizer, 49152, [tokenizer.eos_token_id])
    grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [0-9]+\nop ::= "+" | "-"'
    matcher = _walk(backend, tokenizer, StructuredOutputsParams(grammar=grammar), "(12 + 3)")
    assert _allowed(matcher) == {tokenizer.eos_token_id}


def test_byte_level_token_bytes(tokenizer):
    table = token_bytes(tokenizer, 49152)
    the = tokenizer.convert_tokens_to_ids("Ġthe")
    newline = tokenizer.convert_tokens_to_ids("Ċ")
    assert table[the] == b" the" and table[newline] == b"\n"
    assert tokenizer.eos_token_id not in table, "special tokens are not text"


TOOL_TAG = {
    "type": "structural_tag",
    "structures": [
        {
            "begin": "<function=get_weather>",
            "schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
            "end": "</function>",
        }
    ],
    "triggers": ["<function="],
}
"""vLLM's form: free text until a trigger, then a tag's begin, its schema's JSON, its end."""


@pytest.mark.parametrize(
    "tag",
    [
        TOOL_TAG,
        {  # xgrammar's own form of the same constraint
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": ["<function="],
                "tags": [
                    {
                        "begin": "<function=get_weather>",
                        "content": {
                            "type": "json_schema",
                            "json_schema": TOOL_TAG["structures"][0]["schema"],
                        },
                        "end": "</function>",
                    }
                ],
            },
        },
    ],
)
def test_a_structural_tag_frees_text_and_constrains_what_follows_a_trigger(tokenizer, tag):
    xgrammar = backend_class("xgrammar")(tokenizer, 49152, [tokenizer.eos_token_id])
    params = StructuredOutputsParams(structural_tag=json.dumps(tag))
    text = 'Let me check. <function=get_weather>{"city": "Paris"}</function> Done.'
    _walk(xgrammar, tokenizer, params, text)  # free text, the call, free text again
    matcher = _walk(xgrammar, tokenizer, params, "Sure <function=get_weather>")
    assert not matcher.accept_token(tokenizer.encode("[", add_special_tokens=False)[0])
    outlines = backend_class("outlines")
    with pytest.raises(ValueError, match="outlines backend cannot run structural tags"):
        outlines.validate(grammar_spec(params))


def test_a_structural_tag_is_checked_before_the_engine():
    with pytest.raises(ValueError, match="structural_tag is not valid JSON"):
        StructuredOutputsParams(structural_tag="{not json")
    with pytest.raises(ValueError, match="structural_tag must be a JSON object"):
        StructuredOutputsParams(structural_tag="[1]")
    xgrammar = backend_class("xgrammar")
    with pytest.raises(ValueError, match=r"Invalid structured_outputs\.structural_tag"):
        xgrammar.validate(grammar_spec(StructuredOutputsParams(structural_tag='{"type": 1}')))
