"""Times on E2B's wire: a start time the server reports, passed back as
``started_after``, selects the sandbox it came from (and one microsecond later does not)."""

from __future__ import annotations

import datetime

import pytest

from sandlot.server._e2b_control import _iso, _micros, _moment

# Each of these rounds up to the next microsecond as a datetime, while round(t * 1e6)
# of the float rounds down: compared that way, a sandbox was not "started after" its
# own reported start (one time in sixteen).
DISAGREEING = [1795708634.5414126]


@pytest.mark.parametrize("started", [*DISAGREEING, 1795708634.0, 1795708634.9999996])
def test_a_reported_start_selects_its_own_sandbox(started: float) -> None:
    reported = _moment(_iso(started), "startedAfter")
    assert reported is not None
    assert _micros(started) >= _micros(reported)
    later = reported + datetime.timedelta(microseconds=1)
    assert not _micros(started) >= _micros(later)


def test_the_float_rounding_disagrees_for_these_times() -> None:
    """The control: the old comparison fails for the times above."""
    for started in DISAGREEING:
        reported = _moment(_iso(started), "startedAfter")
        assert reported is not None
        assert round(started * 1e6) < round(reported.timestamp() * 1e6)


def test_naive_times_are_utc() -> None:
    naive = _moment("2026-11-26T15:57:14.541413", "startedAfter")
    assert naive == datetime.datetime(2026, 11, 26, 15, 57, 14, 541413, tzinfo=datetime.UTC)
