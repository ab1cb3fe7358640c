"""Stop strings: finding them in generated text, and holding back what could become one.

The engine core only sees token ids, so stop *strings* are matched here, on the text the
detokenizer releases. A stop string may span several tokens, so each search looks back
far enough into the text already checked to catch a match that the new text completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """A stop string found in the text, and how much of the text to keep."""

    stop_string: str
    truncate_to: int
    """Length of the text to keep: the match's start, or its end when the stop string
    is included in the output."""


def find_stop_string(
    text: str, stop: Sequence[str], new_text_start: int, include_in_output: bool
) -> StopMatch | None:
    """The first stop string that ends in ``text[new_text_start:]``, or None.

    "First" is the match that ends earliest (the one generation would have met first);
    of matches ending at the same place the longest (earliest start) wins. Text before
    ``new_text_start`` was searched already: matches ending there are not reported.
    """
    best: tuple[int, int, str] | None = None
    for stop_string in stop:
        start = text.find(stop_string, max(new_text_start - len(stop_string) + 1, 0))
        if start < 0:
            continue
        end = start + len(stop_string)
        if best is None or (end, start) < best[:2]:
            best = (end, start, stop_string)
    if best is None:
        return None
    end, start, stop_string = best
    return StopMatch(stop_string, end if include_in_output else start)


def stop_string_holdback(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

    Streaming that suffix could leak the beginning of a stop string that the next tokens
    complete, so it is withheld until it either completes (and is cut) or stops matching.
    The value never shrinks the released text: a longer matching suffix of a longer text
    would already have matched the shorter one.
    """
    longest = 0
    for stop_string in stop:
        for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
            if text.endswith(stop_string[:length]):
                longest = length
                break
    return longest
