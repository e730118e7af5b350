"""Cost per state operation: the job API's per-key form against its vectorized form.

Same logic both ways, on one subtask's backend, no Spark: per key a value state
holding (count, sum) is read and written once per batch (2 state operations per
key and batch), plus, in a second pair, a map state of counts per category.
Prints microseconds per state operation and the ratio; figures, not assertions.

    PYTHONPATH=. .venv/bin/python bench/bench_job_api.py [--rows 100000] [--keys 10000]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.job import (
    Input,
    Job,
    PerKey,
    Vectorized,
    map_state,
    process,
    record,
    value_state,
)
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange

M = 128
INPUT = Input(pa.schema([("key", pa.string()), ("value", pa.float64()),
                         ("category", pa.string())]), key="key")
TOTALS = record(count="int64", sum="float64")


def per_key_totals(key, rows, state):
    totals = state["totals"]
    old = totals.get()
    values = rows["value"].to_numpy()
    if old is None:
        totals.update({"count": len(values), "sum": float(values.sum())})
    else:
        totals.update({"count": old["count"] + len(values), "sum": old["sum"] + values.sum()})


def vectorized_totals(batch, ctx):
    g = batch.group_by("key", use_threads=False).aggregate([("value", "count"),
                                                            ("value", "sum")])
    keys = g["key"]
    totals = ctx.state("totals")
    _, old = totals.value_columns(keys)
    totals.update_columns(keys, {"count": old["count"] + g["value_count"].to_numpy(),
                                 "sum": old["sum"] + g["value_sum"].to_numpy()})


def per_key_categories(key, rows, state):
    counts = state["counts"]
    vc = pc.value_counts(rows["category"])
    for cat, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist(),
                      strict=True):
        counts.put(cat, counts.get(cat, 0) + n)


def vectorized_categories(batch, ctx):
    g = batch.group_by(["key", "category"], use_threads=False).aggregate(
        [("category", "count")])
    keys, cats = g["key"].to_pylist(), g["category"].to_pylist()
    counts = ctx.state("counts")
    old = counts.get(keys, cats)
    counts.put(keys, cats, [(o or 0) + n for o, n in zip(old, g["category_count"].to_pylist(),
                                                          strict=True)])


def make_batches(rows: int, keys: int, batch_rows: int, seed: int = 1) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    k = rng.integers(0, keys, rows)
    table = pa.table({"key": pa.array([f"user{i}" for i in k]),
                      "value": rng.random(rows),
                      "category": pa.array([f"c{i}" for i in rng.integers(0, 5, rows)])})
    return [table.slice(i, batch_rows) for i in range(0, rows, batch_rows)]


def state_ops(batches: list[pa.Table], by: list[str]) -> int:
    """Logical state operations: one read and one write per distinct ``by`` per batch."""
    return sum(2 * b.group_by(by).aggregate([]).num_rows for b in batches)


def time_job(job: Job, batches: list[pa.Table], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as d:
            with KeyedStateBackend(d, job.states, M, KeyGroupRange(0, M - 1)) as backend:
                started = time.perf_counter()
                process(job, backend, batches)
                best = min(best, time.perf_counter() - started)
    return best


def compare(title: str, per_key: Job, vectorized: Job, batches: list[pa.Table],
            by: list[str], repeat: int) -> None:
    ops = state_ops(batches, by)
    t_pk = time_job(per_key, batches, repeat)
    t_vec = time_job(vectorized, batches, repeat)
    rows = sum(b.num_rows for b in batches)
    print(f"{title}: {rows:,} rows, {ops:,} state operations")
    print(f"  per-key    {t_pk:7.3f} s  {t_pk / ops * 1e6:6.2f} us/op  {rows / t_pk:12,.0f} rows/s")
    print(f"  vectorized {t_vec:7.3f} s  {t_vec / ops * 1e6:6.2f} us/op  "
          f"{rows / t_vec:12,.0f} rows/s")
    print(f"  per-key / vectorized = {t_pk / t_vec:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--batch-rows", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    batches = make_batches(args.rows, args.keys, args.batch_rows)
    totals = (value_state("totals", TOTALS),)
    compare("value state (record codec), per key: get + update",
            Job(name="pk", input=INPUT, states=totals, logic=PerKey(per_key_totals)),
            Job(name="vec", input=INPUT, states=totals, logic=Vectorized(vectorized_totals)),
            batches, ["key"], args.repeat)
    counts = (map_state("counts"),)
    compare("map state (json codec), per (key, category): get + put",
            Job(name="pk", input=INPUT, states=counts, logic=PerKey(per_key_categories)),
            Job(name="vec", input=INPUT, states=counts,
                logic=Vectorized(vectorized_categories)),
            batches, ["key", "category"], args.repeat)


if __name__ == "__main__":
    main()
