"""Transform a job's state into a savepoint of a new job, then run it (issue 23,
deliverable 3), against pandas.

- The card-spend job (tests/evolution/card_spend.py) runs two days; its state is
  transformed per batch into the split job (``totals`` split into two value states, every
  state re-keyed to new card ids, the map state included), in this process and through
  Spark (the re-key is a Spark shuffle); the new lineage runs a day from the savepoint:
  its latest checkpoint equals pandas over the three days, and validates ``--full``.
- Per key: cards seen fewer than 16 times are dropped; the rest continues as pandas
  says. ``ckpt migrate`` plans (``--dry-run``), writes and reports ``--json``.
- A bad result (a missing column, a null key, an undeclared state) is refused in one line
  and no savepoint is written.
- An identity transform of every kind, TTL and the timers keeps every entry; the
  provider's operator plans and writes like the command.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from statebackend.airflow.operators import CkptMigrateOperator
from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
from statebackend.errors import TaskFailedError, UsageError
from statebackend.job import (
    RunConfig,
    StateTransform,
    TransformOptions,
    bootstrap_state,
    run_job,
    transform_state,
)
from statebackend.lifecycle.registry import load_savepoint
from statebackend.storage import open_storage
from tests.evolution.card_spend import VERSIONS, dumped, events
from tests.evolution.test_evolution import check_latest, same
from tests.jobs import transform_data as data
from tests.jobs.bootstrap_data import KINDS, kinds_tables
from tests.jobs.helpers import run_docs_example, store_of

DAY = 86_400_000


def _day(d: int) -> pd.DataFrame:
    return events(250, 30, 100 + d, d)


def _run(tmp_path, storage: str, job, job_dir: str, d: int, frame: pd.DataFrame, engine,
         **kw) -> dict:
    folder = tmp_path / f"in-{job_dir}-{d}"
    folder.mkdir()
    frame.to_parquet(folder / "part.parquet")
    name, spark = engine
    return run_job(job, RunConfig(input=str(folder), storage=storage, job=job_dir,
                                  run_id=f"day{d}", output=str(tmp_path / f"out-{job_dir}"),
                                  parallelism=2, engine=name, **kw), spark)


@pytest.fixture(params=["local", "spark"])
def engine(request):
    return request.param, (request.getfixturevalue("spark") if request.param == "spark"
                           else None)


@pytest.mark.timeout(600)
def test_split_and_rekey_then_run_a_day_equals_pandas(tmp_path, engine):
    storage = f"file://{tmp_path}/store"
    for d in (1, 2):
        _run(tmp_path, storage, VERSIONS[1], "card_spend", d, _day(d), engine)
    result = transform_state(storage, "card_spend:latest", data.SPLIT_AND_REKEY,
                             data.SPLIT_BY_ID, "split", TransformOptions(
                                 target_job="card_split", parallelism=3, spark=engine[1]))
    assert result["plan"]["source_states"] == ["totals", "per_merchant", "recent",
                                               "max_amount"]
    assert result["parallelism"] == 3 and result["kind"] == "savepoint"
    store = store_of(storage, "card_split")
    record = store.storage.read_bytes_if_exists("savepoints/split/_metadata")
    source = json.loads(record)["source"]
    assert (source["job"], source["checkpoint"]) == ("card_spend", 2)
    assert source["transform"] == {"function": "tests.jobs.transform_data:split_and_rekey",
                                   "per": "batch"}
    day3 = data.with_new_ids(_day(3))
    _run(tmp_path, storage, data.SPLIT_BY_ID, "card_split", 3, day3, engine,
         start_from=result["start_from"])
    days = pd.concat([data.with_new_ids(_day(1)), data.with_new_ids(_day(2)), day3])
    check_latest(storage, "card_split", data.split_reference(days))
    assert cli.main(["--storage", storage, "--job", "card_split", "validate", "1", "--full",
                     "--report", "none"]) == 0


@pytest.mark.timeout(300)
def test_per_key_drops_and_splits_then_continues_as_pandas_says(tmp_path):
    storage = f"file://{tmp_path}/store"
    local = ("local", None)
    for d in (1, 2):
        _run(tmp_path, storage, VERSIONS[1], "card_spend", d, _day(d), local)
    before = pd.concat([_day(1), _day(2)])
    seen = before.groupby("card").size()
    dropped = frozenset(seen[seen < data.MIN_SEEN].index)
    assert 0 < len(dropped) < len(seen), seen
    result = transform_state(storage, "card_spend:2", data.split_per_key, data.SPLIT, "split",
                             TransformOptions(target_job="card_split"))
    assert result["parallelism"] == 2  # the source's
    _run(tmp_path, storage, data.SPLIT, "card_split", 3, _day(3), local,
         start_from=result["start_from"])
    days = pd.concat([before.assign(_last=False), _day(3).assign(_last=True)])
    check_latest(storage, "card_split", data.split_reference(days, "card", dropped))


def test_ckpt_migrate_plans_then_writes(tmp_path, capsys):
    storage = f"file://{tmp_path}/store"
    _run(tmp_path, storage, VERSIONS[1], "card_spend", 1, _day(1), ("local", None))
    base = ["--storage", storage, "--job", "card_split", "migrate", "card_spend:latest",
            "tests.jobs.transform_data:SPLIT_AND_REKEY", "--to",
            "tests.jobs.transform_data:SPLIT_BY_ID", "--savepoint", "split"]
    capsys.readouterr()
    assert cli.main([*base, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and "checkpoint 1 of job card_spend" in out, out
    store = store_of(storage, "card_split")
    assert not store.storage.list_dir("savepoints")
    assert cli.main([*base, "--parallelism", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["parallelism"] == 3 and summary["entries"]["n"] > 0
    assert summary["plan"]["per"] == "batch"
    assert cli.main(base) != 0  # the name is taken
    assert "already exists" in capsys.readouterr().err


def _missing_value(tables):
    return {"n": tables["totals"].select(["key"])}


def _null_key(tables):
    t = tables["totals"]
    return {"n": pa.table({"key": pa.array([None] * t.num_rows, pa.string()),
                           "value": t["n"]})}


def _undeclared(tables):
    return {"totals": tables["totals"]}


@pytest.mark.parametrize("fn, fragment", [
    (_missing_value, "has no column 'value'"),
    (_null_key, "holds a null"),
    (_undeclared, "does not declare"),
])
def test_a_bad_result_is_refused_in_one_line_and_nothing_is_written(tmp_path, fn, fragment):
    storage = f"file://{tmp_path}/store"
    _run(tmp_path, storage, VERSIONS[1], "card_spend", 1, _day(1), ("local", None))
    with pytest.raises((UsageError, TaskFailedError)) as info:
        transform_state(storage, "card_spend:latest", StateTransform(fn, per="batch"),
                        data.SPLIT, "split")
    message = str(info.value)
    assert "\n" not in message and fragment in message, message
    assert not store_of(storage, "card_split").storage.list_dir("savepoints")


def test_the_migrate_operator_plans_then_writes_the_savepoint(tmp_path, capsys):
    storage = f"file://{tmp_path}/store"
    _run(tmp_path, storage, VERSIONS[1], "card_spend", 1, _day(1), ("local", None))
    common = {"storage": storage, "job": "card_split", "source": "card_spend:latest",
              "transform_ref": "tests.jobs.transform_data:SPLIT_AND_REKEY",
              "target_ref": "tests.jobs.transform_data:SPLIT_BY_ID", "savepoint": "split"}
    planned = CkptMigrateOperator(task_id="plan", dry_run="True", **common).execute({})
    assert planned["dry_run"] and "write: savepoint split" in capsys.readouterr().out
    store = store_of(storage, "card_split")
    assert not store.storage.list_dir("savepoints")
    result = CkptMigrateOperator(task_id="migrate", parallelism="3", **common).execute({})
    assert result["start_from"] == "card_split/savepoints/split"
    assert result["parallelism"] == 3 and result["entries"]["n"] == 30
    with pytest.raises(TypeError, match="unknown argument 'savepont'"):
        CkptMigrateOperator(task_id="bad", savepont="x", **common)


def _identity(tables):
    return tables


def test_an_identity_transform_of_every_kind_ttl_and_timers_keeps_every_entry(tmp_path):
    """What read_state gives (JSON as text, a TTL list's expiries per element, the
    timers) goes back in unchanged: the two savepoints hold the same entries."""
    root = f"file://{tmp_path}/store"
    tables = {n: pa.Table.from_pandas(t, preserve_index=False)
              for n, t in kinds_tables(np.random.default_rng(7)).items()}
    bootstrap_state(KINDS, root, "seed", tables, parallelism=2, max_parallelism=32)
    result = transform_state(root, "kinds/savepoints/seed",
                             StateTransform(_identity, per="batch"), KINDS, "copy",
                             TransformOptions(target_job="kinds_copy", parallelism=3))
    assert result["max_parallelism"] == 32
    storage = open_storage(root)

    def rows(job: str, name: str) -> list:
        store = CheckpointStore(storage, job)
        return sorted((r["state"], r["key"], str(r["user_key"]), json.dumps(r["value"]))
                      for r in checkpoint_rows(store, load_savepoint(store, name)))

    seed = rows("kinds", "seed")
    assert {s for s, *_ in seed} >= {"count", "seen", "tags", "events", "avg", "_timers",
                                     "_ttl"}
    assert rows("kinds_copy", "copy") == seed


def test_the_docs_example_splits_drops_and_continues():
    scope = run_docs_example("state-as-data.md", "Transform state into a new savepoint")
    assert scope["result"]["entries"] == {"n": 1, "spend": 1}
    store = store_of(scope["storage"], "spend_v2")
    got = {(r["state"], r["key"]): r["value"] for r in checkpoint_rows(store, store.latest())}
    assert got == {("n", "ann"): 3, ("spend", "ann"): 13.0}


def _split_totals(states: dict) -> dict:
    return {"n": states["totals"]["n"], "spend": states["totals"]["spend"]}


def test_retention_and_gc_during_a_transform_keep_what_it_reads(tmp_path):
    """The source is held: retention and GC run while the function runs (keep 1, no
    grace) take nothing the transform reads, and it writes the older checkpoint's state."""
    storage = f"file://{tmp_path}/store"
    for d in (1, 2):
        _run(tmp_path, storage, VERSIONS[1], "card_spend", d, _day(d), ("local", None))
    cleaned: list[int] = []
    once = threading.Lock()  # source subtasks run in threads

    def split_while_collecting(key: str, states: dict) -> dict:
        with once:
            if cleaned:
                return _split_totals(states)
            cleaned.append(cli.main(["--storage", storage, "--job", "card_spend", "retain",
                                     "--keep", "1"]))
            cleaned.append(cli.main(["--storage", storage, "--job", "card_spend", "gc",
                                     "--grace-seconds", "0"]))
        return _split_totals(states)

    transform_state(storage, "card_spend:1", split_while_collecting, data.SPLIT, "split",
                    TransformOptions(target_job="card_split"))
    assert cleaned == [0, 0]
    store = store_of(storage, "card_split")
    got = dumped(checkpoint_rows(store, load_savepoint(store, "split")))
    want = data.split_reference(_day(1), "card")
    assert set(got) == {"n", "spend"}
    assert all(same(got[s], want[s]) for s in got)
    # the hold is gone: retention now retires checkpoint 1
    assert cli.main(["--storage", storage, "--job", "card_spend", "retain", "--keep", "1"]) == 0
    assert store_of(storage, "card_spend").checkpoint_ids() == [2]


def test_ckpt_migrate_on_spark_with_a_master(spark, tmp_path, capsys):
    """``--master``: the transform runs as Spark tasks (the session of this process is
    reused, and stays up: the command did not start it)."""
    storage = f"file://{tmp_path}/store"
    _run(tmp_path, storage, VERSIONS[1], "card_spend", 1, _day(1), ("local", None))
    capsys.readouterr()
    assert cli.main(["--storage", storage, "--job", "card_split", "migrate",
                     "card_spend:latest", "tests.jobs.transform_data:SPLIT_AND_REKEY", "--to",
                     "tests.jobs.transform_data:SPLIT_BY_ID", "--savepoint", "split",
                     "--master", "local[2]", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["plan"]["engine"] == "spark" and summary["entries"]["n"] == 30
    assert spark.range(1).count() == 1  # still up
