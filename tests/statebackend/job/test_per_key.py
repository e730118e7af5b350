"""The per-key form calls each key once per run, whatever the batches: the processor in
process, fed batches as the engines feed them (sorted by key, cut anywhere), against a
pandas reference of each key's rows."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from statebackend.errors import UsageError
from statebackend.job import (
    Input,
    Job,
    KeyContext,
    Output,
    PerKey,
    StateTtl,
    SubtaskProcessor,
    Vectorized,
    not_null,
    process,
    value_state,
)
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange

M = 128
SCHEMA = pa.schema([("k", pa.string()), ("ts", pa.int64()), ("v", pa.int64())])
SEEN = Output("seen", pa.schema([("k", pa.string()), ("rows", pa.list_(pa.int64())),
                                 ("total", pa.int64())]))


def record_rows(key: str, rows: pa.Table, state: KeyContext) -> dict:
    """Emits the key's rows (their ``v``) and keeps a running total with a TTL."""
    state.count("calls")
    total = state["total"].value(0) + len(rows)
    state["total"].update(total)
    return {"k": [key], "rows": [rows["v"].to_pylist()], "total": [total]}


def job(**inp) -> Job:
    return Job(name="pk", input=Input(SCHEMA, "k", rules=(not_null("v"),), **inp),
               states=(value_state("total", ttl=StateTtl(1_000, "processing")),),
               outputs=(SEEN,), logic=PerKey(record_rows))


def open_backend(path, j: Job) -> KeyedStateBackend:
    return KeyedStateBackend(str(path), j.descriptors, M, KeyGroupRange(0, M - 1))


def sorted_rows(rng, n: int, keys: int, big: int) -> pd.DataFrame:
    """``n`` rows over ``keys`` keys plus ``big`` rows of key "k000" (spans batches), some
    ``v`` null (rejected), sorted by key like the engines' rows; ``v`` numbers the rows."""
    k = np.concatenate([rng.integers(0, keys, n), np.zeros(big, dtype=np.int64)])
    df = pd.DataFrame({"k": [f"k{i:03d}" for i in k], "ts": rng.integers(0, 100, len(k))})
    df["v"] = pd.array(np.arange(len(df)), dtype="Int64")
    df.loc[rng.random(len(df)) < 0.02, "v"] = None
    return df.sort_values("k", kind="stable").reset_index(drop=True)


def cut(df: pd.DataFrame, rng, pieces: int) -> list[pa.Table]:
    """The rows in batches cut at random places (some batches hold one key only)."""
    table = pa.Table.from_pandas(df, schema=SCHEMA, preserve_index=False)
    edges = sorted(set(rng.integers(1, len(df), pieces - 1).tolist()))
    return [table.slice(a, b - a) for a, b in zip([0, *edges], [*edges, len(df)], strict=True)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sorted_batches_cut_anywhere_give_one_call_per_key(tmp_path, seed):
    rng = np.random.default_rng(seed)
    df = sorted_rows(rng, 3_000, 40, big=2_500)
    batches = cut(df, rng, 12)
    j = job()
    with open_backend(tmp_path, j) as backend:
        proc = SubtaskProcessor(j, backend, processing_time=10)
        for batch in batches:
            proc.process(batch)
        result = proc.finish()
    accepted = df.dropna(subset=["v"])
    want = accepted.groupby("k")["v"].agg(list)
    got = result.outputs["seen"].to_pandas().set_index("k")
    assert got.index.tolist() == want.index.tolist()  # once each, in key order
    assert [list(r) for r in got["rows"]] == want.tolist()  # all rows, in their order
    assert got["total"].tolist() == [len(r) for r in want]
    assert result.counters == {"calls": len(want)} and result.keys_touched == len(want)
    assert result.reasons == {"missing_v": len(df) - len(accepted)}


def test_unsorted_batches_are_refused_not_called_twice(tmp_path):
    j = job()
    batches = [pa.table({"k": ["a", "b"], "ts": [1, 2], "v": [1, 2]}, schema=SCHEMA),
               pa.table({"k": ["a"], "ts": [3], "v": [3]}, schema=SCHEMA)]
    with open_backend(tmp_path / "1", j) as backend:
        proc = SubtaskProcessor(j, backend, processing_time=10)
        for batch in batches:
            proc.process(batch)
        with pytest.raises(UsageError, match=r"ran 3 times for 2 keys: .*sorted by key"):
            proc.finish()
    # in process, any order: each key once, its rows in their order in the batches
    with open_backend(tmp_path / "2", j) as backend:
        result = process(j, backend, batches, processing_time=10)
    assert result.outputs["seen"].to_pylist() == [
        {"k": "a", "rows": [1, 3], "total": 2}, {"k": "b", "rows": [2], "total": 1}]


def test_a_batch_whose_last_key_also_comes_earlier(tmp_path):
    """Within one batch the rows may come in any order (the batch is grouped)."""
    j = job()
    with open_backend(tmp_path, j) as backend:
        proc = SubtaskProcessor(j, backend, processing_time=10)
        proc.process(pa.table({"k": ["b", "a", "b"], "ts": [1, 2, 3], "v": [1, 2, 3]},
                              schema=SCHEMA))
        proc.process(pa.table({"k": ["b", "c"], "ts": [4, 5], "v": [4, 5]}, schema=SCHEMA))
        result = proc.finish()
    assert result.outputs["seen"].to_pylist() == [
        {"k": "a", "rows": [2], "total": 1}, {"k": "b", "rows": [1, 3, 4], "total": 3},
        {"k": "c", "rows": [5], "total": 1}]


def test_late_rows_ttl_and_state_across_runs(tmp_path):
    """Late rows stay out of the call; a TTL state expires between runs."""
    j = job(event_time="ts")
    runs = [([("a", 5, 1), ("a", 7, 2), ("b", 9, 3)], dict(processing_time=0)),
            ([("a", 4, 4), ("a", 8, 5), ("b", 20, 6)],  # a/4 is late (watermark 6)
             dict(processing_time=500, watermark=6)),
            ([("a", 30, 7)], dict(processing_time=1_600, watermark=19))]  # a's total expired
    totals = []
    for rows, clock in runs:
        batches = [pa.table({"k": [k], "ts": [t], "v": [v]}, schema=SCHEMA)
                   for k, t, v in rows]  # one row per batch: every key spans batches
        with open_backend(tmp_path, j) as backend:
            proc = SubtaskProcessor(j, backend, **clock)
            for batch in batches:
                proc.process(batch)
            result = proc.finish()
        totals.append([(r["k"], r["rows"], r["total"]) for r in result.outputs["seen"].to_pylist()])
    assert totals == [[("a", [1, 2], 2), ("b", [3], 1)],
                      [("a", [5], 3), ("b", [6], 2)],
                      [("a", [7], 1)]]


def test_vectorized_batches_still_cut_inside_a_key(tmp_path):
    calls = []
    j = Job(name="vec", input=Input(SCHEMA, "k"),
            logic=Vectorized(lambda batch, ctx: calls.append(batch["k"].to_pylist())))
    batches = [pa.table({"k": ["a", "a"], "ts": [1, 2], "v": [1, 2]}, schema=SCHEMA),
               pa.table({"k": ["a", "b"], "ts": [3, 4], "v": [3, 4]}, schema=SCHEMA)]
    with open_backend(tmp_path, j) as backend:
        process(j, backend, batches)
    assert calls == [["a", "a"], ["a", "b"]]
