"""Event-time watermark of a scheduled job (the semantics of tests/reference/sessions.py).

- ``watermark = max event time of every accepted row so far - allowed lateness``,
  in epoch ms; ``None`` before the first row (then nothing is late). It never
  decreases, and a run without rows leaves it unchanged (`advance`).
- It moves only between runs: a row of a run is *late* iff ``ts <= watermark at the
  start of the run`` (`is_late`, `late_mask`); ``<=`` as in Flink and Spark (a
  watermark W says "no more rows at or before W"). Rows of one run are never late
  relative to each other.
- The watermark after a run is stored in the checkpoint's ``_metadata``
  (``watermark``); event-time timers at or before it fire at the end of the run and
  event-time TTL entries with ``expiry <= watermark`` are gone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from statebackend.errors import UsageError


def advance(current: int | None, max_event_time: int | None, lateness_ms: int) -> int | None:
    """The watermark after a run whose accepted rows have ``max_event_time`` (None: no rows)."""
    if isinstance(lateness_ms, bool) or not isinstance(lateness_ms, int) or lateness_ms < 0:
        raise UsageError(f"allowed lateness {lateness_ms!r} must be an integer of ms >= 0")
    if max_event_time is None:
        return current
    candidate = int(max_event_time) - lateness_ms
    return candidate if current is None else max(current, candidate)


def is_late(ts: int, watermark: int | None) -> bool:
    """Whether a row with event time ``ts`` is late against the run's starting watermark."""
    return watermark is not None and ts <= watermark


def late_mask(ts: Sequence[int] | np.ndarray, watermark: int | None) -> np.ndarray:
    """Vectorised `is_late` over a batch of event times (int64 epoch ms)."""
    arr = np.asarray(ts, dtype=np.int64)
    if watermark is None:
        return np.zeros(len(arr), dtype=bool)
    return arr <= np.int64(watermark)


def max_event_time(ts: Sequence[int] | np.ndarray, accepted: np.ndarray | None = None
                   ) -> int | None:
    """Max of the accepted event times of a batch (None if none): feed it to `advance`."""
    arr = np.asarray(ts, dtype=np.int64)
    if accepted is not None:
        arr = arr[accepted]
    return int(arr.max()) if len(arr) else None
