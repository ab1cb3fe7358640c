"""``--config FILE`` (vLLM's): a YAML file of flags; the command line wins over it, and it
over the defaults."""

from __future__ import annotations

import io
import re

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
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "--config", _write(tmp_path, text)])
    assert exit_info.value.code == 2  # a usage error, as argparse's own
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-model-len: [1, 2]\n", "max-model-len: '[1, 2]' is not a count"),
        ("max-num-seqs: 2.5\n", "max-num-seqs: invalid int value: '2.5'"),
        ("seed: true\n", "seed: true is not a value of --seed"),
        ("enforce-eager: 'yes'\n", "enforce-eager: takes true or false, not 'yes'"),
        ("load-format: nonsense\n", "load-format: invalid choice: 'nonsense'"),
        ("port: 99999\n", "port: '99999' is not a port"),
        ("served-model-name: {a: 1}\n", "served-model-name: {'a': 1} is not a value"),
        ("speculative-config: 5\n", "speculative-config: expected a JSON object"),
    ],
)
def test_a_value_of_the_wrong_type_exits_2_naming_the_key(tmp_path, capsys, text, message):
    # A value the flag would refuse on the command line is refused from the file too,
    # before it reaches the engine (a list or float crashed deep inside it).
    path = _write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "--config", path])
    assert exit_info.value.code == 2
    assert f"--config {path}: {message}" in capsys.readouterr().err


def test_typed_values_in_the_file_become_the_flags_values(tmp_path) -> None:
    path = _write(
        tmp_path,
        "max-num-seqs: 4\ngpu-memory-utilization: 0.5\nenforce-eager: true\nseed: null\n"
        "served-model-name: one\nhf-overrides: {rope_theta: 5}\nmax-model-len: 32k\n"
        "allowed-origins: [a, b]\n",
    )
    args = parse_args(["serve", "--config", path])
    assert (args.max_num_seqs, args.gpu_memory_utilization, args.enforce_eager) == (4, 0.5, True)
    assert args.seed is None and args.served_model_name == ["one"]
    assert args.hf_overrides == {"rope_theta": 5} and args.max_model_len == 32000
    assert args.allowed_origins == ["a", "b"]  # a flag of JSON text takes the file's list


def test_a_missing_file_is_named(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "--config", str(tmp_path / "absent.yaml")])
    assert exit_info.value.code == 2
    assert "absent.yaml: No such file" in capsys.readouterr().err


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
