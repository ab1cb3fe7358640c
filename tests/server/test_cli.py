"""The ``pagedlm`` command line: help, engine flags from EngineArgs, generate, chat, bench."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys

import pytest

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.entrypoints.cli.main import build_parser

SUBCOMMANDS = [["serve"], ["generate"], ["chat"], ["bench"], ["bench", "serve"]]


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=" ".join)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: pagedlm " + " ".join(command) in capsys.readouterr().out


def test_every_engine_arg_is_a_flag_of_every_engine_command():
    parser = build_parser()
    for command in ("serve", "generate", "chat"):
        args = parser.parse_args([command])
        assert engine_args_from_cli(args) == EngineArgs()
    option_strings = {
        option for action in parser._subparsers._group_actions[0].choices["serve"]._actions
        for option in action.option_strings
    }  # fmt: skip
    for field in dataclasses.fields(EngineArgs):
        assert "--" + field.name.replace("_", "-") in option_strings


def test_engine_flags_parse_to_engine_args():
    args = build_parser().parse_args(
        ["serve", "/models/x", "--max-num-seqs", "3", "--no-enable-prefix-caching",
         "--num-kv-blocks", "none", "--dtype", "float32", "--port", "9"]
    )  # fmt: skip
    engine_args = engine_args_from_cli(args)
    assert engine_args.model == "/models/x"
    assert engine_args.max_num_seqs == 3
    assert engine_args.enable_prefix_caching is False
    assert engine_args.num_kv_blocks is None
    assert engine_args.dtype == "float32"
    assert args.port == 9
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-seqs", "many"])
    with pytest.raises(SystemExit, match="MODEL given twice"):
        engine_args_from_cli(build_parser().parse_args(["serve", "a", "--model", "b"]))


def test_import_pagedlm_loads_no_server_libraries():
    code = (
        "import sys, pagedlm, pagedlm.engine.cli_args; "
        "bad = [m for m in ('fastapi', 'uvicorn', 'zmq', 'prometheus_client') if m in sys.modules]; "
        "sys.exit(bool(bad))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_generate_streams_to_stdout(chat_checkpoint):
    from pagedlm.entrypoints.cli.interactive import run_generate

    args = build_parser().parse_args(
        ["generate", str(chat_checkpoint), "--prompt", "Hi", "--max-tokens", "5",
         "--temperature", "0", "--num-kv-blocks", "16"]
    )  # fmt: skip
    out = io.StringIO()
    run_generate(args, out)
    assert len(out.getvalue()) > 1 and out.getvalue().endswith("\n")


def test_chat_against_server(tiny_server):
    from pagedlm.entrypoints.cli.interactive import run_chat

    args = build_parser().parse_args(["chat", "--url", tiny_server.url, "--max-tokens", "4"])
    out = io.StringIO()
    run_chat(args, io.StringIO("Hello\nAgain\n\n"), out)
    assert out.getvalue().count("> ") == 3


@pytest.mark.parametrize(
    "rate, extra",
    [("inf", []), ("50", []), ("inf", ["--max-concurrency", "2"]),
     ("50", ["--client-processes", "2"])],
)  # fmt: skip
def test_bench_serve(tiny_server, rate, extra, capsys):
    from pagedlm.entrypoints.cli.bench import run_bench_serve

    args = build_parser().parse_args(
        ["bench", "serve", "--base-url", tiny_server.url, "--num-prompts", "4",
         "--request-rate", rate, "--input-len", "8", "--output-len", "6", *extra]
    )  # fmt: skip
    summary = run_bench_serve(args)
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["client_processes"] == (2 if "--client-processes" in extra else 1)
    assert summary["output_token_throughput"] > 0
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < summary[name]["p50_ms"] <= summary[name]["p99_ms"]
    assert "TTFT (ms)" in capsys.readouterr().out
