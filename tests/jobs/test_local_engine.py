"""The local engine (statebackend.job.local_engine) against the Spark engine and pandas.

The pandas-reference scenarios of every built-in job also run on the local engine
(test_run_protocol, test_sessionization, test_dedup: ``engine="local"``). Here: one
lineage whose runs alternate between the engines holds bit-identical state to a
Spark-only lineage; ``auto`` picks the local engine for a small input without
importing pyspark at all, and Spark when the input is over the limit; a bad input file
is one line and commits nothing; memory:// storage works in one process.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from jobs import keyed_aggregation as ka
from statebackend.checkpoint import layout
from statebackend.checkpoint.store import CheckpointStore
from statebackend.engines import ENGINE_ENV, MAX_BYTES_ENV
from statebackend.errors import InputError, UsageError
from statebackend.job import JobRunError, RunConfig, run_job
from statebackend.storage import open_storage
from tests.jobs.run_reference import (
    assert_totals_equal,
    final_state,
    totals_days,
    totals_reference,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tmp_path, storage: str, d: int, engine: str | None, **kw) -> RunConfig:
    kw.setdefault("run_id", f"d{d}")
    kw.setdefault("parallelism", 3)
    return RunConfig(input=str(tmp_path / f"in{d}"), storage=storage,
                     output=f"{tmp_path}/out-{storage.rsplit('/', 1)[-1]}",
                     local_dir=str(tmp_path / "local"), engine=engine, **kw)


def test_alternating_engines_hold_the_same_state_as_spark_alone(spark, tmp_path):
    days = totals_days(str(tmp_path), 4, seed=410)  # Parquet, JSON with bad lines, Parquet
    spark_only, mixed = f"file://{tmp_path}/spark", f"file://{tmp_path}/mixed"
    for d, engine in enumerate(("local", "spark", "local", "local")):
        want = run_job(ka.JOB, _config(tmp_path, spark_only, d, "spark"), spark)
        got = run_job(ka.JOB, _config(tmp_path, mixed, d, engine), spark)
        assert got["engine"] == engine
        for k in ("events_read", "events_rejected", "keys_touched", "rejects_by_reason"):
            assert got[k] == want[k], (d, k)
    # same sums to the last bit: same routing, same row order, same batches
    assert final_state(mixed, "keyed_aggregation") == final_state(spark_only,
                                                                  "keyed_aggregation")
    assert_totals_equal(final_state(mixed, "keyed_aggregation")["totals"],
                        totals_reference(days)[1]["totals"])
    meta = CheckpointStore(open_storage(mixed), "keyed_aggregation").latest()
    assert (meta.extra["engine"], meta.extra["input_reader"]) == ("local", "arrow")


def test_auto_runs_a_small_input_without_importing_pyspark(tmp_path):
    totals_days(str(tmp_path), 1, seed=420)
    driver = (
        "import json, sys\n"
        "from statebackend.cli.app import main\n"
        "code = main(sys.argv[1:])\n"
        "print(json.dumps({'pyspark': 'pyspark' in sys.modules}))\n"
        "sys.exit(code)\n")
    env = {k: v for k, v in os.environ.items() if k != ENGINE_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", driver, "--storage", f"file://{tmp_path}/store", "run",
         "jobs.keyed_aggregation:JOB", "--input", str(tmp_path / "in0"), "--run-id", "d0",
         "--output", str(tmp_path / "out"), "--master", "spark://10.255.255.1:7077",
         "--parallelism", "2", "--json"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary, imported = proc.stdout[:proc.stdout.rindex("\n{")], proc.stdout.splitlines()[-1]
    summary = json.loads(summary)
    assert (summary["engine"], summary["checkpoint_id"], summary["parallelism"]) == \
        ("local", 1, 2)
    assert "within the local engine's 64.0 MiB" in summary["engine_reason"]
    assert json.loads(imported) == {"pyspark": False}  # no JVM, no Spark client at all


def test_auto_takes_spark_when_the_input_is_over_the_limit(spark, tmp_path, monkeypatch):
    totals_days(str(tmp_path), 1, seed=430)
    monkeypatch.delenv(ENGINE_ENV)
    monkeypatch.setenv(MAX_BYTES_ENV, "1000")
    s = run_job(ka.JOB, _config(tmp_path, f"file://{tmp_path}/store", 0, None), spark)
    assert s["engine"] == "spark" and f"the local engine's 0.0 MiB ({MAX_BYTES_ENV})" in \
        s["engine_reason"]


def test_an_unreadable_file_is_one_line_and_commits_nothing(tmp_path):
    folder = tmp_path / "in0"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"key": "k", "ts": 1, "value": 1.0}) + "\n")
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(b'{"key": "x"}\n' * 100)[:40])
    storage = f"file://{tmp_path}/store"
    with pytest.raises(InputError) as info:
        run_job(ka.JOB, _config(tmp_path, storage, 0, "local"))
    text = str(info.value)
    assert "\n" not in text and f"cannot read input file file://{folder}/b.jsonl.gz" in text
    store = CheckpointStore(open_storage(storage), "keyed_aggregation")
    assert store.checkpoint_ids() == [] and not store.storage.exists("shared")
    history = [json.loads(store.storage.read_bytes(i.path))
               for i in store.storage.walk_files(layout.HISTORY_DIR)]
    assert [(h["run_id"], h["outcome"]) for h in history] == [("d0", "failed")]
    assert "b.jsonl.gz" in history[0]["error"]


def test_memory_storage_runs_on_the_local_engine_and_spark_refuses_it(tmp_path):
    days = totals_days(str(tmp_path), 2, seed=440)
    url = "memory://local-engine-test"
    for d in range(2):
        assert run_job(ka.JOB, _config(tmp_path, url, d, "local"))["checkpoint_id"] == d + 1
    assert_totals_equal(final_state(url, "keyed_aggregation")["totals"],
                        totals_reference(days)[1]["totals"])
    with pytest.raises(UsageError, match="lives in one process.*or --engine local"):
        run_job(ka.JOB, _config(tmp_path, url, 1, "spark", run_id="again"))


def _explode_after_state_work(batch, ctx) -> None:
    """Reads and writes state, then fails while its frames hold the state handles."""
    last_seen = ctx.state("last_seen")
    keys = batch["user"].to_pylist()
    last_seen.put(keys, [{"ts": 0, "category": "x"}] * len(keys))
    if ctx.options["normalize_case"]:  # the test's switch: True fails the run
        raise RuntimeError("logic failed")


def test_a_failed_subtask_leaves_no_open_instance_behind(tmp_path):
    """A subtask that fails inside the logic must not keep its RocksDB instance (and its
    LOCK) open in this process: the next run here opens the same local folder."""
    from dataclasses import replace

    from examples import user_activity
    from statebackend.job import JobRunError, Vectorized
    from tests.jobs.run_reference import activity_events

    activity_events(str(tmp_path / "in0"), rows=200, users=20, seed=1, day=0, fmt="parquet")
    job = replace(user_activity.job, logic=Vectorized(_explode_after_state_work))
    storage = f"file://{tmp_path}/store"
    config = RunConfig(input=str(tmp_path / "in0"), storage=storage, run_id="d0",
                       output=str(tmp_path / "out"), parallelism=2, engine="local",
                       local_dir=str(tmp_path / "local"), options={"normalize_case": False})
    assert run_job(job, config)["checkpoint_id"] == 1
    failed = replace(config, run_id="d1", options={"normalize_case": True})
    with pytest.raises(JobRunError, match="failed in a local subtask: subtask [01]: "
                                          "RuntimeError: logic failed") as info:
        run_job(job, failed)
    # pytest keeps the exception (and its traceback) alive here, as a caller would
    assert info.value.__cause__ is not None
    again = run_job(job, replace(config, run_id="d1"))
    # the failed attempt changed the instances: both come back from their local snapshot
    assert (again["checkpoint_id"], again["restore_modes"]) == (2, ["local-snapshot"] * 2)


def test_a_failed_subtask_cancels_the_waiting_ones_and_commits_nothing(tmp_path):
    """One thread (local[1]), four subtasks: subtask 0 fails after its upload, the three
    not started never run; its uploads are removed and the parent stays latest."""
    totals_days(str(tmp_path), 2, seed=450)
    storage = f"file://{tmp_path}/store"
    base = dict(parallelism=4, master="local[1]")
    assert run_job(ka.JOB, _config(tmp_path, storage, 0, "local", **base))["checkpoint_id"] == 1
    store = CheckpointStore(open_storage(storage), "keyed_aggregation")
    shared = {i.path for i in store.storage.walk_files("shared")}
    with pytest.raises(JobRunError, match=r"failed in a local subtask: subtask 0: RuntimeError: "
                                          r"injected failure in subtask 0.*checkpoint 1 stays"):
        run_job(ka.JOB, _config(tmp_path, storage, 1, "local", fail_subtask=0, **base))
    assert store.checkpoint_ids() == [1]
    assert {i.path for i in store.storage.walk_files("shared")} == shared
    assert run_job(ka.JOB, _config(tmp_path, storage, 1, "local", **base))["checkpoint_id"] == 2
