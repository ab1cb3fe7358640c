"""vLLM's ``structured_outputs_config`` (and ``--structured-outputs-backend auto``): the
backend it names, compact JSON for every request, and errors that name the key."""

from __future__ import annotations

import json

import pytest

from pagedlm import LLM, SamplingParams, StructuredOutputsParams
from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.engine.structured_outputs_args import resolve_structured_outputs
from pagedlm.entrypoints.cli.main import parse_args

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("backend", "config", "expected"),
    [
        ("auto", None, ("xgrammar", False)),  # vLLM's default: xgrammar where installed
        ("outlines", None, ("outlines", False)),
        ("auto", {"backend": "outlines"}, ("outlines", False)),
        ("outlines", {"backend": "outlines", "disable_any_whitespace": True}, ("outlines", True)),
        ("auto", {"disable_fallback": True, "disable_additional_properties": True},
         ("xgrammar", False)),
    ],
)  # fmt: skip
def test_the_backend_and_whitespace_rule(backend, config, expected):
    assert resolve_structured_outputs(backend, config) == expected


@pytest.mark.parametrize(
    ("backend", "config", "message"),
    [
        ("auto", {"backend": "guidance"}, "'guidance' is unknown"),
        ("xgrammar", {"backend": "outlines"}, "given twice"),
        ("auto", {"whitespace": 1}, r"unknown key\(s\) \['whitespace'\]"),
        ("auto", {"disable_any_whitespace": "yes"}, "disable_any_whitespace must be true or"),
        ("auto", {"reasoning_parser": 3}, "reasoning_parser must be a string"),
        ("auto", {"enable_in_reasoning": "yes"}, "enable_in_reasoning must be true or false"),
    ],
)
def test_errors_name_the_key(backend, config, message):
    with pytest.raises(ValueError, match=message):
        resolve_structured_outputs(backend, config)


def test_the_flag_takes_vllms_json_and_compact_json_reaches_every_request(chat_checkpoint):
    args = engine_args_from_cli(
        parse_args(["serve", str(chat_checkpoint), "--structured-outputs-config",
                    '{"backend": "xgrammar", "disable_any_whitespace": true}'])
    )  # fmt: skip
    llm = LLM(**{**vars(args), "num_kv_blocks": 32, "max_model_len": 128})
    config = llm.llm_engine.config
    assert config.structured_outputs_backend == "xgrammar"
    assert config.structured_outputs_compact_json
    params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    resolved = llm.llm_engine.input_processor.resolve_params(params, 3)
    assert resolved.structured_outputs.disable_any_whitespace
    assert not params.structured_outputs.disable_any_whitespace  # the caller's is untouched
    [out] = llm.generate(["{"], params, use_tqdm=False)
    text = out.outputs[0].text
    # no free whitespace: only xgrammar's fixed separators, as json.dumps writes them
    assert text == json.dumps(json.loads(text)), text
    llm.llm_engine.shutdown()
