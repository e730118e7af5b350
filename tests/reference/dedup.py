"""Reference dedup over scheduled runs (pandas): the semantics of the job.

Input: a list of runs, each a DataFrame with ``event_id`` (int64 or str) and ``ts``
(event time, epoch ms) plus any payload columns (kept as they are). Options:
``ttl_ms`` (how long an id is remembered, default 7 days of event time) and
``lateness_ms`` (allowed lateness, default 1 h).

Semantics, per run k (runs processed in order, each as one unit):

1. Watermark and late rows: as in the sessionization reference. ``wm(k)`` = max
   accepted event time up to run k - lateness; a row with ``ts <= wm(k-1)`` is late,
   dropped and counted, before dedup looks at it.
2. First occurrence. Inside a run the accepted rows are ordered by ``(ts, input
   order)``. A row whose id is neither remembered (state) nor seen earlier in this
   order is emitted and its id is remembered with ``first_ts`` = its event time. Every
   other row is a duplicate: dropped and counted. A duplicate's own event time plays
   no role (a repeat with an earlier ts than the remembered first is still a drop).
3. TTL, measured against the watermark: at the end of run k, after its rows, every
   remembered id with ``first_ts + ttl <= wm(k)`` is forgotten (counted as expired).
   So an id is remembered at least until the watermark is ``ttl`` past its first
   occurrence; a repeat arriving after that (and not late) is emitted again and
   remembered anew. State is bounded: it holds only ids with
   ``first_ts > wm - ttl``, i.e. the last ``ttl + lateness`` of event time.
   Expiry happens only at run ends, so inside one run an id is never both dropped
   and re-emitted.

Same as Spark's ``dropDuplicatesWithinWatermark`` (checked in the 4.3 bytecode of
``StreamingDeduplicateWithinWatermarkExec``: state value = ``ts + delay``, an entry is
evicted once ``watermark >= ts + delay``; late rows are filtered before it), with two
differences:

- Spark has ONE duration: the ``withWatermark`` delay is both the allowed lateness
  and the TTL. Our job has two options; they agree with Spark when
  ``lateness_ms == ttl_ms``.
- Spark keeps the first row of an id *in arrival order* inside a micro-batch, which
  is not defined when one batch holds several rows of an id with different payloads
  or event times. Ours keeps the smallest ``ts`` (then input order). They agree when
  the rows of one id inside one run are exact copies (at-least-once redelivery).

Also different in cost, not in result: Spark scans the whole dedup state to evict
in every batch; ours expires through a time index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

DEFAULT_TTL_MS = 7 * 24 * 60 * 60 * 1000
DEFAULT_LATENESS_MS = 60 * 60 * 1000


@dataclass(frozen=True)
class DedupRun:
    emitted: pd.DataFrame  # the emitted rows, sorted by (event_id, ts)
    late: int
    duplicates: int
    expired: int  # ids forgotten at the end of the run
    watermark: int | None


@dataclass(frozen=True)
class DedupResult:
    runs: list[DedupRun]
    state: pd.DataFrame  # remembered ids after the last run: event_id, first_ts


def canonical(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in a stable order (event_id, ts, then the other columns), for comparisons."""
    others = [c for c in df.columns if c not in ("event_id", "ts")]
    return df[["event_id", "ts", *others]].sort_values(["event_id", "ts", *others],
                                                       kind="stable").reset_index(drop=True)


def dedup(runs: Sequence[pd.DataFrame], ttl_ms: int = DEFAULT_TTL_MS,
          lateness_ms: int = DEFAULT_LATENESS_MS) -> DedupResult:
    """Apply the module's semantics run by run; emitted rows per run + remembered ids."""
    remembered: dict = {}  # event_id -> first_ts
    watermark: int | None = None
    max_ts: int | None = None
    out: list[DedupRun] = []
    for batch in runs:
        late_mask = (batch["ts"] <= watermark) if watermark is not None else \
            pd.Series(False, index=batch.index)
        accepted = batch[~late_mask].sort_values("ts", kind="stable")
        known = accepted["event_id"].isin(list(remembered)) if remembered else \
            pd.Series(False, index=accepted.index)
        first = ~known & ~accepted["event_id"].duplicated(keep="first")
        emitted = accepted[first]
        remembered.update(zip(emitted["event_id"].tolist(),
                              emitted["ts"].astype("int64").tolist(), strict=True))
        if len(accepted):
            run_max = int(accepted["ts"].max())
            max_ts = run_max if max_ts is None else max(max_ts, run_max)
            watermark = max_ts - lateness_ms
        expired = [i for i, f in remembered.items()
                   if watermark is not None and f + ttl_ms <= watermark]
        for i in expired:
            del remembered[i]
        out.append(DedupRun(emitted=canonical(emitted), late=int(late_mask.sum()),
                            duplicates=int(len(accepted) - len(emitted)), expired=len(expired),
                            watermark=watermark))
    state = pd.DataFrame({"event_id": list(remembered), "first_ts": list(remembered.values())})
    return DedupResult(runs=out, state=state.sort_values("event_id").reset_index(drop=True))
