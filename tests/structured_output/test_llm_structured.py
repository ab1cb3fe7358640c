"""Structured outputs end to end with the real SmolLM2 on CPU, with both backends.

One engine per backend (module fixture) and one batched ``generate`` per backend: every
constrained request rides in the same batch as unconstrained ones, which must produce
exactly the tokens they produce alone (a grammar's mask or state leaking into another row
would show). Exact equality holds only in batch-invariant mode: otherwise a row's numerics
depend on the step's row count (on CPU the GGUF layers take the int4 kernel, which rounds
to bf16, below 16 rows and a float32 copy from there on), so a run alone, with its prompt
a prefix-cache hit, can part from the batched run at a near-tie. Run with ``-m slow``; the
default suite has a smaller version in ``test_llm_structured_quick.py``.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from pagedlm import SamplingParams, StructuredOutputsParams

# Two engines and ~70 decode steps of a 12-request batch: minutes on a shared CPU.
pytestmark = pytest.mark.slow

SHORT_STRING = {"type": "string", "minLength": 1, "maxLength": 10}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": SHORT_STRING,
                    "address": {
                        "type": "object",
                        "properties": {"city": SHORT_STRING},
                        "required": ["city"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["person"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": SHORT_STRING, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["color", "size"],
    },
    "bounded": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["age", "rating"],
    },
}
XGRAMMAR_ONLY_SCHEMAS = {
    "float_bounds": {
        "type": "object",
        "properties": {"probability": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["probability"],
    },
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"'
PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 60


def _free(seed: int | None = None) -> SamplingParams:
    temperature = 0.0 if seed is None else 0.8
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=12)


def _constrained(**kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(**kwargs),
    )


@pytest.fixture(scope="module", params=["xgrammar", "outlines"])
def run(request, smollm2_path):
    """One engine per backend: one mixed batch, and the free requests run alone."""
    from pagedlm import LLM

    backend = request.param
    llm = LLM(
        smollm2_path,
        max_model_len=512,
        structured_outputs_backend=backend,
        batch_invariant=True,  # alone and batched must agree bitwise (module docstring)
    )
    schemas = dict(SCHEMAS, **(XGRAMMAR_ONLY_SCHEMAS if backend == "xgrammar" else {}))
    jobs: list[tuple[str, str, SamplingParams]] = [
        ("free_greedy", "Tell me about cats.", _free()),
        ("free_seeded", "Write a haiku.", _free(seed=11)),
    ]
    jobs += [
        (f"json:{name}", f"Answer in JSON: describe a {name} example.", _constrained(json=s))
        for name, s in schemas.items()
    ]
    jobs += [
        ("regex", "A name and an age:", _constrained(regex=REGEX)),
        ("choice", "Is 'I love it' positive or negative?", _constrained(choice=CHOICES)),
    ]
    if backend == "xgrammar":
        # outlines indexes "any JSON object" in seconds (then caches it): not in this file.
        jobs.append(("json_object", "Give me any JSON object.", _constrained(json_object=True)))
        jobs.append(("grammar", "Is water wet?", _constrained(grammar=GRAMMAR)))
    outputs = llm.generate([PROMPT.format(p) for _, p, _ in jobs], [s for _, _, s in jobs])
    batch = {name: out.outputs[0] for (name, _, _), out in zip(jobs, outputs, strict=True)}
    alone = {
        name: llm.generate([PROMPT.format(p)], params)[0].outputs[0]
        for name, p, params in jobs
        if name.startswith("free")
    }
    yield SimpleNamespace(backend=backend, llm=llm, schemas=schemas, batch=batch, alone=alone)
    llm.llm_engine.shutdown()


def test_json_schemas_validate(run):
    for name, schema in run.schemas.items():
        out = run.batch[f"json:{name}"]
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_grammar_and_json_object(run):
    batch = run.batch
    assert re.fullmatch(REGEX, batch["regex"].text), batch["regex"].text
    assert batch["choice"].text in CHOICES
    if run.backend == "xgrammar":
        assert re.fullmatch(r"The answer is (yes|no)\.", batch["grammar"].text)
        assert isinstance(json.loads(batch["json_object"].text), dict)
    for name, out in batch.items():
        if not name.startswith("free"):
            assert out.finish_reason == "stop", (name, out.text)


def test_unconstrained_requests_match_their_solo_runs(run):
    for name, out in run.alone.items():
        assert run.batch[name].token_ids == out.token_ids, name


def test_bad_structured_outputs_raise_before_the_engine(run):
    bad = [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": 5}}}),
        StructuredOutputsParams(regex="(unclosed"),
    ]
    if run.backend == "outlines":
        bad.append(StructuredOutputsParams(grammar='root ::= "a"'))
    else:
        bad.append(StructuredOutputsParams(grammar="root ::= undefined_rule"))
    for params in bad:
        with pytest.raises(ValueError, match=r"structured_outputs|JSON schema|EBNF"):
            run.llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=params))
    assert not run.llm.llm_engine.has_unfinished_requests()
