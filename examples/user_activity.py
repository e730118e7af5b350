"""Example job: per-user activity, written as a user would (outside `jobs/`).

Input rows ``(user, ts, category)``. Per user it keeps two states:

- ``last_seen`` (value state): the latest event's ``ts`` and ``category``
  (on equal ``ts`` the later row wins);
- ``counts`` (map state): number of events per category.

Each run outputs one ``activity`` row per user seen in the run, with the user's
totals at the end of the run. The job is written twice, with the same result:
`job` in the per-key form (the one docs/write-a-job.md shows: one call per user and
run) and `job_vectorized` in the vectorized form (one call per batch of many users).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.job import (
    BatchContext,
    Input,
    Job,
    KeyContext,
    Option,
    Output,
    PerKey,
    Vectorized,
    map_state,
    not_empty,
    not_null,
    parses,
    value_state,
)

INPUT = Input(
    schema=pa.schema([("user", pa.string()), ("ts", pa.int64()), ("category", pa.string())]),
    key="user",
    rules=(not_null("user"), not_empty("user"), not_null("ts"), parses("ts"),
           not_null("category")),
)
ACTIVITY = Output(
    "activity",
    pa.schema([("user", pa.string()), ("last_ts", pa.int64()), ("last_category", pa.string()),
               ("category_events", pa.int64()), ("categories", pa.int64())]),
    last_per="user",  # the vectorized form emits per batch: keep each user's newest row
)
STATES = (value_state("last_seen"), map_state("counts"))
OPTIONS = (Option("normalize_case", bool, True, "count categories case-insensitively"),)


def counts_checks(descriptor):
    """Validation: every stored count is at least 1."""
    import great_expectations.expectations as gxe

    return [gxe.ExpectColumnValuesToBeBetween(
        column="value", min_value=1, meta={"check": "counts_at_least_1", "critical": True})]


# -- per-key form ----------------------------------------------------------------------
def handle_rows(user: str, rows: pa.Table, state: KeyContext) -> list[dict]:
    """Called once per user and run with all of the user's rows of the run."""
    categories = rows["category"]
    if state.options["normalize_case"]:
        categories = pc.utf8_lower(categories)
    ts = rows["ts"].to_numpy()
    i = len(ts) - 1 - int(np.argmax(ts[::-1]))  # the latest ts, the last row on ties

    last_seen = state["last_seen"]
    seen = last_seen.value()
    if seen is None or ts[i] >= seen["ts"]:
        seen = {"ts": int(ts[i]), "category": categories[i].as_py()}
        last_seen.update(seen)

    counts = state["counts"]
    per_category = pc.value_counts(categories)
    for category, n in zip(per_category.field("values").to_pylist(),
                            per_category.field("counts").to_pylist(), strict=True):
        counts.put(category, counts.get(category, 0) + n)

    return [{"user": user, "last_ts": seen["ts"], "last_category": seen["category"],
             "category_events": counts.get(seen["category"]),
             "categories": len(counts.keys())}]


job = Job(name="user_activity", input=INPUT, states=STATES, outputs=(ACTIVITY,),
          logic=PerKey(handle_rows), options=OPTIONS, expectations={"counts": counts_checks})


# -- vectorized form -------------------------------------------------------------------
def process_batch(batch: pa.Table, ctx: BatchContext) -> None:
    """Called once per batch of many users; every state call takes a column of keys."""
    if ctx.options["normalize_case"]:
        batch = batch.set_column(batch.schema.get_field_index("category"), "category",
                                 pc.utf8_lower(batch["category"]))
    # The last row per user after a stable sort by (user, ts) is its latest event.
    order = pc.sort_indices(batch, [("user", "ascending"), ("ts", "ascending")])
    rows = batch.take(order)
    users = rows["user"].combine_chunks()
    is_last = pc.not_equal(users[:-1], users[1:]) if len(users) > 1 else pa.array([], pa.bool_())
    latest = rows.filter(pa.concat_arrays([is_last, pa.array([True])]))
    keys = latest["user"].to_pylist()

    last_seen = ctx.state("last_seen")
    new_seen = [
        old if old is not None and ts < old["ts"] else {"ts": ts, "category": category}
        for old, ts, category in zip(last_seen.value(keys), latest["ts"].to_pylist(),
                                     latest["category"].to_pylist(), strict=True)]
    last_seen.update(keys, new_seen)

    counts = ctx.state("counts")
    per_pair = batch.group_by(["user", "category"], use_threads=False).aggregate(
        [("ts", "count")])
    pair_users = per_pair["user"].to_pylist()
    pair_categories = per_pair["category"].to_pylist()
    old = counts.get(pair_users, pair_categories)
    counts.put(pair_users, pair_categories,
               [(o or 0) + n for o, n in zip(old, per_pair["ts_count"].to_pylist(),
                                              strict=True)])

    last_categories = [s["category"] for s in new_seen]
    ctx.emit("activity", {
        "user": keys,
        "last_ts": [s["ts"] for s in new_seen],
        "last_category": last_categories,
        "category_events": counts.get(keys, last_categories),
        "categories": [len(m) for m in counts.items(keys)],
    })


job_vectorized = Job(name="user_activity", input=INPUT, states=STATES, outputs=(ACTIVITY,),
                     logic=Vectorized(process_batch), options=OPTIONS,
                     expectations={"counts": counts_checks})
