"""Spark 4.3 peer of our sessionization job: ``transformWithStateInPandas`` + event-time timers.

Semantics: exactly tests/reference/sessions.py (gap split at ``>= gap``, late iff
``ts <= watermark at run start``, a session closes once ``watermark >= end + gap``).
Spark pieces and why they give those semantics:

- ``withWatermark(event_time, lateness)`` with ``event_time = timestamp_millis(ts)``:
  watermark = max event time - lateness. The TWS operator drops rows with
  ``event_time <= watermark`` (counted as ``numRowsDroppedByWatermark``); in the
  run's data batch that watermark is the previous run's.
- ``groupBy(user).transformWithStateInPandas(..., timeMode="EventTime",
  outputMode="Append")``; per user a ListState ``sessions`` (start, end, events,
  value_sum) holds the open sessions, and one event-time timer per open session at
  ``end + gap``. ``handleInputRows`` merges the new events into the open sessions and
  moves the timers of the sessions whose end changed (delete old, register new).
- Timers fire when ``timer <= watermark`` (``TimerStateImpl.getExpiredTimers``,
  checked in the 4.3 bytecode); ``handleExpiredTimer`` emits the session that ends
  at ``expiry - gap`` and drops it from the list.
- The watermark advanced by a run's data is applied in the no-data batch that
  ``availableNow`` runs before stopping, so the sessions are emitted in the same run
  as the reference says.

Every state call is a round trip from the Python worker to the JVM state server;
that is what the bench measures against our in-process state.

    python -m bench.peers.spark_sessionization --day DIR [--day DIR ...] --work DIR [--start-run K]
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pandas as pd

from bench.peers import RunStats, peer_main, run_days

DEFAULT_GAP_MS = 30 * 60 * 1000
DEFAULT_LATENESS_MS = 60 * 60 * 1000
OUTPUT_DDL = ("user STRING, session_start LONG, session_end LONG, events LONG, "
              "value_sum DOUBLE")
SESSION_DDL = "start LONG, end LONG, events LONG, value_sum DOUBLE"


def merge_sessions(sessions: list[tuple], events: pd.DataFrame, gap_ms: int) -> list[tuple]:
    """Open sessions (start, end, events, sum) + new events -> open sessions, sorted by start.

    A per-key loop (the peer's own code, not the reference's vectorized merge): walk
    the intervals by start; join while the next begins < gap after the current end.
    """
    items = [(int(s), int(e), int(n), float(v)) for s, e, n, v in sessions]
    items += [(t, t, 1, v) for t, v in zip(events["ts"].tolist(), events["value"].tolist(),
                                           strict=True)]
    items.sort(key=lambda x: x[0])
    merged: list[list] = []
    for start, end, n, total in items:
        if merged and start - merged[-1][1] < gap_ms:
            cur = merged[-1]
            cur[1], cur[2], cur[3] = max(cur[1], end), cur[2] + n, cur[3] + total
        else:
            merged.append([start, end, n, total])
    return [tuple(m) for m in merged]


def _processor_class():
    from pyspark.sql.streaming import StatefulProcessor

    class SessionProcessor(StatefulProcessor):
        def __init__(self, gap_ms: int) -> None:
            self.gap_ms = gap_ms

        def init(self, handle) -> None:
            self.handle = handle
            self.sessions = handle.getListState("sessions", SESSION_DDL)

        def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
            events = pd.concat(list(rows), ignore_index=True)
            old = list(self.sessions.get()) if self.sessions.exists() else []
            new = merge_sessions(old, events, self.gap_ms)
            old_timers = {int(s[1]) + self.gap_ms for s in old}
            new_timers = {s[1] + self.gap_ms for s in new}
            for t in old_timers - new_timers:
                self.handle.deleteTimer(t)
            self.sessions.put(new)
            for t in new_timers - old_timers:
                self.handle.registerTimer(t)
            yield from ()

        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
            end = expiredTimerInfo.getExpiryTimeInMs() - self.gap_ms
            sessions = list(self.sessions.get()) if self.sessions.exists() else []
            closing = [s for s in sessions if int(s[1]) == end]
            rest = [s for s in sessions if int(s[1]) != end]
            if rest:
                self.sessions.put(rest)
            else:
                self.sessions.clear()
            if closing:
                yield pd.DataFrame({"user": [key[0]] * len(closing),
                                    "session_start": [int(s[0]) for s in closing],
                                    "session_end": [int(s[1]) for s in closing],
                                    "events": [int(s[2]) for s in closing],
                                    "value_sum": [float(s[3]) for s in closing]})

        def close(self) -> None:
            pass

    return SessionProcessor


def build(gap_ms: int, lateness_ms: int):
    """The streaming plan applied to the source DataFrame."""
    from pyspark.sql import functions as F

    processor = _processor_class()(gap_ms)

    def plan(source):
        return (source.select("user", "ts", "value")
                .withColumn("event_time", F.timestamp_millis("ts"))
                .withWatermark("event_time", f"{lateness_ms} milliseconds")
                .groupBy("user")
                .transformWithStateInPandas(processor, OUTPUT_DDL, "Append", "EventTime"))

    return plan


def run_batches(spark, input_dirs: list[str], checkpoint_dir: str, output_dir: str,
                gap_ms: int = DEFAULT_GAP_MS, lateness_ms: int = DEFAULT_LATENESS_MS,
                **run: Any) -> list[RunStats]:
    """One availableNow query start per input dir (a daily batch), same checkpoint;
    ``run``: `bench.peers.run_days`'s options."""
    return run_days(spark, build(gap_ms, lateness_ms), input_dirs, checkpoint_dir, output_dir,
                    **run)


def main(argv: list[str] | None = None) -> int:
    """New process per run (`bench.peers.peer_main`)."""
    return peer_main(argv, __doc__, "spark-sessionization-peer", run_batches,
                     {"gap_ms": DEFAULT_GAP_MS, "lateness_ms": DEFAULT_LATENESS_MS})


if __name__ == "__main__":
    sys.exit(main())
