"""Reference sessionization over scheduled runs (pandas): the semantics of the job.

Input: a list of runs (one per scheduled batch, e.g. a day), each a DataFrame with
``user``, ``ts`` (event time, epoch milliseconds, int64) and ``value`` (float64).
Options: ``gap_ms`` (inactivity gap, default 30 min) and ``lateness_ms`` (allowed
lateness, default 1 h).

Semantics, per run k (runs processed in order, each as one unit):

1. Watermark. ``wm(k) = max event time of all accepted rows of runs 0..k - lateness``
   (after run k). Before the first row ever the watermark is undefined (``None``) and
   nothing is late. It never decreases (a max never does). A run with no rows leaves
   it unchanged.
2. Late rows. A row of run k with ``ts <= wm(k-1)`` (the watermark at the *start* of
   the run) is late: dropped and counted. ``<=`` as in Flink and Spark (a watermark W
   says "no more rows at or before W"). Rows inside a run are never late relative to
   each other: the watermark moves only between runs.
3. Sessions. Per user, the accepted events (of all runs, minus the sessions already
   closed) are split wherever two consecutive events (sorted by ts) are ``>= gap_ms``
   apart: events exactly ``gap_ms`` apart are in *different* sessions, as in Spark's
   ``session_window`` (each event opens ``[ts, ts + gap)``; half-open windows that only
   touch do not overlap). Hence a late-but-allowed event joins the session it falls
   into and may bridge (merge) two open sessions.
4. Closing. A session with last event ``end`` is closed and emitted in the first run
   whose end-of-run watermark reaches ``end + gap_ms`` (``wm(k) >= end + gap``; an
   event-time timer at ``end + gap`` fires when the watermark is at or past it, like
   Flink's and Spark's event-time timers). It is emitted once, never reopened: any
   later accepted event has ``ts > wm >= end + gap``, so it cannot join it.
5. Output row per closed session: ``user, session_start, session_end, events,
   value_sum`` (start/end = first/last event time). The sessions still open after
   the last run are the state.

The Spark peer (`bench/peers/spark_sessionization.py`) implements the same rules
with ``transformWithStateInPandas`` and reproduces these outputs run by run (see its
docstring for the Spark specifics).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

DEFAULT_GAP_MS = 30 * 60 * 1000
DEFAULT_LATENESS_MS = 60 * 60 * 1000
SESSION_COLUMNS = ["user", "session_start", "session_end", "events", "value_sum"]


@dataclass(frozen=True)
class SessionRun:
    """What one run emits: the sessions it closed, its late rows, its end watermark."""

    emitted: pd.DataFrame
    late: int
    accepted: int
    watermark: int | None


@dataclass(frozen=True)
class SessionsResult:
    runs: list[SessionRun]
    open_sessions: pd.DataFrame  # the state after the last run (same columns as output)


def empty_sessions() -> pd.DataFrame:
    return pd.DataFrame({"user": pd.Series(dtype=object),
                         "session_start": pd.Series(dtype="int64"),
                         "session_end": pd.Series(dtype="int64"),
                         "events": pd.Series(dtype="int64"),
                         "value_sum": pd.Series(dtype="float64")})


def canonical(df: pd.DataFrame) -> pd.DataFrame:
    """Sessions in a stable order with plain dtypes, for comparisons."""
    out = df[SESSION_COLUMNS].astype({"user": object, "session_start": "int64",
                                      "session_end": "int64", "events": "int64",
                                      "value_sum": "float64"})
    return out.sort_values(["user", "session_start"], kind="stable").reset_index(drop=True)


def merge_into_sessions(open_sessions: pd.DataFrame, events: pd.DataFrame,
                        gap_ms: int) -> pd.DataFrame:
    """Open sessions + new events -> open sessions (interval merge, vectorized per user).

    Every event is a one-event session; sorted by start per user, an interval starts a
    new session when it begins ``>= gap`` after the furthest end seen so far.
    """
    singles = pd.DataFrame({"user": events["user"].astype(object),
                            "session_start": events["ts"].astype("int64"),
                            "session_end": events["ts"].astype("int64"),
                            "events": 1, "value_sum": events["value"].astype("float64")})
    both = pd.concat([open_sessions, singles], ignore_index=True) if len(open_sessions) else singles
    if both.empty:
        return empty_sessions()
    both = both.sort_values(["user", "session_start"], kind="stable").reset_index(drop=True)
    reach = both.groupby("user", sort=False)["session_end"].cummax()
    prev_reach = reach.groupby(both["user"], sort=False).shift(1)
    new_session = prev_reach.isna() | (both["session_start"] - prev_reach >= gap_ms)
    both["sid"] = new_session.cumsum()
    merged = both.groupby("sid", sort=True).agg(
        user=("user", "first"), session_start=("session_start", "min"),
        session_end=("session_end", "max"), events=("events", "sum"),
        value_sum=("value_sum", "sum"))
    return merged.reset_index(drop=True)[SESSION_COLUMNS]


def sessionize(runs: Sequence[pd.DataFrame], gap_ms: int = DEFAULT_GAP_MS,
               lateness_ms: int = DEFAULT_LATENESS_MS) -> SessionsResult:
    """Apply the module's semantics run by run; emitted sessions per run + open state."""
    open_sessions = empty_sessions()
    watermark: int | None = None
    max_ts: int | None = None
    out: list[SessionRun] = []
    for batch in runs:
        late_mask = (batch["ts"] <= watermark) if watermark is not None else \
            pd.Series(False, index=batch.index)
        accepted = batch[~late_mask]
        if len(accepted):
            run_max = int(accepted["ts"].max())
            max_ts = run_max if max_ts is None else max(max_ts, run_max)
            watermark = max_ts - lateness_ms
        open_sessions = merge_into_sessions(open_sessions, accepted, gap_ms)
        closing = (open_sessions["session_end"] + gap_ms <= watermark) if watermark is not None \
            else pd.Series(False, index=open_sessions.index)
        out.append(SessionRun(emitted=canonical(open_sessions[closing]),
                              late=int(late_mask.sum()), accepted=len(accepted),
                              watermark=watermark))
        open_sessions = open_sessions[~closing].reset_index(drop=True)
    return SessionsResult(runs=out, open_sessions=canonical(open_sessions))
