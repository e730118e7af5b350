"""`statebackend.state.watermark`: the event-time watermark of a scheduled job.

The helpers are checked on examples and, over random sequences of runs, against a
reference that recomputes the watermark from scratch before every run (max of every
accepted event time so far, minus the lateness) instead of advancing it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statebackend.errors import UsageError
from statebackend.state.watermark import advance, is_late, late_mask, max_event_time


def test_watermark_advances_never_decreases_and_starts_undefined():
    wm = advance(None, None, 100)
    assert wm is None and not is_late(-(10**12), wm)  # before the first row nothing is late
    wm = advance(wm, 1_000, 100)
    assert wm == 900
    assert advance(wm, 500, 100) == 900  # an older max never moves it back
    assert advance(wm, None, 100) == 900  # a run without rows leaves it
    assert advance(wm, 2_000, 0) == 2_000
    assert is_late(900, 900) and not is_late(901, 900)  # <=, as Flink and Spark
    assert late_mask([899, 900, 901], 900).tolist() == [True, True, False]
    assert late_mask([1, 2], None).tolist() == [False, False]
    assert max_event_time([5, 9, 7]) == 9 and max_event_time([]) is None
    assert max_event_time([5, 9, 7], np.array([True, False, True])) == 7
    assert max_event_time([5, 9], np.array([False, False])) is None


@pytest.mark.parametrize("lateness", [-1, 1.5, True, "10", None])
def test_lateness_must_be_whole_non_negative_ms(lateness):
    with pytest.raises(UsageError, match=f"allowed lateness {lateness!r} must be an integer"):
        advance(None, 1, lateness)


def reference_runs(runs: list[list[int]], lateness: int) -> tuple[list[list[bool]], int | None]:
    """Late flags of every run and the final watermark, recomputed from all accepted rows."""
    accepted: list[int] = []
    flags = []
    for run in runs:
        wm = max(accepted) - lateness if accepted else None
        late = [wm is not None and ts <= wm for ts in run]
        accepted += [ts for ts, is_l in zip(run, late, strict=True) if not is_l]
        flags.append(late)
    return flags, (max(accepted) - lateness if accepted else None)


@settings(max_examples=200, deadline=None)
@given(runs=st.lists(st.lists(st.integers(-10**15, 10**15), max_size=20), max_size=8),
       lateness=st.integers(0, 10**12))
def test_runs_match_the_recomputed_reference(runs, lateness):
    wm, flags = None, []
    for run in runs:
        late = late_mask(run, wm)  # against the watermark at the start of the run
        assert late.tolist() == [is_late(ts, wm) for ts in run]
        flags.append(late.tolist())
        before = wm
        wm = advance(wm, max_event_time(run, ~late), lateness)
        assert before is None or (wm is not None and wm >= before)  # never decreases
    assert (flags, wm) == reference_runs(runs, lateness)
