"""``pagedlm run-batch``: OpenAI's Batch format through the server's routes in process, one
result per line in input order, bad lines answered without harming the others; and the
command itself on a file."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedlm.entrypoints.cli.main import main
from pagedlm.entrypoints.openai.run_batch import run_lines
from server.server_utils import in_process_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": 0}  # fmt: skip
COMPLETION = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


LINES = [
    _line("chat", "/v1/chat/completions", CHAT),
    "",  # blank lines are skipped
    _line("completion", "/v1/completions", COMPLETION),
    "{not json",
    _line("streamed", "/v1/completions", {**COMPLETION, "stream": True}),
    _line("too hot", "/v1/completions", {**COMPLETION, "temperature": 9}),
    _line("nowhere", "/v1/nothing", COMPLETION),
    # Lines whose custom_id cannot name their result, and a route that is no request's:
    json.dumps({"method": "POST", "url": "/v1/completions", "body": COMPLETION}),
    _line(7, "/v1/completions", COMPLETION),  # type: ignore[arg-type]
    _line("chat", "/v1/completions", COMPLETION),
    _line("admin", "/reset_prefix_cache", {}),
    _line("after", "/v1/completions", COMPLETION),
]


@pytest.fixture(scope="module")
def results(chat_checkpoint):
    engine, app = in_process_app(chat_checkpoint, num_kv_blocks=64, max_model_len=64)

    async def direct():
        import httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return (await http.post("/v1/completions", json=COMPLETION)).json()

    try:
        yield asyncio.run(run_lines(app, LINES, 2)), asyncio.run(direct())
    finally:
        engine.shutdown()


def test_every_line_gets_its_result_in_order(results):
    outputs, direct = results
    outputs = outputs[:6]
    assert [o["custom_id"] for o in outputs] == [
        "chat", "completion", None, "streamed", "too hot", "nowhere"
    ]  # fmt: skip
    statuses = [o["response"]["status_code"] for o in outputs]
    assert statuses == [200, 200, 400, 400, 400, 400]  # an unknown url: vLLM's 400
    assert "/v1/chat/completions" in outputs[5]["error"]  # the routes it may name
    chat, completion = outputs[0], outputs[1]
    assert chat["error"] is None and chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["request_id"] == chat["response"]["body"]["id"]
    # The same text as the route gives directly (greedy).
    assert completion["response"]["body"]["choices"][0]["text"] == direct["choices"][0]["text"]
    assert "not JSON" in outputs[2]["error"]
    assert "stream is not supported" in outputs[3]["error"]
    assert "temperature" in outputs[4]["error"] and outputs[4]["response"]["body"]["error"]
    assert all(o["id"].startswith("batch_req_") for o in outputs)


def test_lines_without_their_own_custom_id_or_with_an_admin_url_are_refused(results):
    outputs = results[0][6:]
    assert [o["custom_id"] for o in outputs] == [None, 7, "chat", "admin", "after"]
    statuses = [o["response"]["status_code"] for o in outputs]
    assert statuses == [400, 400, 400, 400, 200]  # the line after them is answered
    assert all(o["response"]["body"] is None for o in outputs[:4])  # never reached a route
    assert "custom_id must be a non-empty string" in outputs[0]["error"]
    assert "custom_id must be a non-empty string" in outputs[1]["error"]
    assert "'chat' was used on line 1 already" in outputs[2]["error"]
    assert "'/reset_prefix_cache' is not a route a batch can use" in outputs[3]["error"]


def test_the_command_reads_and_writes_files(chat_checkpoint, tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(LINES[:3]) + "\n")
    argv = ["run-batch", "-i", str(source), "-o", str(target), str(chat_checkpoint),
            "--served-model-name", "tiny", "--num-kv-blocks", "64", "--max-model-len", "64"]  # fmt: skip
    assert main(argv) == 0
    outputs = [json.loads(line) for line in target.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == ["chat", "completion"]
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    with pytest.raises(SystemExit, match="--max-concurrency must be at least 1"):
        main([*argv, "--max-concurrency", "0"])
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice needs --tool-call-parser"):
        main([*argv, "--enable-auto-tool-choice"])


@pytest.mark.parametrize("flag", [["--port", "9000"], ["--middleware", "m:M"], ["--api-key", "k"]])
def test_the_listeners_flags_are_refused_not_ignored(flag, capsys):
    # run-batch serves no port: serve's listener flags would do nothing there.
    with pytest.raises(SystemExit):
        main(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", *flag])
    assert f"unrecognized arguments: {flag[0]}" in capsys.readouterr().err


def _no_engine(*args, **kwargs):
    raise AssertionError("the engine started before the files were checked")


@pytest.mark.parametrize(
    ("input_text", "output_name", "message"),
    [
        (None, "out.jsonl", "--input-file {tmp}/in.jsonl: No such file or directory"),
        (b"\xff\xfe{}\n", "out.jsonl", "--input-file {tmp}/in.jsonl is not UTF-8 text"),
        (b"", "absent/out.jsonl", "--output-file {tmp}/absent/out.jsonl: No such file"),
    ],
)
def test_unusable_files_exit_2_before_the_model_loads(
    tmp_path, monkeypatch, capsys, input_text, output_name, message
):
    monkeypatch.setattr("pagedlm.engine.async_llm.AsyncLLM.from_engine_args", _no_engine)
    if input_text is not None:
        (tmp_path / "in.jsonl").write_bytes(input_text)
    argv = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / output_name)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_a_bad_engine_flag_is_one_line(tmp_path, chat_checkpoint):
    source = tmp_path / "in.jsonl"
    source.write_text(LINES[0] + "\n")
    argv = ["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"),
            str(chat_checkpoint), "--gpu-memory-utilization", "2"]  # fmt: skip
    with pytest.raises(SystemExit, match="error: gpu_memory_utilization must be a fraction"):
        main(argv)
