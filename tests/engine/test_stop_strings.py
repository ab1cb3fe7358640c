"""Stop-string search and the streaming hold-back."""

from __future__ import annotations

from pagedlm.engine.stop_strings import StopMatch, find_stop_string, stop_string_holdback


def test_match_completed_by_new_text_is_found_with_look_back():
    # "o w" started in text already checked ("Hello") and ends in the new text.
    assert find_stop_string("Hello world", ["o w"], 5, False) == StopMatch("o w", 4)
    assert find_stop_string("Hello world", ["o w"], 5, True) == StopMatch("o w", 7)


def test_match_ending_in_checked_text_is_not_reported_again():
    assert find_stop_string("abcXdef", ["bc"], 3, False) is None
    assert find_stop_string("abcXdef", ["bc"], 2, False) == StopMatch("bc", 1)


def test_earliest_ending_match_wins_then_the_longest():
    assert find_stop_string("xxabcd", ["cd", "b"], 2, False) == StopMatch("b", 3)
    assert find_stop_string("xxabcd", ["bcd", "cd"], 2, False) == StopMatch("bcd", 3)
    assert find_stop_string("xxabcd", ["zz"], 0, False) is None


def test_holdback_is_the_longest_suffix_that_starts_a_stop_string():
    assert stop_string_holdback("Hello St", ["Stop", "tea"]) == 2
    assert stop_string_holdback("Hello Sto", ["Stop", "Sto!"]) == 3
    assert stop_string_holdback("Hello", ["Stop"]) == 0
    # A complete stop string is not held back (it is cut by the search instead).
    assert stop_string_holdback("ab", ["ab"]) == 0
    assert stop_string_holdback("a", ["ab", "abc"]) == 1
