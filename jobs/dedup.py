"""Dedup: emit the first event of each event id, drop repeats within a TTL of event time.

The job is `JOB`, a `statebackend.job.Job` (only the public job API): input
``event_id`` (int64, the key), ``user`` (string), ``ts`` (event time, int64 epoch
ms), ``value`` (double). The semantics are tests/reference/dedup.py's:

- the watermark is the max event time seen minus the allowed lateness (option
  ``allowed_lateness_minutes``, default 60); rows at or before the watermark at the
  start of a run are quarantined as ``late``;
- inside a run the rows of an id are taken in ``ts`` order: the first one is
  emitted when the id is not remembered, every other row is a duplicate (dropped,
  counted as ``duplicates_dropped`` in the run summary);
- an emitted id is remembered in the value state ``seen`` with an event-time TTL
  (option ``ttl_days``, default 7) written at its own event time ``first_ts``: it
  expires once the watermark reaches ``first_ts + ttl``, and the run's purge removes
  it, so the state holds only the last ``ttl + lateness`` of event time. The stored
  value is the expiry alone (an empty payload: ``first_ts`` is the expiry minus the
  TTL, ``ckpt dump`` shows it in the ``_ttl`` index rows), and one ``insert_absent``
  per batch reads each id once and writes value and index entry together.

Run it as ``ckpt run jobs.dedup:JOB ARGS``, ``python -m jobs.dedup ARGS`` or
``spark-submit jobs/dedup.py ARGS``; in ``ckpt_jobs``: ``job: dedup`` with ``options:``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

if __package__ in (None, ""):  # spark-submit jobs/dedup.py: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

from statebackend.job import (  # noqa: E402
    BatchContext,
    BytesCodec,
    Input,
    Job,
    Option,
    Output,
    StateTtl,
    Vectorized,
    entry_point,
    group_by_key,
    not_null,
    parses,
    value_state,
)

MINUTE_MS = 60_000
DAY_MS = 24 * 60 * MINUTE_MS
SCHEMA = pa.schema([("event_id", pa.int64()), ("user", pa.string()), ("ts", pa.int64()),
                    ("value", pa.float64())])
# The value is the TTL's expiry alone: the payload is empty bytes (the id is the key).
SEEN = value_state("seen", BytesCodec(), ttl=StateTtl(7 * DAY_MS, time="event"))
INPUT = Input(schema=SCHEMA, key="event_id",
              rules=(not_null("event_id"), parses("event_id"), not_null("ts"), parses("ts")),
              event_time="ts", allowed_lateness=60 * MINUTE_MS)


def first_of_each(batch: pa.Table, ctx: BatchContext) -> None:
    """Emit the earliest row of each id not remembered; remember it at its event time."""
    by_time = batch.take(pc.sort_indices(batch, [("ts", "ascending")]))  # stable
    keys, rows, offsets = group_by_key(by_time, "event_id")
    firsts = rows.take(pa.array(offsets[:-1], pa.int64()))
    known = ctx.state("seen").insert_absent(keys, [b""] * len(keys), timestamps=firsts["ts"])
    emitted = firsts.filter(pa.array(~known))
    if emitted.num_rows:
        ctx.emit("events", emitted.set_column(0, "event_id",
                                              pc.cast(emitted["event_id"], pa.int64())))
    ctx.count("duplicates_dropped", batch.num_rows - emitted.num_rows)


def configure(job: Job, options: Mapping[str, Any]) -> Job:
    """The TTL and the allowed lateness come from the options."""
    ttl = StateTtl(options["ttl_days"] * DAY_MS, time="event")
    lateness = options["allowed_lateness_minutes"] * MINUTE_MS
    return replace(job, states=(replace(SEEN, ttl=ttl),),
                   input=replace(job.input, allowed_lateness=lateness))


JOB = Job(
    name="dedup", input=INPUT, states=(SEEN,), outputs=(Output("events", SCHEMA),),
    logic=Vectorized(first_of_each),
    options=(Option("ttl_days", int, 7, "days of event time an event id is remembered"),
             Option("allowed_lateness_minutes", int, 60,
                    "event-time lateness a row may have and still count")),
    # ZSTD: each run's new SSTs (ids and index entries, mostly incompressible digits
    # under Snappy) are ~30% smaller, for no measurable CPU at this size.
    compression="zstd",
    configure=configure)


main = entry_point("jobs.dedup:JOB")

if __name__ == "__main__":
    sys.exit(main())
