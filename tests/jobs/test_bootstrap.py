"""Bootstrap a job from tables, then run it (issue 23, deliverable 2), against pandas.

- The card-spend job (tests/evolution/card_spend.py) bootstrapped from its state after a
  day of history (pandas, as Arrow tables and Parquet folders, or as Spark DataFrames),
  started from, run two days, rescaled, run a day: the latest checkpoint's rows (what
  `ckpt dump` writes) equal pandas over the history and the days, on both engines; the
  first checkpoint passes `ckpt validate --full`.
- Every state kind, TTL and timers: after one run the expired entries are gone, the due
  timers fired (the job's output) and the others wait, as pandas says.
- ``ckpt run --initial-state`` bootstraps a lineage's first checkpoint on its first run.
- A bad Spark DataFrame fails in one line and leaves no savepoint.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.cli import app as cli
from statebackend.errors import TaskFailedError, UsageError
from statebackend.job import (
    RunConfig,
    bootstrap_state,
    run_job,
)
from statebackend.rescale.executor import RescaleOptions, rescale
from tests.evolution import test_evolution
from tests.evolution.card_spend import V1, dumped, events, reference
from tests.evolution.test_evolution import Lineage, same
from tests.jobs.bootstrap_data import (
    KINDS,
    T,
    history,
    kinds_dump,
    kinds_reference,
    kinds_tables,
    state_tables,
)
from tests.jobs.helpers import run_docs_example, store_of

DAY = 86_400_000


def as_parquet(folder, table: pa.Table) -> str:
    folder.mkdir()
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), folder / "part-0.parquet")
    pq.write_table(table.slice(half), folder / "part-1.parquet")
    return str(folder)


# the evolution test's fixtures: engine (local, spark) and storage (file, s3)
engine, storage = test_evolution.engine, test_evolution.storage


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bootstrap_run_two_days_rescale_run_a_day_equals_pandas(tmp_path, storage, engine):
    name, spark = engine
    hist = history()
    tables = state_tables(reference([(hist, 1)]))
    if spark is not None:  # Spark DataFrames: encoded and written by Spark tasks
        tables = {n: spark.createDataFrame(t.to_pandas()) for n, t in tables.items()}
    else:  # Arrow tables and Parquet folders together
        for n in ("totals", "per_merchant"):
            tables[n] = as_parquet(tmp_path / n, tables[n])
    summary = bootstrap_state(V1, storage, "seed", tables, parallelism=2)
    assert summary["entries"]["totals"] == 30 and summary["kind"] == "savepoint"
    lin = Lineage(tmp_path, storage, name, spark)
    lin.days = [(hist, 1)]
    lin.run(1, 1, job_dir="boot", start_from=summary["start_from"])
    lin.run(2, 1, job_dir="boot")
    lin.check("boot")
    store = store_of(storage, "boot")
    rescale(store, "latest", 3, spark=spark, options=RescaleOptions(master="local[2]"))
    lin.run(3, 1, job_dir="boot")
    lin.check("boot")
    assert store.latest().parallelism == 3
    assert store.load(1).source["savepoint"] == "seed"  # the imported savepoint
    assert cli.main(["--storage", storage, "--job", "boot", "validate", "1", "--full",
                     "--report", "none"]) == 0


# -- every kind, TTL and timers --------------------------------------------------------

@pytest.mark.timeout(600)
def test_every_kind_ttl_and_timers_continue_as_pandas_says(tmp_path, engine):
    name, spark = engine
    tables = kinds_tables(np.random.default_rng(5))
    root = f"file://{tmp_path}/store"
    arrow = {n: pa.Table.from_pandas(t, preserve_index=False) for n, t in tables.items()}
    bootstrap_state(KINDS, root, "seed", arrow, parallelism=2, max_parallelism=32)
    day = pd.DataFrame({"k": ["u1", "u2", "u2", "new"], "ts": [50, 100, 95, 60]})
    (tmp_path / "in").mkdir()
    day.to_parquet(tmp_path / "in" / "part.parquet")
    summary = run_job(KINDS, RunConfig(
        input=str(tmp_path / "in"), storage=root, job="kinds_run", run_id="r1",
        output=str(tmp_path / "out"), engine=name, logical_time_ms=T,
        start_from="kinds/savepoints/seed"), spark)
    assert summary["checkpoint_id"] == 2
    want, fired = kinds_reference(tables, day, watermark=100)
    store = store_of(root, "kinds_run")
    got = kinds_dump(checkpoint_rows(store, store.latest()))
    assert got.pop("_timers", {}) == want.pop("_timers")
    for state in want:
        assert same(got.get(state, {}), want[state]), (state, got.get(state), want[state])
    out = pq.read_table(tmp_path / "out").to_pylist()
    assert sorted((r["key"], r["time"], r["tag"], r["domain"]) for r in out) == \
        [(k, int(t), tag, d) for k, t, tag, d in fired]
    assert cli.main(["--storage", root, "--job", "kinds_run", "validate", "1", "--full",
                     "--report", "none"]) == 0


# -- ckpt run --initial-state ----------------------------------------------------------

def test_initial_state_bootstraps_the_first_run_of_a_lineage(tmp_path, capsys):
    hist = history()
    paths = {n: as_parquet(tmp_path / n, t)
             for n, t in state_tables(reference([(hist, 1)])).items()}
    spec = ",".join(f"{n}={p}" for n, p in paths.items())
    storage = f"file://{tmp_path}/store"
    lin = Lineage(tmp_path, storage, "local", None)
    lin.days = [(hist, 1)]
    with pytest.raises(UsageError, match="needs --parallelism"):
        run_job(V1, RunConfig(input=lin.input(1), storage=storage, job="init", run_id="day1",
                              output=str(tmp_path / "out"), engine="local",
                              initial_state=spec))
    with pytest.raises(UsageError, match="give one of them"):
        lin.run(1, 1, job_dir="init", initial_state=spec, start_from="card_spend:latest")
    assert cli.main(["--storage", storage, "--job", "init", "run",
                     "tests.evolution.card_spend:V1", "--input", lin.input(1), "--run-id",
                     "day1", "--output", str(tmp_path / "out"), "--engine", "local",
                     "--parallelism", "2", "--initial-state", spec, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["checkpoint_id"], summary["parent"]) == (2, 1)
    lin.days.append((events(250, 30, 101, 1), 1))
    lin.check("init")
    first = store_of(storage, "init").load(1)
    assert first.source["bootstrap"]["entries"]["totals"] == 30 and first.run_id is None
    later = lin.run(2, 1, job_dir="init", initial_state=spec)
    assert any("--initial-state ignored" in w for w in later["warnings"])
    lin.check("init")


def test_a_bad_spark_dataframe_fails_in_one_line_and_leaves_no_savepoint(spark, tmp_path):
    tables = state_tables(reference([(history(), 1)]))
    bad = tables["max_amount"].to_pandas()
    bad.loc[3, "key"] = None
    with pytest.raises(TaskFailedError) as info:
        bootstrap_state(V1, f"file://{tmp_path}/store", "seed",
                        {"max_amount": spark.createDataFrame(bad)}, parallelism=2)
    message = str(info.value)
    assert "\n" not in message and "state 'max_amount'" in message and \
        "column 'key' holds a null" in message, message
    assert not (tmp_path / "store" / "card_spend" / "savepoints" / "seed").exists()
    totals = tables["totals"].to_pandas().astype({"spend": str})
    with pytest.raises(UsageError, match="state 'totals': column 'spend' is string"):
        bootstrap_state(V1, f"file://{tmp_path}/store", "seed",
                        {"totals": spark.createDataFrame(totals)}, parallelism=2)


def test_dump_of_a_bootstrapped_savepoint_equals_its_tables(tmp_path):
    ref = reference([(history(), 1)])
    bootstrap_state(V1, f"file://{tmp_path}/store", "seed", state_tables(ref), parallelism=3)
    store = store_of(f"file://{tmp_path}/store", "card_spend")
    from statebackend.lifecycle.registry import load_savepoint

    got = dumped(checkpoint_rows(store, load_savepoint(store, "seed")))
    assert all(same(got[s], ref[s]) for s in ref) and set(got) == set(ref)


def test_the_docs_example_runs_and_continues_the_history():
    scope = run_docs_example("state-as-data.md", "Bootstrap a job from tables")
    store = store_of(f"file://{scope['root']}/state", "spend")
    assert store.latest().checkpoint_id == 2
    got = {r["key"]: r["value"] for r in checkpoint_rows(store, store.latest())}
    assert got == {"ann": {"n": 4, "spend": 50.0}, "bob": {"n": 1, "spend": 7.5},
                   "cy": {"n": 1, "spend": 1.0}}
