"""Hand-checked cases for the pandas references (sessions, dedup): boundaries, merges, TTL."""

from __future__ import annotations

import pandas as pd
import pytest

from tests.reference.dedup import dedup
from tests.reference.sessions import empty_sessions, merge_into_sessions, sessionize


def ev(*rows: tuple) -> pd.DataFrame:
    """(user, ts, value) rows."""
    return pd.DataFrame(rows, columns=["user", "ts", "value"]).astype(
        {"ts": "int64", "value": "float64"})


def ids(*rows: tuple) -> pd.DataFrame:
    """(event_id, ts) rows."""
    return pd.DataFrame(rows, columns=["event_id", "ts"]).astype({"ts": "int64"})


def tuples(df: pd.DataFrame) -> list[tuple]:
    return [tuple(r) for r in df.itertuples(index=False)]


# -- sessions ----------------------------------------------------------------
@pytest.mark.parametrize("second, expected", [
    (9, [("a", 0, 9, 2, 3.0)]),                          # < gap apart: one session
    (10, [("a", 0, 0, 1, 1.0), ("a", 10, 10, 1, 2.0)]),  # exactly gap apart: two
])
def test_gap_boundary(second, expected):
    merged = merge_into_sessions(empty_sessions(), ev(("a", 0, 1.0), ("a", second, 2.0)), gap_ms=10)
    assert tuples(merged) == expected


def test_session_closes_when_watermark_reaches_end_plus_gap():
    # gap 10, lateness 5: a's session [0, 0] closes once wm >= 10, i.e. max ts >= 15.
    not_yet = sessionize([ev(("a", 0, 1.0), ("b", 14, 1.0))], gap_ms=10, lateness_ms=5)
    assert not_yet.runs[0].watermark == 9 and not_yet.runs[0].emitted.empty
    exactly = sessionize([ev(("a", 0, 1.0), ("b", 15, 1.0))], gap_ms=10, lateness_ms=5)
    assert exactly.runs[0].watermark == 10
    assert tuples(exactly.runs[0].emitted) == [("a", 0, 0, 1, 1.0)]
    assert tuples(exactly.open_sessions) == [("b", 15, 15, 1, 1.0)]


def test_late_rows_are_dropped_against_the_watermark_at_run_start():
    runs = [ev(("x", 100, 1.0)),                         # wm -> 95
            ev(("x", 95, 5.0), ("x", 96, 7.0), ("x", 90, 9.0))]
    result = sessionize(runs, gap_ms=10, lateness_ms=5)
    assert result.runs[0].late == 0
    assert (result.runs[1].late, result.runs[1].accepted) == (2, 1)  # 95 (== wm) and 90
    assert tuples(result.open_sessions) == [("x", 96, 100, 2, 8.0)]


def test_nothing_is_late_in_the_first_run_and_an_empty_run_keeps_the_watermark():
    runs = [ev(("x", 0, 1.0), ("x", -50, 1.0)), ev(), ev(("x", -20, 1.0))]
    result = sessionize(runs, gap_ms=10, lateness_ms=5)
    assert [r.watermark for r in result.runs] == [-5, -5, -5]
    assert [r.late for r in result.runs] == [0, 0, 1]


def test_late_event_merges_two_open_sessions_then_the_merged_session_closes():
    runs = [ev(("u", 100, 1.0), ("u", 118, 2.0)),           # two sessions, wm 88
            ev(("u", 109, 4.0)),                             # bridges them (9 < 10 each side)
            ev(("v", 200, 1.0))]                             # wm 170 >= 118 + 10
    result = sessionize(runs, gap_ms=10, lateness_ms=30)
    assert [r.emitted.empty for r in result.runs] == [True, True, False]
    assert tuples(result.runs[2].emitted) == [("u", 100, 118, 3, 7.0)]
    assert tuples(result.open_sessions) == [("v", 200, 200, 1, 1.0)]


def test_emitted_sessions_never_reopen():
    runs = [ev(("u", 0, 1.0), ("w", 100, 1.0)),  # u's [0, 0] closes (wm 70 >= 10)
            ev(("u", 71, 1.0), ("w", 101, 1.0))]
    result = sessionize(runs, gap_ms=10, lateness_ms=30)
    assert tuples(result.runs[0].emitted) == [("u", 0, 0, 1, 1.0)]
    assert tuples(result.open_sessions) == [("u", 71, 71, 1, 1.0), ("w", 100, 101, 2, 2.0)]


# -- dedup -------------------------------------------------------------------
def test_dedup_ttl_expiry_and_re_emission():
    runs = [ids((1, 0), (1, 0), (2, 50)),     # wm 40; the copy of 1 is a duplicate
            ids((1, 60), (3, 110)),           # 1 dropped; wm 100 = 0 + ttl: 1 forgotten
            ids((1, 130), (2, 115), (4, 100))]  # 1 emitted again; 2 dup; 4 late (== wm)
    result = dedup(runs, ttl_ms=100, lateness_ms=10)
    got = [(tuples(r.emitted), r.late, r.duplicates, r.expired, r.watermark) for r in result.runs]
    assert got == [([(1, 0), (2, 50)], 0, 1, 0, 40),
                   ([(3, 110)], 0, 1, 1, 100),
                   ([(1, 130)], 1, 1, 0, 120)]
    assert tuples(result.state) == [(1, 130), (2, 50), (3, 110)]


def test_dedup_keeps_the_smallest_event_time_inside_a_run_and_ignores_the_repeats_time():
    runs = [ids((7, 5), (7, 3), (8, 9)),
            ids((7, 1))]  # earlier than the remembered first (3) but not late: a duplicate
    result = dedup(runs, ttl_ms=1000, lateness_ms=10)
    assert tuples(result.runs[0].emitted) == [(7, 3), (8, 9)]
    assert (result.runs[1].late, result.runs[1].duplicates) == (0, 1)
    assert result.runs[1].emitted.empty


def test_dedup_state_stays_bounded_by_ttl():
    runs = [ids(*[(i, 100 * i) for i in range(50)])]
    runs += [ids((1000 + k, 5000 + 100 * k)) for k in range(5)]
    result = dedup(runs, ttl_ms=300, lateness_ms=0)
    # wm after the last run = 5400: only ids with first_ts > 5100 may remain.
    assert tuples(result.state) == [(1002, 5200), (1003, 5300), (1004, 5400)]
    assert sum(r.expired for r in result.runs) == 52
