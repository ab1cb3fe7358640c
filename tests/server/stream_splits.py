"""One driver for the streaming-parser tests: a model's text fed in pieces, split everywhere.

A streaming parser (reasoning or tool calls) has ``feed(text) -> delta`` and
``finish() -> delta``. Whatever the split, the deltas together must say what the whole
text says; these helpers feed every single split and the one-character-at-a-time one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

Result = TypeVar("Result")


def split_points(text: str) -> Iterator[list[int]]:
    """Every single cut ``[0] .. [len(text)]``, then a cut between every two characters."""
    for cut in range(len(text) + 1):
        yield [cut]
    yield list(range(1, len(text)))


def feed_in_pieces(parser: Any, text: str, cuts: Sequence[int]) -> list[Any]:
    """Feed ``text`` cut at ``cuts`` (ascending) to ``parser``, then finish it: every delta."""
    deltas = []
    previous = 0
    for cut in [*cuts, len(text)]:
        deltas.append(parser.feed(text[previous:cut]))
        previous = cut
    deltas.append(parser.finish())
    return deltas


def assert_every_split_gives(
    new_parser: Callable[[], Any],
    text: str,
    expected: Result,
    combine: Callable[[list[Any]], Result],
) -> None:
    """``combine(deltas)`` equals ``expected`` for a fresh parser under every split of ``text``."""
    for cuts in split_points(text):
        assert combine(feed_in_pieces(new_parser(), text, cuts)) == expected, cuts
