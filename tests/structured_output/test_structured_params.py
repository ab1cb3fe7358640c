"""StructuredOutputsParams checks, canonical specs, and per-backend validation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedlm import SamplingParams, StructuredOutputsParams
from pagedlm.structured_output.backend import GrammarSpec, backend_class
from pagedlm.structured_output.params import grammar_spec, validate_structured_outputs

SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"regex": "a+", "choice": ["x"]}, {"json": SCHEMA, "json_object": True}],
)
def test_exactly_one_kind(kwargs):
    with pytest.raises(ValueError, match="exactly one of json"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1, 2]"}, "must be a JSON schema object"),
        ({"json": 3}, "must be a dict or a JSON string"),
        ({"choice": []}, "non-empty list of strings"),
        ({"choice": ["a", ""]}, "non-empty list of strings"),
        ({"choice": "ab"}, "non-empty list of strings, got str"),  # not ["a", "b"]
        ({"choice": {"a": 1}}, "non-empty list of strings, got dict"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"grammar": " \n"}, "grammar must be a non-empty string"),
        ({"json_object": False}, "exactly one of"),
        ({"json_object": "yes"}, "json_object must be true or null, got 'yes'"),
        ({"json_object": 1}, "json_object must be true or null, got 1"),
        ({"regex": "a", "disable_any_whitespace": 5}, "disable_any_whitespace must be true"),
    ],
)
def test_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_a_regex_of_whitespace_is_a_regex():
    assert StructuredOutputsParams(regex="\t ").regex == "\t "


def test_sampling_params_field_and_kind():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    assert params.structured_outputs.kind == "json_object"
    assert params.clone().structured_outputs == params.structured_outputs
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})


def test_spec_is_canonical_and_keeps_property_order():
    from_dict = grammar_spec(StructuredOutputsParams(json=SCHEMA))
    from_text = grammar_spec(
        StructuredOutputsParams(
            json='{"type": "object", "properties": '
            '{"b": {"type": "string"}, "a": {"type": "integer"}}}'
        )
    )
    assert from_dict == from_text
    assert from_dict.spec.index('"b"') < from_dict.spec.index('"a"')
    compact = grammar_spec(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert compact != from_dict and compact.compact
    assert grammar_spec(StructuredOutputsParams(choice=["x", "y"])) == GrammarSpec(
        "choice", '["x", "y"]'
    )


BAD_FOR_BOTH = [
    (StructuredOutputsParams(json={"type": "integger"}), "not a valid JSON schema"),
    (StructuredOutputsParams(json={"type": "object", "required": "a"}), "not a valid JSON schema"),
    (StructuredOutputsParams(regex="a(b"), "regex"),
]


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
@pytest.mark.parametrize(("params", "message"), BAD_FOR_BOTH)
def test_invalid_specs_raise_before_the_engine(backend, params, message):
    with pytest.raises(ValueError, match=message):
        validate_structured_outputs(params, backend)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_valid_specs_pass(backend):
    for params in [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[a-z]+@example\.com"),
        StructuredOutputsParams(choice=["a.b", "c|d", "e (f)", 'g"h']),
        StructuredOutputsParams(
            json={"type": "integer", "minimum": 1, "maximum": 9}, disable_any_whitespace=True
        ),
    ]:
        validate_structured_outputs(params, backend)


def test_xgrammar_grammar_errors_name_the_problem():
    validate_structured_outputs(StructuredOutputsParams(grammar='root ::= "a" | "b"'), "xgrammar")
    with pytest.raises(ValueError, match=r"Invalid structured_outputs\.grammar: .*line 1"):
        validate_structured_outputs(StructuredOutputsParams(grammar='root ::= "a'), "xgrammar")
    with pytest.raises(ValueError, match=r"Invalid structured_outputs\.grammar"):
        validate_structured_outputs(StructuredOutputsParams(grammar="start ::= x"), "xgrammar")


def test_outlines_refuses_what_it_cannot_enforce():
    with pytest.raises(ValueError, match=r"cannot run EBNF grammars; use .*xgrammar"):
        validate_structured_outputs(StructuredOutputsParams(grammar='root ::= "a"'), "outlines")
    unbounded = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0}}}
    with pytest.raises(ValueError, match="cannot enforce minimum"):
        validate_structured_outputs(StructuredOutputsParams(json=unbounded), "outlines")


def test_unknown_backend():
    with pytest.raises(ValueError, match="Unknown structured_outputs_backend 'lark'"):
        backend_class("lark")


def test_import_pagedlm_loads_no_grammar_library():
    code = (
        "import sys, pagedlm, pagedlm.sample.sampler, pagedlm.core.engine_core\n"
        "from pagedlm import StructuredOutputsParams\n"
        "StructuredOutputsParams(json={'type': 'object'})\n"
        "bad = [m for m in sys.modules if m.startswith(('xgrammar', 'outlines'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
