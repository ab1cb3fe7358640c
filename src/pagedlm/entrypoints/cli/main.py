"""``pagedlm`` command line: ``serve``, ``generate``, ``chat``, ``run-batch``, ``bench
serve|throughput|latency``.

Every subcommand that runs an engine takes the same engine flags, generated from
``EngineArgs`` (``pagedlm.engine.cli_args``), plus an optional positional MODEL.
"""

from __future__ import annotations

import argparse
import sys

from pagedlm.engine.core_launch import CoreLaunch

# Nothing here imports torch at module level: ``pagedlm serve`` starts its engine-core
# process before the parser (whose engine flags come from modules that need torch) exists.
INTERRUPTED_STATUS = 130
"""Exit status after Ctrl-C (128 + SIGINT), as shells report it."""


def _add_model_positional(parser: argparse.ArgumentParser) -> None:
    from pagedlm.engine.cli_args import POSITIONAL_MODEL_DEST

    parser.add_argument(
        POSITIONAL_MODEL_DEST,
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct).",
    )


def build_parser() -> argparse.ArgumentParser:
    from pagedlm import __version__
    from pagedlm.engine.cli_args import add_engine_args
    from pagedlm.entrypoints.cli import bench, interactive
    from pagedlm.entrypoints.cli.config_file import add_config_arg
    from pagedlm.entrypoints.openai.server_args import (
        add_server_args,
        add_serving_args,
        engine_help_texts,
    )

    parser = argparse.ArgumentParser(
        prog="pagedlm", description="pagedlm: LLM inference and an OpenAI-compatible server."
    )
    parser.add_argument("--version", action="version", version=f"pagedlm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.set_defaults(subparsers=commands.choices)

    serve = commands.add_parser(
        "serve",
        help="Serve a model over OpenAI- and Anthropic-compatible HTTP APIs.",
        description="Serve a model over HTTP (/v1/completions, /v1/chat/completions, "
        "/v1/messages, /metrics, ...).",
    )
    _add_model_positional(serve)
    add_server_args(serve)
    add_engine_args(serve, help_texts=engine_help_texts())
    add_config_arg(serve)

    generate = commands.add_parser(
        "generate",
        help="Generate from one prompt, streamed to stdout.",
        description="Generate from one prompt in this process, streaming text to stdout.",
    )
    _add_model_positional(generate)
    interactive.add_generate_args(generate)
    add_engine_args(generate)
    add_config_arg(generate)

    chat = commands.add_parser(
        "chat",
        help="Chat interactively, in-process or against a server (--url).",
        description="Interactive chat. Without --url the model runs in this process.",
    )
    _add_model_positional(chat)
    interactive.add_chat_args(chat)
    add_engine_args(chat)
    add_config_arg(chat)

    from pagedlm.entrypoints.openai.run_batch import add_run_batch_args

    run_batch = commands.add_parser(
        "run-batch",
        help="Run a file of requests in OpenAI's Batch format, offline.",
        description="Run a file in OpenAI's Batch format (one {custom_id, method, url, body} "
        "per line) through the server's routes in this process, and write one result per "
        "line. Takes the server's serving flags (--chat-template, --served-model-name, ...) too.",
    )
    _add_model_positional(run_batch)
    add_run_batch_args(run_batch)
    add_serving_args(run_batch)
    add_engine_args(run_batch)
    add_config_arg(run_batch)

    bench_parser = commands.add_parser(
        "bench", help="Benchmarks.", description="Benchmarks against a running server."
    )
    bench_commands = bench_parser.add_subparsers(
        dest="bench_command", required=True, metavar="BENCH"
    )
    bench.add_bench_serve_args(
        bench_commands.add_parser(
            "serve",
            help="Load a running server (Poisson or burst) and report latencies.",
            description="Send requests to a running server at a given rate and report request "
            "throughput, output tokens/s and TTFT / TPOT / ITL (mean, p50, p99).",
        )
    )
    from pagedlm.benchmarks import latency, throughput

    throughput.add_args(
        bench_commands.add_parser(
            "throughput",
            help="Offline throughput (random or nano-vllm dataset), with %% of speed-of-light.",
            description=throughput.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    latency.add_args(
        bench_commands.add_parser(
            "latency",
            help="Offline latency of one batch (mean and percentiles), with %% of speed-of-light.",
            description=latency.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The core imports torch while this process imports it and the server (seconds each).
    core_launch = CoreLaunch.for_command_line(argv)
    try:
        args = parse_args(argv)
        _run(args, core_launch)
    except KeyboardInterrupt:  # Ctrl-C (while loading, chatting, generating): no traceback
        print("\nInterrupted.", file=sys.stderr)
        return INTERRUPTED_STATUS
    finally:
        if core_launch is not None:
            core_launch.abandon()  # unless the engine took it
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, with a ``--config`` file's values as the subcommand's defaults."""
    from pagedlm.engine.cli_args import dotted_json_flags

    argv = dashed_flags(dotted_json_flags(argv))
    parser = build_parser()
    args = _parse_known(parser, argv)
    path = getattr(args, "config", None)
    if path is None:
        return args
    from pagedlm.engine.cli_args import POSITIONAL_MODEL_DEST
    from pagedlm.entrypoints.cli.config_file import config_defaults

    subparser = args.subparsers[args.command]
    defaults = config_defaults(path, subparser)
    if getattr(args, POSITIONAL_MODEL_DEST, None) is not None:
        defaults.pop("model", None)  # MODEL on the command line wins over the file's
    subparser.set_defaults(**defaults)
    return _parse_known(parser, argv)


def _parse_known(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, whose error for an unknown flag also says what to do: vLLM's
    fix for a vLLM flag pagedlm does not take, or the nearest flag for a typo."""
    from pagedlm.entrypoints.cli.unknown_flags import unknown_flags_message

    args, extras = parser.parse_known_args(argv)
    if extras:
        subparser = args.subparsers[args.command]
        if getattr(args, "bench_command", None) is not None:
            subparser = subparser._subparsers._group_actions[0].choices[args.bench_command]
        known = (flag for action in subparser._actions for flag in action.option_strings)
        subparser.error(unknown_flags_message(extras, known))
    return args


def dashed_flags(argv: list[str]) -> list[str]:
    """``--max_model_len=4096`` as ``--max-model-len=4096``: vLLM's parser takes either
    spelling of a long flag, so command lines written for it work here. Values and
    everything after a bare ``--`` stay as given."""
    dashed = []
    for index, arg in enumerate(argv):
        if arg == "--":
            return dashed + argv[index:]
        if arg.startswith("--"):
            name, equals, value = arg.partition("=")
            arg = name.replace("_", "-") + equals + value
        dashed.append(arg)
    return dashed


def _run(args: argparse.Namespace, core_launch: CoreLaunch | None = None) -> None:
    if args.command == "serve":
        from pagedlm.entrypoints.openai.api_server import run_server

        run_server(args, core_launch)
    elif args.command == "generate":
        from pagedlm.entrypoints.cli.interactive import run_generate

        run_generate(args)
    elif args.command == "chat":
        from pagedlm.entrypoints.cli.interactive import run_chat

        run_chat(args)
    elif args.command == "run-batch":
        from pagedlm.entrypoints.openai.run_batch import run_batch

        run_batch(args)
    elif args.command == "bench" and args.bench_command == "serve":
        from pagedlm.entrypoints.cli.bench import run_bench_serve

        run_bench_serve(args)
    elif args.command == "bench":
        from pagedlm.benchmarks import latency, throughput

        {"throughput": throughput, "latency": latency}[args.bench_command].run(args)


if __name__ == "__main__":
    sys.exit(main())
