"""``pagedlm run-batch``: a file in OpenAI's Batch format through the server's own routes,
in this process and without a port (vLLM's ``run_batch``).

Each input line is ``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}`` (any route the server answers with a body: completions, chat, embeddings,
classify, score, rerank, ...). Every line becomes one request to the HTTP app over an
in-process transport, so validation, defaults and errors are exactly the server's; up to
``--max-concurrency`` run at once, and the engine batches them. Each output line, in input
order, is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``: ``error`` is None for a 200, else the error's message. A line that is not a
request object (bad JSON, a missing or repeated ``custom_id``, a ``url`` that is not one of
the server's request routes, ``stream``) gets its error (400, as vLLM's) without reaching
the engine; the other lines are unaffected.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

DEFAULT_MAX_CONCURRENCY = 256


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-i", "--input-file", required=True, help="The batch: one request per line ('-': stdin)."
    )
    parser.add_argument(
        "-o", "--output-file", required=True, help="Where the results go ('-': stdout)."
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=DEFAULT_MAX_CONCURRENCY,
        help="Requests in flight at once (default: %(default)s).",
    )


def _line_error(custom_id: Any, status: int, message: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": None, "body": None},
        "error": message,
    }


TEXT_ROUTES = ("/tokenize", "/detokenize", "/v1/messages/count_tokens")


def batch_routes() -> tuple[str, ...]:
    """The routes a batch line may name: the ones that answer a request from the model, and
    the tokenizer's (vLLM's run_batch takes chat, embeddings, score and rerank). Admin
    routes (``/reset_prefix_cache``, ``/v1/load_lora_adapter``, ...) change the server
    under the other lines' feet, and are none of them."""
    from pagedlm.entrypoints.openai.admin import MODEL_ROUTES

    return tuple(route for route in MODEL_ROUTES if route != "/invocations") + TEXT_ROUTES


def _request(
    line: str, routes: Sequence[str], seen: dict[str, int], line_number: int
) -> tuple[str, str, dict[str, Any]] | dict[str, Any]:
    """(custom_id, url, body) of a line, or the output line of its error. ``seen`` maps
    each custom_id taken so far to its line number."""
    try:
        item = json.loads(line)
    except ValueError as error:
        return _line_error(None, 400, f"The line is not JSON: {error}.")
    if not isinstance(item, dict):
        return _line_error(None, 400, "A batch line must be a JSON object.")
    custom_id = item.get("custom_id")
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return _line_error(
            custom_id,
            400,
            "custom_id must be a non-empty string, the id that matches this line's result "
            f"to it; got {custom_id!r}.",
        )
    if custom_id in seen:
        return _line_error(
            custom_id,
            400,
            f"custom_id {custom_id!r} was used on line {seen[custom_id]} already; give each "
            "line its own.",
        )
    seen[custom_id] = line_number
    if method != "POST":
        return _line_error(custom_id, 400, f"method {method!r} is not supported; use POST.")
    if url not in routes:
        return _line_error(
            custom_id,
            400,
            f"url {url!r} is not a route a batch can use; use one of {', '.join(routes)}.",
        )
    if not isinstance(body, dict):
        return _line_error(custom_id, 400, "body must be a JSON object (the route's request).")
    if body.get("stream"):
        return _line_error(custom_id, 400, "stream is not supported in a batch; drop it.")
    return custom_id, url, body


async def run_lines(app: Any, lines: Sequence[str], max_concurrency: int) -> list[dict[str, Any]]:
    """Each non-blank line's output object, in order, from ``app`` (the HTTP app)."""
    import httpx

    slots = asyncio.Semaphore(max_concurrency)
    transport = httpx.ASGITransport(app=app)
    routes, seen = batch_routes(), dict[str, int]()
    requests = [
        _request(line, routes, seen, number)
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]

    async def one(
        client: httpx.AsyncClient, request: tuple[str, str, dict[str, Any]] | dict[str, Any]
    ) -> dict[str, Any]:
        if isinstance(request, dict):
            return request
        custom_id, url, body = request
        async with slots:
            response = await client.post(url, json=body)
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": {"message": response.text}}
        ok = response.status_code == 200
        return {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": {
                "status_code": response.status_code,
                "request_id": payload.get("id") if ok and isinstance(payload, dict) else None,
                "body": payload,
            },
            "error": None if ok else (payload.get("error") or {}).get("message", response.text),
        }

    async with httpx.AsyncClient(
        transport=transport, base_url="http://batch", timeout=None
    ) as client:
        return await asyncio.gather(*(one(client, request) for request in requests))


def run_batch(args: argparse.Namespace) -> None:
    """``pagedlm run-batch``: start the engine, run the file, write the results, stop."""
    from pagedlm.engine.async_llm import AsyncLLM
    from pagedlm.engine.cli_args import engine_args_from_cli
    from pagedlm.entrypoints.openai.api_server import DEFAULT_MODEL_NAME, serving_context
    from pagedlm.entrypoints.openai.app import build_app
    from pagedlm.entrypoints.openai.server_args import check_serving_args, read_chat_template
    from pagedlm.logging_config import configure_logging

    if args.max_concurrency < 1:
        raise SystemExit(
            f"error: --max-concurrency must be at least 1, got {args.max_concurrency}."
        )
    limits = check_serving_args(args)
    configure_logging(args.log_level)
    lines = _read_lines(args.input_file)
    # Opened before the model loads: an unwritable path must not cost the batch's work.
    output = _open_output(args.output_file)
    try:
        engine_args = engine_args_from_cli(args)
        names = args.served_model_name or [engine_args.model or DEFAULT_MODEL_NAME]
        try:
            engine = AsyncLLM.from_engine_args(engine_args)
        except ValueError as error:  # a bad engine flag, as serve and generate say it
            raise SystemExit(f"error: {error}") from None
        try:
            chat_template = read_chat_template(args.chat_template)
            ctx = serving_context(args, engine, names, limits, chat_template)
            results = asyncio.run(run_lines(build_app(ctx), lines, args.max_concurrency))
        finally:
            engine.shutdown()
        output.write("".join(json.dumps(result, ensure_ascii=False) + "\n" for result in results))
    finally:
        if output is not sys.stdout:
            output.close()


def _usage_error(message: str) -> NoReturn:
    print(f"pagedlm run-batch: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _read_lines(path: str) -> list[str]:
    """The input file's lines ('-': stdin); an unreadable file exits naming it."""
    try:
        if path == "-":
            return sys.stdin.read().splitlines()
        with open(path, encoding="utf-8") as file:
            return file.read().splitlines()
    except OSError as error:
        _usage_error(f"--input-file {path}: {error.strerror}; give a readable JSONL file.")
    except UnicodeDecodeError as error:
        _usage_error(
            f"--input-file {path} is not UTF-8 text ({error.reason} at byte {error.start}); "
            "give a JSONL file of OpenAI batch requests."
        )


def _open_output(path: str) -> TextIO:
    """The output file, opened for writing ('-': stdout); an unwritable path exits naming
    it."""
    if path == "-":
        return sys.stdout
    try:
        return open(path, "w", encoding="utf-8")  # closed by run_batch
    except OSError as error:
        _usage_error(f"--output-file {path}: {error.strerror}; give a path that can be written.")
