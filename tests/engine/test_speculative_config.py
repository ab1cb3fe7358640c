"""``speculative_config``: vLLM's keys on ``LLM``, ``EngineArgs`` and every CLI command,
vLLM's defaults, and start-up errors that name the key and the fix."""

from __future__ import annotations

import json

import pytest

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.entrypoints.cli.main import build_parser
from spec_decode.tiny_heads import write_eagle, write_eagle3, write_llama


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec-config")
    draft = write_llama(root / "draft", num_layers=1, seed=1)
    short = write_llama(root / "short", num_layers=1, seed=1)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    other_vocab = write_llama(root / "other-vocab", num_layers=1, seed=1)
    config = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": 128}))
    return {
        "target": str(write_llama(root / "target", num_layers=2, seed=0)),
        "draft": str(draft),
        "short": str(short),
        "other_vocab": str(other_vocab),
        "eagle": str(write_eagle(root / "EAGLE-tiny")),
        "eagle3": str(write_eagle3(root / "EAGLE3-tiny", aux_layers=[0, 1, 1])),
    }


def _config(checkpoints, speculative_config, **args):
    engine_args = EngineArgs(
        model=checkpoints["target"],
        skip_tokenizer_init=True,
        max_model_len=256,
        speculative_config=speculative_config,
        **args,
    )
    return engine_args.create_engine_config()[0].speculative


def test_ngram_gets_vllms_lookup_defaults(checkpoints) -> None:
    spec = _config(checkpoints, {"method": "ngram", "num_speculative_tokens": 4})
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 4)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = _config(
        checkpoints, '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    )
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)
    assert spec.disable_by_batch_size == 32 and spec.min_acceptance_rate == 0.25  # never hurts
    assert _config(checkpoints, None) is None


def test_model_based_methods_are_inferred_from_the_name_and_loaded_like_the_target(
    checkpoints,
) -> None:
    for name, method in (("draft", "draft_model"), ("eagle", "eagle"), ("eagle3", "eagle3")):
        spec = _config(checkpoints, {"model": checkpoints[name], "num_speculative_tokens": 3})
        assert spec.method == method
        assert spec.draft_model.model == checkpoints[name]
        assert spec.draft_model.max_model_len == 256


def test_the_cli_flag_takes_json() -> None:
    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    )
    assert engine_args_from_cli(args).speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 4,
    }
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--speculative-config", "ngram"])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method='medusa' is unknown"),
        ({"method": ["mtp"], "num_speculative_tokens": 1}, r"method=\['mtp'\] is unknown"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an integer >= 1",
        ),
        ({"method": "ngram"}, 'set "num_speculative_tokens"'),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "n_predict": 3},
            r"unknown key\(s\) \['n_predict'\]",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "make prompt_lookup_min <= prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 64}, "lower it"),
        ({"method": "eagle", "num_speculative_tokens": 2}, 'needs "model"'),
        ("{not json", "is not JSON"),
        ({"num_speculative_tokens": 2}, 'no "method"'),
    ],
)
def test_bad_configs_fail_at_start_up_naming_the_fix(checkpoints, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        _config(checkpoints, value)


def test_a_draft_that_cannot_serve_the_target_fails_at_start_up(checkpoints) -> None:
    with pytest.raises(ValueError, match="vocabulary of 128 tokens but the target has 96"):
        _config(checkpoints, {"model": checkpoints["other_vocab"], "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="holds 64 positions, fewer than max_model_len=256"):
        _config(checkpoints, {"model": checkpoints["short"], "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        _config(
            checkpoints,
            {"method": "eagle3", "model": checkpoints["eagle"], "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="needs 9 tokens per step"):
        _config(
            checkpoints, {"method": "ngram", "num_speculative_tokens": 8}, max_num_batched_tokens=8
        )
    with pytest.raises(ValueError, match=r"Draft model .* not found"):
        _config(checkpoints, {"model": "/no/such/dir", "num_speculative_tokens": 2})
