"""The keyed aggregation job in local mode (one shared local[2] SparkSession)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest

from demo.sample_data import expected_totals, generate_events
from jobs.keyed_aggregation import (
    DESCRIPTORS,
    TOTALS,
    JobConfig,
    JobRunError,
    RejectThresholdError,
    run,
    run_dir_name,
)
from statebackend.checkpoint.attempt import Attempt
from statebackend.checkpoint.leases import acquire_writer_lease, release
from statebackend.cli import app as cli
from statebackend.errors import LeaseConflictError
from statebackend.spark.dispatch import partition_values, spark_partition_of_int
from tests.jobs.helpers import (
    assert_state_equals,
    dump_latest,
    referenced_paths,
    store_of,
    stored_files,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(tmp_path, input_dir, run_id, **kw) -> JobConfig:
    kw.setdefault("storage", f"file://{tmp_path}/store")
    return JobConfig(input=str(input_dir), job=kw.pop("job", "agg"), run_id=run_id,
                     output=str(tmp_path / "out"), **kw)


def test_contract_names():
    assert TOTALS.name == "totals" and DESCRIPTORS == [TOTALS]
    assert TOTALS.codec.names == ("count", "sum", "min_ts", "max_ts")


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 128])
def test_partition_values_route_subtask_i_to_partition_i(spark, p):
    values = partition_values(p)
    assert sorted(spark_partition_of_int(v, p) for v in values) == list(range(p))
    assert [spark_partition_of_int(v, p) for v in values] == list(range(p))


def test_partition_values_match_spark_hash_partitioning(spark):
    from pyspark.sql import functions as F

    values = partition_values(5)
    df = spark.createDataFrame([(v,) for v in values], "_p int").repartition(5, F.col("_p"))
    placed = df.rdd.mapPartitionsWithIndex(lambda i, rows: [(i, r[0]) for r in rows]).collect()
    assert sorted(placed) == [(i, v) for i, v in enumerate(values)]


def test_run_dir_name_is_path_safe_and_distinct():
    assert run_dir_name("2027-01-01") == "run=2027-01-01"
    a, b = run_dir_name("scheduled__2027-01-01T00:00:00+00:00"), run_dir_name("a/b")
    assert "/" not in a + b and ":" not in a and a != run_dir_name("scheduled__2027-01-01T00_00")


@pytest.mark.parametrize("p", [1, 3, 4])
def test_runs_rerun_and_crash_match_pandas(spark, tmp_path, p):
    """3 runs + a re-run of run 1 (skipped) + a crashed attempt of run 3 then its retry."""
    days = [generate_events(str(tmp_path / f"in{d}"), n_events=3000, n_keys=800, seed=10 * p + d,
                            start_ts_ms=1_800_000_000_000 + d * 86_400_000)
            for d in range(3)]
    store = store_of(f"file://{tmp_path}/store", "agg")

    s1 = run(config(tmp_path, tmp_path / "in0", "day-0", parallelism=p), spark)
    assert (s1["checkpoint_id"], s1["parallelism"], s1["skipped"]) == (1, p, False)
    assert s1["events_read"] == 3000 and s1["events_rejected"] == 0
    assert s1["keys_touched"] == days[0]["key"].nunique()
    assert set(s1["timings"]) == {"restoring", "processing", "snapshotting", "uploading",
                                  "committing"}
    s2 = run(config(tmp_path, tmp_path / "in1", "day-1", parallelism=p), spark)
    assert s2["checkpoint_id"] == 2

    again = run(config(tmp_path, tmp_path / "in0", "day-0"), spark)  # re-run: no double count
    assert again["skipped"] is True and again["checkpoint_id"] == 1
    assert store.latest().checkpoint_id == 2

    crash_subtask = p - 1
    with pytest.raises(JobRunError, match=rf"injected failure in subtask {crash_subtask}.*"
                                          "checkpoint 2 stays latest"):
        run(config(tmp_path, tmp_path / "in2", "day-2", fail_subtask=crash_subtask), spark)
    assert store.latest().checkpoint_id == 2
    assert store.checkpoint_dirs() == [1, 2]  # the attempt's private files are gone
    assert stored_files(store, "shared") <= referenced_paths(store)  # and its shared uploads
    assert store.storage.list_dir("leases") == []  # lease released

    s3 = run(config(tmp_path, tmp_path / "in2", "day-2"), spark)
    assert (s3["checkpoint_id"], s3["skipped"]) == (3, False)
    meta = store.latest()
    assert (meta.run_id, meta.parent, meta.input) == ("day-2", 2, (str(tmp_path / "in2"),))
    assert [m.run_id for m in store.load_all()] == ["day-0", "day-1", "day-2"]
    assert stored_files(store, "shared") <= referenced_paths(store)

    # `ckpt dump latest` equals a pandas groupby over all accepted events
    out = tmp_path / "dump.jsonl"
    assert cli.main(["--storage", f"file://{tmp_path}/store", "--job", "agg", "dump", "latest",
                     "--out", str(out)]) == 0
    dumped = {r["key"]: r["value"] for r in map(json.loads, out.read_text().splitlines())}
    expected = expected_totals(days)
    assert_state_equals(dumped, expected)

    # output of the last run: exactly the keys it touched, with their new totals
    part = pd.read_parquet(tmp_path / "out" / "run=day-2")
    assert sorted(part["key"]) == sorted(days[2]["key"].unique())
    assert set(part["run_id"]) == {"day-2"} and set(part["checkpoint_id"]) == {3}
    assert (tmp_path / "out" / "run=day-2" / "_SUCCESS").exists()
    row = part.set_index("key").loc[days[2]["key"].iloc[0]]
    assert row["count"] == expected.loc[days[2]["key"].iloc[0], "count"]


def test_bad_rows_are_quarantined_and_counted(spark, tmp_path):
    good = generate_events(str(tmp_path / "in"), n_events=2000, n_keys=300, seed=1,
                           bad_fraction=0.004)  # 8 bad rows: 0.4% < 1%
    s = run(config(tmp_path, tmp_path / "in", "r1", parallelism=2), spark)
    assert s["events_read"] == 2008 and s["events_rejected"] == 8
    assert s["rejects_by_reason"] == {"missing_key": 2, "empty_key": 2, "non_numeric_value": 2,
                                      "missing_ts": 2}
    q = pq.read_table(tmp_path / "out" / "_quarantine" / "run=r1").to_pandas()
    assert len(q) == 8 and set(q["run_id"]) == {"r1"}
    assert set(q["reason"]) == {"missing_key", "empty_key", "non_numeric_value", "missing_ts"}
    assert "not-a-number" in set(q["value"])
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"), expected_totals([good]))


def test_too_many_rejects_fail_without_commit(spark, tmp_path):
    generate_events(str(tmp_path / "in"), n_events=400, n_keys=50, seed=2, bad_fraction=0.05)
    with pytest.raises(RejectThresholdError) as info:
        run(config(tmp_path, tmp_path / "in", "r1", parallelism=2), spark)
    msg = str(info.value)
    assert "\n" not in msg and "20 of 420 input rows rejected" in msg
    assert "--max-reject-fraction 0.01" in msg
    store = store_of(f"file://{tmp_path}/store", "agg")
    assert store.checkpoint_ids() == [] and stored_files(store, "shared") == set()
    assert not (tmp_path / "out" / "run=r1").exists()  # no output of an uncommitted run
    assert len(pq.read_table(tmp_path / "out" / "_quarantine" / "run=r1")) == 20
    # a looser threshold accepts the same input
    s = run(config(tmp_path, tmp_path / "in", "r1", parallelism=2, max_reject_fraction=0.1),
            spark)
    assert s["checkpoint_id"] == 1 and s["events_rejected"] == 20


def test_empty_input_is_a_valid_run(spark, tmp_path):
    (tmp_path / "empty").mkdir()
    s = run(config(tmp_path, tmp_path / "empty", "r0", parallelism=3), spark)
    assert (s["checkpoint_id"], s["events_read"], s["keys_touched"]) == (1, 0, 0)
    assert dump_latest(f"file://{tmp_path}/store", "agg") == {}
    events = generate_events(str(tmp_path / "in"), n_events=500, n_keys=100, seed=3, fmt="json")
    s = run(config(tmp_path, tmp_path / "in", "r1"), spark)
    assert s["parallelism"] == 3 and s["events_read"] == 500
    s = run(config(tmp_path, tmp_path / "empty", "r2"), spark)  # every handle carried forward
    assert s["bytes_uploaded"] == 0
    store = store_of(f"file://{tmp_path}/store", "agg")
    assert [(h.snapshot_id, h.files) for h in store.load(3).subtasks] == \
        [(h.snapshot_id, h.files) for h in store.load(2).subtasks]
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"), expected_totals([events]))


def test_input_without_rows_starts_no_spark_job(spark, tmp_path):
    """--engine spark: a day whose Parquet footers count no row (and no timer is due: this
    job has none) runs on the local engine and carries every handle forward; a JSON file
    is never assumed empty; the lineage then goes on on Spark and matches pandas."""
    from statebackend.job.run import IDLE_REASON

    days = [generate_events(str(tmp_path / f"in{d}"), n_events=600, n_keys=150, seed=40 + d,
                            start_ts_ms=1_800_000_000_000 + d * 86_400_000) for d in range(2)]
    (tmp_path / "none").mkdir()
    pq.write_table(pq.read_table(tmp_path / "in0").slice(0, 0),
                   tmp_path / "none" / "part-0.parquet")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "part-0.jsonl").write_text("")

    def spark_run(folder: str, run_id: str) -> dict:
        return run(config(tmp_path, tmp_path / folder, run_id, parallelism=2, engine="spark"),
                   spark)

    assert spark_run("in0", "r0")["engine"] == "spark"
    idle = spark_run("none", "r1")
    assert (idle["engine"], idle["engine_reason"]) == ("local", IDLE_REASON)
    assert (idle["checkpoint_id"], idle["events_read"], idle["bytes_uploaded"]) == (2, 0, 0)
    store = store_of(f"file://{tmp_path}/store", "agg")
    assert [h.files for h in store.load(2).subtasks] == [h.files for h in store.load(1).subtasks]
    assert spark_run("blank", "r2")["engine"] == "spark"  # a JSON file is opened by Spark
    assert spark_run("in1", "r3")["engine"] == "spark"
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"), expected_totals(days))


def test_concurrent_writer_is_refused(spark, tmp_path):
    generate_events(str(tmp_path / "in"), n_events=100, n_keys=10, seed=4)
    store = store_of(f"file://{tmp_path}/store", "agg")
    lease = acquire_writer_lease(store.storage, "another run")
    try:
        with pytest.raises(LeaseConflictError, match="busy: another run"):
            run(config(tmp_path, tmp_path / "in", "r1"), spark)
    finally:
        release(store.storage, lease)
    assert store.checkpoint_ids() == []
    assert run(config(tmp_path, tmp_path / "in", "r1"), spark)["checkpoint_id"] == 1


def test_incremental_run_uploads_a_small_fraction(spark, tmp_path):
    """Run 2 touches 1% of 100,000 keys: it uploads a small part of the state's bytes."""
    generate_events(str(tmp_path / "full"), n_events=300_000, n_keys=100_000, seed=5)
    generate_events(str(tmp_path / "small"), n_events=2_000, n_keys=1_000, seed=6,
                    key_offset=50_000)
    s1 = run(config(tmp_path, tmp_path / "full", "full", parallelism=2), spark)
    s2 = run(config(tmp_path, tmp_path / "small", "small"), spark)
    store = store_of(f"file://{tmp_path}/store", "agg")
    state_bytes = store.latest().bytes_referenced
    fraction = s2["bytes_uploaded"] / state_bytes
    print(f"\nincremental: run 1 uploaded {s1['bytes_uploaded']} bytes; run 2 touched "
          f"{s2['keys_touched']} keys and uploaded {s2['bytes_uploaded']} of {state_bytes} "
          f"state bytes ({fraction:.2%})")
    assert s2["keys_touched"] <= 1_000
    assert fraction < 0.25
    assert s2["restore_modes"] == ["local-instance", "local-instance"]


def test_s3_storage_in_local_mode(spark, tmp_path, s3_server):
    """Local-mode Python workers reach the moto S3 server with the driver's AWS_* settings."""
    from tests.conftest import S3_BUCKET

    url = f"s3://{S3_BUCKET}/jobs-local-{os.getpid()}"
    a = generate_events(str(tmp_path / "a"), n_events=800, n_keys=200, seed=8)
    b = generate_events(str(tmp_path / "b"), n_events=800, n_keys=200, seed=9)
    run(config(tmp_path, tmp_path / "a", "a", storage=url, parallelism=2,
               local_dir=str(tmp_path / "local")), spark)
    s = run(config(tmp_path, tmp_path / "b", "b", storage=url,
                   local_dir=str(tmp_path / "local2")), spark)
    assert s["restore_modes"] == ["download", "download"]  # fresh local dir: from S3
    assert_state_equals(dump_latest(url, "agg"), expected_totals([a, b]))


def test_cli_json_and_skip(tmp_path):
    generate_events(str(tmp_path / "in"), n_events=300, n_keys=40, seed=11)
    env = {**os.environ, "PYTHONPATH": ROOT}
    args = [sys.executable, "-m", "jobs.keyed_aggregation", "--input", str(tmp_path / "in"),
            "--storage", str(tmp_path / "store"), "--job", "cli", "--run-id", "d1",
            "--output", str(tmp_path / "out"), "--parallelism", "2", "--master", "local[1]",
            "--engine", "auto", "--json"]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["engine"] == "local"  # what a user's small run gets by default
    assert {"run_id", "checkpoint_id", "events_read", "events_rejected", "keys_touched",
            "bytes_uploaded", "duration_s", "parallelism", "skipped", "timings"} <= set(summary)
    assert (summary["checkpoint_id"], summary["events_read"], summary["skipped"]) == (1, 300,
                                                                                     False)
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and json.loads(proc.stdout)["skipped"] is True
    bad = subprocess.run([*args[:-1], "--run-id", "d2", "--input", str(tmp_path / "missing")],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith(
        "keyed_aggregation: error: input folder")


def test_start_from_savepoint_seeds_a_new_job(spark, tmp_path):
    from statebackend.lifecycle.savepoint import create_savepoint

    a = generate_events(str(tmp_path / "a"), n_events=600, n_keys=120, seed=12)
    b = generate_events(str(tmp_path / "b"), n_events=600, n_keys=120, seed=13)
    url = f"file://{tmp_path}/store"
    run(config(tmp_path, tmp_path / "a", "a", job="src", parallelism=3), spark)
    create_savepoint(store_of(url, "src"), "latest", "sp1")
    s = run(config(tmp_path, tmp_path / "b", "b", job="dst", start_from="src/savepoints/sp1"),
            spark)
    dst = store_of(url, "dst")
    assert (s["checkpoint_id"], s["parent"], s["parallelism"]) == (2, 1, 3)
    assert dst.load(1).source["savepoint"] == "sp1"
    assert_state_equals(dump_latest(url, "dst"), expected_totals([a, b]))
    assert_state_equals(dump_latest(url, "src"), expected_totals([a]))


def test_demo_runs_each_day_and_lists(spark, tmp_path, capsys):
    from demo.job_demo import run_demo

    summaries = run_demo(str(tmp_path / "demo"), days=3, events_per_day=1000, n_keys=200,
                         spark=spark)
    assert [s["checkpoint_id"] for s in summaries] == [1, 2, 3]
    out = capsys.readouterr().out
    assert "run 2027-01-01: checkpoint 1" in out and "ckpt --storage" in out
    again = run_demo(str(tmp_path / "demo"), days=3, events_per_day=1000, n_keys=200,
                     spark=spark)
    assert all(s["skipped"] for s in again)


def test_memory_storage_and_bad_options_are_refused(tmp_path):
    from statebackend.errors import UsageError

    with pytest.raises(UsageError, match="memory://x lives in one process"):
        run(config(tmp_path, tmp_path, "r", storage="memory://x", engine="spark"))
    with pytest.raises(UsageError, match="max-reject-fraction 2.0"):
        run(config(tmp_path, tmp_path, "r", max_reject_fraction=2.0))


class _Crash(Exception):
    """Stands in for a driver killed between the commit and the _SUCCESS marker."""


def test_crash_after_commit_is_published_by_the_skipped_rerun(spark, tmp_path, monkeypatch):
    d0 = generate_events(str(tmp_path / "in0"), n_events=1500, n_keys=300, seed=21)
    d1 = generate_events(str(tmp_path / "in1"), n_events=1500, n_keys=300, seed=22,
                         key_offset=150)
    store = store_of(f"file://{tmp_path}/store", "agg")
    run(config(tmp_path, tmp_path / "in0", "day-0", parallelism=3), spark)

    def crash(*_args, **_kw):
        raise _Crash("driver killed")

    monkeypatch.setattr(Attempt, "cleanup", crash)  # the step right after store.commit
    with pytest.raises(_Crash):
        run(config(tmp_path, tmp_path / "in1", "day-1"), spark)
    monkeypatch.undo()
    run_folder = tmp_path / "out" / "run=day-1"
    assert store.latest().run_id == "day-1" and not (run_folder / "_SUCCESS").exists()
    assert stored_files(store, "chk-2/_attempts")  # the crash left the attempt records

    # A killed driver leaves its lease behind: the re-run must publish without taking it.
    lease = acquire_writer_lease(store.storage, "a stale writer")
    try:
        again = run(config(tmp_path, tmp_path / "in1", "day-1"), spark)
    finally:
        release(store.storage, lease)
    assert (again["skipped"], again["published"], again["checkpoint_id"]) == (True, True, 2)
    assert (run_folder / "_SUCCESS").exists()
    assert stored_files(store, "chk-2/_attempts") == set()
    assert store.checkpoint_ids() == [1, 2]
    expected = expected_totals([d0, d1])
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"), expected)
    out = pd.read_parquet(run_folder).set_index("key")
    assert sorted(out.index) == sorted(d1["key"].unique())
    assert_state_equals(out[["count", "sum", "min_ts", "max_ts"]].to_dict("index"),
                        expected.loc[sorted(d1["key"].unique())])
    assert run(config(tmp_path, tmp_path / "in1", "day-1"), spark)["published"] is False


def test_skipped_rerun_does_not_publish_a_folder_with_missing_parts(spark, tmp_path):
    generate_events(str(tmp_path / "in"), n_events=600, n_keys=100, seed=23)
    run(config(tmp_path, tmp_path / "in", "r1", parallelism=2), spark)
    folder = tmp_path / "out" / "run=r1"
    (folder / "_SUCCESS").unlink()
    (folder / "part-00001.parquet").unlink()
    again = run(config(tmp_path, tmp_path / "in", "r1"), spark)
    assert again["skipped"] is True and again["published"] is False
    assert again["output_parts_missing"] == ["part-00001.parquet"]
    assert not (folder / "_SUCCESS").exists()


def test_damaged_stored_file_is_uploaded_again_not_reused(spark, tmp_path):
    """A shared SST truncated in storage after run 1: run 2 restores from its local
    instance, finds the damage by size, uploads a fresh copy and references only that."""
    days = [generate_events(str(tmp_path / f"in{d}"), n_events=2000, n_keys=300, seed=70 + d,
                            start_ts_ms=1_800_000_000_000 + d * 86_400_000) for d in range(2)]
    store = store_of(f"file://{tmp_path}/store", "agg")
    local = str(tmp_path / "local")
    run(config(tmp_path, tmp_path / "in0", "day-0", parallelism=1, local_dir=local), spark)
    damaged = store.latest().subtasks[0].shared_files[0].path
    full = store.storage.abspath(damaged)
    with open(full, "r+b") as fh:
        fh.truncate(os.path.getsize(full) // 2)

    s2 = run(config(tmp_path, tmp_path / "in1", "day-1", local_dir=local), spark)

    assert s2["restore_modes"] == ["local-instance"]
    assert s2["reuploaded"] == [damaged]
    assert damaged not in {f.path for f in store.latest().files}
    for ref in store.latest().files:
        algorithm = ref.checksum.split(":", 1)[0]
        assert store.storage.checksum(ref.path, algorithm)[1] == ref.checksum, ref.path
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"),
                        expected_totals(days))
