"""Sessionization: per user, sessions separated by an inactivity gap on event time.

The job is `JOB`, a `statebackend.job.Job` (only the public job API): input
``user`` (string), ``ts`` (event time, int64 epoch ms), ``value`` (double). The
semantics are tests/reference/sessions.py's:

- the watermark is the max event time seen minus the allowed lateness (option
  ``allowed_lateness_minutes``, default 60); rows at or before the watermark at the
  start of a run are quarantined as ``late``;
- a user's accepted events form sessions: consecutive events ``>= gap`` apart
  (option ``gap_minutes``, default 30) are in different sessions; the open sessions
  of a user are one value state ``sessions`` (``[[start, end, events, value_sum],
  ...]`` sorted by start), so a late event within the allowed lateness joins the
  session it falls into and may merge two;
- one event-time timer per user, at the earliest ``end + gap`` of its open
  sessions; when the watermark reaches it, the handler emits every session with
  ``end + gap <= watermark`` (one row: user, session_start, session_end, events,
  value_sum) and moves the timer to the next one.

Run it as ``ckpt run jobs.sessionization:JOB ARGS``, ``python -m jobs.sessionization
ARGS`` or ``spark-submit jobs/sessionization.py ARGS`` (``ckpt run``'s arguments with
``--storage``); in ``ckpt_jobs``: ``job: sessionization`` with ``options:``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

if __package__ in (None, ""):  # spark-submit jobs/sessionization.py: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from statebackend.job import (  # noqa: E402
    BatchContext,
    Input,
    Job,
    Option,
    Output,
    Vectorized,
    entry_point,
    group_by_key,
    not_empty,
    not_null,
    parses,
    value_state,
)

MINUTE_MS = 60_000
SESSIONS = value_state("sessions")  # JSON: [[start, end, events, value_sum], ...]
OUTPUT_SCHEMA = pa.schema([("user", pa.string()), ("session_start", pa.int64()),
                           ("session_end", pa.int64()), ("events", pa.int64()),
                           ("value_sum", pa.float64())])
INPUT = Input(
    schema=pa.schema([("user", pa.string()), ("ts", pa.int64()), ("value", pa.float64())]),
    key="user",
    rules=(not_null("user"), not_empty("user"), not_null("ts"), parses("ts"),
           not_null("value"), parses("value")),
    event_time="ts", allowed_lateness=60 * MINUTE_MS)


def merge_sessions(sessions: list, ts: np.ndarray, values: np.ndarray, gap: int) -> list:
    """Open sessions + events -> open sessions (an interval merge, as the reference).

    Every event is a one-event session; sorted by start, an interval starts a new
    session when it begins ``>= gap`` after the furthest end so far.
    """
    items = [tuple(s) for s in sessions] + [(int(t), int(t), 1, float(v))
                                            for t, v in zip(ts, values, strict=True)]
    items.sort(key=lambda s: s[0])
    out: list[list] = []
    for start, end, n, total in items:
        if out and start - out[-1][1] < gap:
            cur = out[-1]
            cur[1] = max(cur[1], end)
            cur[2] += n
            cur[3] += total
        else:
            out.append([start, end, n, total])
    return out


def _next_timer(sessions: list | None, gap: int) -> int | None:
    return min(s[1] for s in sessions) + gap if sessions else None


def assign(batch: pa.Table, ctx: BatchContext) -> None:
    """Merge each user's events into its open sessions; keep its timer at the next close."""
    gap = ctx.options["gap_minutes"] * MINUTE_MS
    keys, rows, offsets = group_by_key(batch, "user")
    ts = rows["ts"].to_numpy()
    values = rows["value"].to_numpy()
    state = ctx.state("sessions")
    old = state.value(keys)
    merged, drop_k, drop_t, add_k, add_t = [], [], [], [], []
    for i, k in enumerate(keys):
        lo, hi = offsets[i], offsets[i + 1]
        new = merge_sessions(old[i] or [], ts[lo:hi], values[lo:hi], gap)
        merged.append(new)
        before, after = _next_timer(old[i], gap), _next_timer(new, gap)
        if before != after:
            if before is not None:
                drop_k.append(k)
                drop_t.append(before)
            add_k.append(k)
            add_t.append(after)
    state.update(keys, merged)
    if drop_k:
        ctx.timers.delete(drop_k, drop_t)
    if add_k:
        ctx.timers.register(add_k, add_t)


def close(timers: pa.Table, ctx: BatchContext) -> None:
    """Emit the sessions the watermark closed; move each user's timer to its next close."""
    gap = ctx.options["gap_minutes"] * MINUTE_MS
    wm = ctx.new_watermark
    keys = list(dict.fromkeys(timers["key"].to_pylist()))
    state = ctx.state("sessions")
    out: dict[str, list] = {n: [] for n in OUTPUT_SCHEMA.names}
    keep_k, keep_v, gone, add_k, add_t = [], [], [], [], []
    for k, sessions in zip(keys, state.value(keys), strict=True):
        if not sessions:
            continue
        remaining = []
        for s in sessions:
            if s[1] + gap <= wm:
                for name, v in zip(OUTPUT_SCHEMA.names, (k, *s), strict=True):
                    out[name].append(v)
            else:
                remaining.append(s)
        if remaining:
            keep_k.append(k)
            keep_v.append(remaining)
            add_k.append(k)
            add_t.append(_next_timer(remaining, gap))
        else:
            gone.append(k)
    if keep_k:
        state.update(keep_k, keep_v)
    if gone:
        state.clear(gone)
    if add_k:
        ctx.timers.register(add_k, add_t)
    if out["user"]:
        ctx.emit("sessions", out)


def configure(job: Job, options: Mapping[str, Any]) -> Job:
    """The allowed lateness comes from the option ``allowed_lateness_minutes``."""
    lateness = options["allowed_lateness_minutes"] * MINUTE_MS
    return replace(job, input=replace(job.input, allowed_lateness=lateness))


JOB = Job(
    name="sessionization", input=INPUT, states=(SESSIONS,),
    outputs=(Output("sessions", OUTPUT_SCHEMA),), logic=Vectorized(assign),
    on_timer=Vectorized(close),
    options=(Option("gap_minutes", int, 30, "inactivity gap that ends a session"),
             Option("allowed_lateness_minutes", int, 60,
                    "event-time lateness a row may have and still count")),
    configure=configure)


main = entry_point("jobs.sessionization:JOB")

if __name__ == "__main__":
    sys.exit(main())
