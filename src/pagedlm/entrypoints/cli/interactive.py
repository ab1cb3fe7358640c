"""``pagedlm generate`` (one prompt, streamed) and ``pagedlm chat`` (a conversation loop).

Both run the engine in this process (``LLMEngine`` with DELTA outputs: no engine-core
process to start); ``chat --url`` talks to a running server instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from pagedlm.engine.cli_args import engine_args_from_cli
from pagedlm.sampling_params import RequestOutputKind, SamplingParams


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    group.add_argument("--top-p", type=float, default=0.95, help="(default: %(default)s)")
    group.add_argument("--top-k", type=int, default=-1, help="(default: %(default)s: off)")


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", "-p", default=None, help="The prompt (default: read stdin).")
    _add_sampling_args(parser)


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="Server base URL, e.g. http://127.0.0.1:8000.")
    parser.add_argument("--api-key", default=None, help="API key for --url.")
    parser.add_argument("--system", default=None, help="System prompt.")
    _add_sampling_args(parser)


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        output_kind=RequestOutputKind.DELTA,
    )


def _stream_local(
    engine: Any, prompt: Any, params: SamplingParams, request_id: str
) -> Iterator[str]:
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            for sample in output.outputs:
                if sample.text:
                    yield sample.text


def _engine(args: argparse.Namespace) -> Any:
    from pagedlm.engine.llm_engine import LLMEngine

    try:
        return LLMEngine.from_engine_args(engine_args_from_cli(args))
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def run_generate(args: argparse.Namespace, out: TextIO = sys.stdout) -> None:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    engine = _engine(args)
    try:
        for text in _stream_local(engine, prompt, _params(args), "generate-0"):
            out.write(text)
            out.flush()
        out.write("\n")
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    finally:
        engine.shutdown()


def _stream_remote(args: argparse.Namespace, messages: list[dict]) -> Iterator[str]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stream": True,
    }
    if args.top_k != -1:
        body["top_k"] = args.top_k
    url = args.url.rstrip("/") + "/v1/chat/completions"
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=None) as response:
            if response.status_code != 200:
                response.read()
                raise SystemExit(
                    f"error: the server answered {response.status_code}: {response.text}"
                )
            yield from _stream_deltas(response.iter_lines())
    except httpx.ConnectError as error:
        raise SystemExit(
            f"error: cannot connect to {args.url} ({error}); start a server there "
            "(pagedlm serve) or fix --url."
        ) from None
    except httpx.TransportError as error:
        raise SystemExit(f"error: the connection to {args.url} failed: {error!r}") from None


def _stream_deltas(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise SystemExit(f"error: {chunk['error']['message']}")
        for choice in chunk["choices"]:
            text = choice["delta"].get("content")
            if text:
                yield text


def run_chat(
    args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None
) -> None:
    stdin = stdin or sys.stdin  # looked up now: sys.stdin may have been replaced
    out = out or sys.stdout
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    engine = None if args.url else _engine(args)
    out.write("Chat with the model; an empty line or Ctrl-D ends.\n")
    try:
        for turn in range(1_000_000):
            out.write("> ")
            out.flush()
            line = stdin.readline()
            if not line.strip():
                break
            messages.append({"role": "user", "content": line.rstrip("\n")})
            if engine is None:
                stream = _stream_remote(args, messages)
            else:
                tokenizer = engine.get_tokenizer()
                prompt_ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
                prompt = {"prompt_token_ids": list(prompt_ids)}
                stream = _stream_local(engine, prompt, _params(args), f"chat-{turn}")
            reply = []
            for text in stream:
                reply.append(text)
                out.write(text)
                out.flush()
            out.write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})
    finally:
        if engine is not None:
            engine.shutdown()
