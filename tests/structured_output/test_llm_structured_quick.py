"""A small end-to-end check in the default suite: one engine (xgrammar), one mixed batch.

The full matrix (both backends, more schemas, EBNF) is ``test_llm_structured.py -m slow``.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedlm import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["color", "count"],
}
PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from pagedlm import LLM

    engine = LLM(smollm2_path, max_model_len=256, max_num_batched_tokens=256)
    yield engine
    engine.llm_engine.shutdown()


def test_mixed_batch(llm):
    free = SamplingParams(temperature=0.0, max_tokens=8)
    jobs = [
        ("Name a fruit.", free),
        (
            "A color and a count in JSON.",
            SamplingParams(
                temperature=0.0,
                max_tokens=30,
                structured_outputs=StructuredOutputsParams(
                    json=SCHEMA, disable_any_whitespace=True
                ),
            ),
        ),
        (
            "Is the sky green?",
            SamplingParams(
                temperature=0.0,
                max_tokens=4,
                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
            ),
        ),
    ]
    outputs = llm.generate([PROMPT.format(p) for p, _ in jobs], [s for _, s in jobs])
    free_out, json_out, choice_out = (o.outputs[0] for o in outputs)
    assert json_out.finish_reason == "stop", json_out.text
    jsonschema.validate(json.loads(json_out.text), SCHEMA)
    assert "\n" not in json_out.text, "disable_any_whitespace: no free whitespace"
    assert choice_out.text in ("yes", "no") and choice_out.finish_reason == "stop"
    alone = llm.generate([PROMPT.format(jobs[0][0])], free)[0].outputs[0]
    assert free_out.token_ids == alone.token_ids


def test_invalid_schema_is_rejected_and_the_engine_keeps_working(llm):
    bad = StructuredOutputsParams(json={"type": "object", "required": "color"})
    with pytest.raises(ValueError, match="not a valid JSON schema at required"):
        llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=bad))
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0]
    assert len(out.token_ids) == 2
