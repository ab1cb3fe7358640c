"""The command line every benchmark module shares (``python -m pagedlm.benchmarks.<name>``):
``--help`` describes the benchmark by its module docstring's first paragraph."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose description is ``doc``'s first paragraph, on one line."""
    return argparse.ArgumentParser(description=" ".join((doc or "").split("\n\n")[0].split()))


def parse_bench_args(
    doc: str | None,
    add_args: Callable[[argparse.ArgumentParser], None],
    argv: list[str] | None = None,
) -> argparse.Namespace:
    """``argv`` (None: the command line) parsed with the flags ``add_args`` declares."""
    parser = bench_parser(doc)
    add_args(parser)
    return parser.parse_args(argv)
