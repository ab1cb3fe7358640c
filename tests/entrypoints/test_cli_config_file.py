"""``--config FILE`` (vLLM's): a YAML file of flags; the command line wins over it, and it
over the defaults."""

from __future__ import annotations

import io

import pytest

from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.entrypoints.cli.main import parse_args


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_file_values_are_defaults_and_the_command_line_wins(tmp_path) -> None:
    path = _write(
        tmp_path,
        "model: some/model\n"
        "max-model-len: 512\n"
        "num_kv_blocks: 40\n"
        "enable-prefix-caching: false\n"
        "logits-processors: [pkg.mod:Proc]\n"
        "speculative-config: {method: ngram, num_speculative_tokens: 2}\n"
        "port: 9000\n"
        "served-model-name: [alias]\n",
    )
    args = parse_args(["serve", "--config", path, "--max-model-len", "256", "--port", "8001"])
    engine = engine_args_from_cli(args)
    assert (engine.model, engine.max_model_len, engine.num_kv_blocks) == ("some/model", 256, 40)
    assert engine.enable_prefix_caching is False
    assert engine.logits_processors == ["pkg.mod:Proc"]
    assert engine.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert args.port == 8001 and args.served_model_name == ["alias"]
    positional = engine_args_from_cli(parse_args(["serve", "other/model", "--config", path]))
    assert positional.model == "other/model"  # the positional MODEL wins over the file's


def test_strings_in_the_file_are_parsed_as_the_flag_would(tmp_path) -> None:
    args = parse_args(["serve", "--config", _write(tmp_path, 'max-model-len: "1024"\n')])
    assert args.max_model_len == 1024


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-model-len: 512\nno-such-flag: 1\n", r"unknown option\(s\) \['no-such-flag'\]"),
        ("- a\n- b\n", "must hold a mapping"),
        ("key: [unclosed\n", "is not YAML"),
    ],
)
def test_a_bad_file_is_an_error_that_says_why(tmp_path, capsys, text, message) -> None:
    with pytest.raises(SystemExit, match=message):
        parse_args(["serve", "--config", _write(tmp_path, text)])


def test_a_missing_file_is_named(tmp_path) -> None:
    with pytest.raises(SystemExit, match="No such file"):
        parse_args(["serve", "--config", str(tmp_path / "absent.yaml")])


def test_generate_runs_from_a_file(tmp_path, chat_checkpoint) -> None:
    from pagedlm.entrypoints.cli.interactive import run_generate

    path = _write(
        tmp_path,
        f"model: {chat_checkpoint}\nnum-kv-blocks: 16\nmax-tokens: 4\ntemperature: 0\n",
    )
    args = parse_args(["generate", "--config", path, "--prompt", "Hi"])
    assert args.max_tokens == 4 and args.num_kv_blocks == 16
    out = io.StringIO()
    run_generate(args, out)
    assert out.getvalue().endswith("\n")
