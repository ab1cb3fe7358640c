"""``pagedlm run-batch``: a file in OpenAI's Batch format through the server's own routes,
in this process and without a port (vLLM's ``run_batch``).

Each input line is ``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}`` (any route the server answers with a body: completions, chat, embeddings,
classify, score, rerank, ...). Every line becomes one request to the HTTP app over an
in-process transport, so validation, defaults and errors are exactly the server's; up to
``--max-concurrency`` run at once, and the engine batches them. Each output line, in input
order, is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``: ``error`` is None for a 200, else the error's message. A line that is not a
request object (bad JSON, a missing field, ``stream``) gets its error without reaching the
engine; the other lines are unaffected.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Sequence
from typing import Any

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


def _request(line: str) -> tuple[Any, str, dict[str, Any]] | dict[str, Any]:
    """(custom_id, url, body) of a line, or the output line of its error."""
    try:
        item = json.loads(line)
    except ValueError as error:
        return _line_error(None, 400, f"The line is not JSON: {error}.")
    if not isinstance(item, dict):
        return _line_error(None, 400, "A batch line must be a JSON object.")
    custom_id = item.get("custom_id")
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if method != "POST":
        return _line_error(custom_id, 400, f"method {method!r} is not supported; use POST.")
    if not isinstance(url, str) or not url.startswith("/"):
        return _line_error(custom_id, 400, 'url must be a route such as "/v1/chat/completions".')
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

    async def one(client: httpx.AsyncClient, line: str) -> dict[str, Any]:
        request = _request(line)
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
        return await asyncio.gather(*(one(client, line) for line in lines if line.strip()))


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
    if args.input_file == "-":
        lines = sys.stdin.read().splitlines()
    else:
        with open(args.input_file, encoding="utf-8") as file:
            lines = file.read().splitlines()
    engine_args = engine_args_from_cli(args)
    names = args.served_model_name or [engine_args.model or DEFAULT_MODEL_NAME]
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        ctx = serving_context(args, engine, names, limits, read_chat_template(args.chat_template))
        results = asyncio.run(run_lines(build_app(ctx), lines, args.max_concurrency))
    finally:
        engine.shutdown()
    text = "".join(json.dumps(result, ensure_ascii=False) + "\n" for result in results)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        with open(args.output_file, "w", encoding="utf-8") as file:
            file.write(text)
