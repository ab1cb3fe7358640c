"""What a new user trips over gets one clean line, not a traceback: a busy port (found
before the model loads), a refused connection in ``pagedlm chat --url``, and Ctrl-C."""

from __future__ import annotations

import io
import socket

import pytest

from pagedlm.entrypoints.cli import main as cli
from pagedlm.entrypoints.openai.api_server import run_server


def test_busy_port_stops_serve_before_the_model_loads(monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine started before the port was checked")

    monkeypatch.setattr("pagedlm.engine.async_llm.AsyncLLM.from_engine_args", no_engine)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = cli.build_parser().parse_args(["serve", "--port", str(port)])
        with pytest.raises(SystemExit) as exit_info:
            run_server(args)
    message = str(exit_info.value)
    # vLLM's default host: every IPv4 interface, so a port taken on one of them is busy
    assert f"0.0.0.0:{port}" in message and "--port" in message


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_refused_connection_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["chat", "--url", url])
    assert str(exit_info.value).startswith(f"error: cannot connect to {url}")
    assert "pagedlm serve" in str(exit_info.value)


def test_ctrl_c_in_chat_exits_130_without_traceback(monkeypatch, capsys):
    class CtrlC(io.StringIO):
        def readline(self, *args) -> str:
            raise KeyboardInterrupt

    monkeypatch.setattr("sys.stdin", CtrlC())
    status = cli.main(["chat", "--url", f"http://127.0.0.1:{closed_port()}"])
    assert status == cli.INTERRUPTED_STATUS == 130
    err = capsys.readouterr().err
    assert err.strip() == "Interrupted." and "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--port", "99999", "argument --port: '99999' is not a port; give 0-65535"),
        ("--port", "-1", "argument --port: '-1' is not a port"),
        ("--max-request-body-bytes", "0", "argument --max-request-body-bytes: '0' is not"),
        ("--shutdown-timeout", "-5", "argument --shutdown-timeout: '-5' is not"),
        ("--engine-death-grace-period", "nan", "argument --engine-death-grace-period: 'nan'"),
    ],
)
def test_out_of_range_server_flags_exit_2_naming_the_flag(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["serve", flag, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--num-prompts", "-1"), ("--num-prompts", "0"), ("--output-len", "0"),
     ("--max-concurrency", "0"), ("--client-processes", "0"), ("--request-rate", "0")],
)  # fmt: skip
def test_bench_serve_refuses_counts_below_one_before_sending(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["bench", "serve", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: '{value}' is not" in capsys.readouterr().err


def test_bench_serve_without_a_server_is_one_line():
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "serve", "--base-url", url, "--num-prompts", "1"])
    assert str(exit_info.value).startswith(f"error: cannot connect to {url}")
    assert "pagedlm serve" in str(exit_info.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-modules", "sql=/adapters/sql"], "--lora-modules needs --enable-lora."),
        (["--enable-lora", "--lora-modules", "sql"], "'sql': use name=path."),
        (["--enable-lora", "--lora-modules", '{"name": "sql"}'], "need 'name' and 'path'"),
    ],
)
def test_bad_lora_modules_stop_serve_before_the_model_loads(monkeypatch, flags, message):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine started before --lora-modules was checked")

    monkeypatch.setattr("pagedlm.engine.async_llm.AsyncLLM.from_engine_args", no_engine)
    args = cli.build_parser().parse_args(["serve", "--port", str(closed_port()), *flags])
    with pytest.raises(SystemExit) as exit_info:
        run_server(args)
    assert message in str(exit_info.value)
