"""Numbers and problem lists as people read them: decimal bytes, clock times, one problem per line."""

from __future__ import annotations

from dspark_precompute.humanize import human_bytes, human_seconds, listing


def test_bytes_are_decimal_units_with_one_decimal_and_whole_bytes_below_a_kilobyte():
    assert [human_bytes(n) for n in (0, 999, 1000, 1_500_000, 2.5e9, 13.5e12, 4e15)] == [
        "0 B", "999 B", "1.0 KB", "1.5 MB", "2.5 GB", "13.5 TB", "4000.0 TB"]


def test_seconds_read_as_a_clock_and_negative_ones_as_zero():
    assert [human_seconds(s) for s in (-3, 0, 59.9, 61, 3599, 3600, 90061)] == [
        "0:00", "0:00", "0:59", "1:01", "59:59", "1:00:00", "25:01:01"]


def test_one_problem_is_one_line_and_several_are_a_counted_list():
    assert listing("bad config", ["a is wrong"], "fix it") == "bad config: a is wrong. fix it"
    assert listing("bad config", ["a", "b"], "fix it") == "bad config (2 problems):\n  - a\n  - b\nfix it"
