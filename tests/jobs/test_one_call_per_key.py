"""One call per key per run, on both engines: a key of 250,000 rows (it spans many Arrow
batches: 100,000 rows in the local engine, 10,000 in Spark's) reaches the per-key
function once, with all of its rows, and a per-run maximum and distinct count computed
in that call equal pandas."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.job import (
    Input,
    Job,
    KeyContext,
    Output,
    PerKey,
    RunConfig,
    not_null,
    reducing_state,
    run_job,
)
from tests.jobs.helpers import store_of
from tests.jobs.test_sessionization import run_output

BIG = "big"
BIG_ROWS = 250_000
SCHEMA = pa.schema([("user", pa.string()), ("ts", pa.int64()), ("item", pa.int64())])
PER_RUN = pa.schema([("user", pa.string()), ("rows", pa.int64()), ("max_item", pa.int64()),
                     ("distinct_items", pa.int64())])


def per_run(user: str, rows: pa.Table, state: KeyContext) -> dict:
    """Per-run figures of one user: right only if the call holds all of its rows."""
    state.count("calls")
    if user == BIG:
        state.count("calls_big")
    top = pc.max(rows["item"]).as_py()
    state["max_ever"].add(top)
    return {"user": [user], "rows": [rows.num_rows], "max_item": [top],
            "distinct_items": [pc.count_distinct(rows["item"]).as_py()]}


JOB = Job(name="per_run", input=Input(SCHEMA, "user", rules=(not_null("item"),)),
          states=(reducing_state("max_ever", max),),
          outputs=(Output("per_run", PER_RUN),),  # no last_per: a second call would show
          logic=PerKey(per_run))


def day(seed: int, big_rows: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 2_000, 10_000)
    users = np.concatenate([np.full(big_rows, BIG, dtype=object),
                            np.array([f"u{i}" for i in small], dtype=object)])
    df = pd.DataFrame({"user": users, "ts": rng.integers(0, 10**9, len(users)),
                       "item": rng.integers(0, 60_000, len(users))})
    df.loc[df.sample(frac=0.001, random_state=seed).index, "item"] = None  # rejected
    return df.sample(frac=1.0, random_state=seed).reset_index(drop=True)  # BIG everywhere


@pytest.mark.parametrize("engine", ["local", "spark"])
def test_a_key_of_250000_rows_is_one_call(request, tmp_path, engine):
    spark = None
    if engine == "spark":
        from pyspark import cloudpickle

        spark = request.getfixturevalue("spark")
        # This test module is not importable on the workers: ship its functions by value.
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    storage, output = f"file://{tmp_path / 'ckpt'}", str(tmp_path / "out")
    max_ever: dict[str, int] = {}
    # Two runs: the figures are per run. Spark: one (each run costs seconds there).
    runs = (("d1", BIG_ROWS), ("d2", 120_000))[:1 if engine == "spark" else 2]
    for run_id, big_rows in runs:
        df = day(len(run_id) + big_rows, big_rows)
        folder = tmp_path / "in" / run_id
        folder.mkdir(parents=True)
        df.astype({"item": "Int64"}).to_parquet(folder / "part.parquet", row_group_size=70_000)
        summary = run_job(JOB, RunConfig(
            input=str(folder), storage=storage, run_id=run_id, output=output, parallelism=2,
            local_dir=str(tmp_path / "local"), engine=engine), spark)

        accepted = df.dropna(subset=["item"])
        want = accepted.groupby("user")["item"].agg(["size", "max", "nunique"])
        got = run_output(output, run_id).set_index("user").sort_index()
        assert got.index.is_unique  # one row per user: one call per user
        assert got.index.tolist() == sorted(want.index)
        assert got["rows"].tolist() == want.loc[got.index, "size"].tolist()
        assert got["max_item"].tolist() == want.loc[got.index, "max"].tolist()
        assert got["distinct_items"].tolist() == want.loc[got.index, "nunique"].tolist()
        assert got.loc[BIG, "rows"] == len(accepted[accepted["user"] == BIG]) > 100_000
        assert summary["counters"] == {"calls": len(want), "calls_big": 1}
        assert summary["keys_touched"] == len(want)
        assert summary["rejects_by_reason"] == {"missing_item": len(df) - len(accepted)}
        for user, top in want["max"].items():
            max_ever[user] = max(max_ever.get(user, top), top)
    assert summary["engine"] == engine
    store = store_of(storage, JOB.name)
    state = {r["key"]: r["value"] for r in checkpoint_rows(store, store.resolve("latest"))}
    assert state == max_ever
