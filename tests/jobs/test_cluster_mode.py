"""The job on a Spark standalone cluster (master + 2 workers on 127.0.0.1) with S3 storage.

Run 1 goes through ``spark-submit jobs/keyed_aggregation.py`` (the --master comes from
spark-submit), runs 2-3 through one driver session; every executor has its own
local-recovery folder, so state reaches executors only through the moto S3 server.
The final state must be identical to local mode on the same inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from demo.sample_data import expected_totals, generate_events
from jobs.keyed_aggregation import JobConfig, run
from statebackend.job.input import DIRECT_READ_MAX_BYTES_ENV
from tests.jobs.conftest import spark_home
from tests.jobs.helpers import assert_state_equals, dump_latest, store_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def cluster_env(cluster) -> dict:
    """The environment of a driver process of ``cluster``: this repository importable and
    the moto server's S3 settings (the client reads them; nothing is written back)."""
    env = {**cluster.env, "PYTHONPATH": ROOT}
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                "AWS_DEFAULT_REGION"):
        env[var] = os.environ[var]
    return env


DRIVER = """
import json, sys
from jobs.keyed_aggregation import JobConfig, run
from statebackend.spark.session import get_spark
args = json.loads(sys.argv[1])
spark = get_spark(args["master"], app_name="cluster-test")
for inp, run_id in args["runs"]:
    s = run(JobConfig(input=inp, storage=args["storage"], job="agg", run_id=run_id,
                      output=args["output"], master=args["master"]), spark)
    print(json.dumps(s), flush=True)
spark.stop()
"""


@pytest.mark.slow
def test_cluster_with_s3_equals_local_mode(standalone_cluster, s3_server, spark, tmp_path):
    from tests.conftest import S3_BUCKET

    days = [generate_events(str(tmp_path / f"in{d}"), n_events=4000, n_keys=1500, seed=40 + d,
                            start_ts_ms=1_800_000_000_000 + d * 86_400_000,
                            bad_fraction=0.002 if d == 1 else 0.0)
            for d in range(3)]
    s3_url = f"s3://{S3_BUCKET}/cluster-{uuid.uuid4().hex[:8]}"
    env = cluster_env(standalone_cluster)
    master = standalone_cluster.master_url

    submit = subprocess.run(
        [os.path.join(spark_home(), "bin", "spark-submit"), "--master", master,
         "--conf", "spark.ui.enabled=false", os.path.join(ROOT, "jobs", "keyed_aggregation.py"),
         "--input", str(tmp_path / "in0"), "--storage", s3_url, "--job", "agg",
         "--run-id", "d0", "--output", str(tmp_path / "out"), "--parallelism", "3", "--json"],
        env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert submit.returncode == 0, submit.stderr[-4000:]
    first = json.loads(submit.stdout.strip().splitlines()[-1])
    assert (first["checkpoint_id"], first["parallelism"], first["events_read"]) == (1, 3, 4000)

    args = {"master": master, "storage": s3_url, "output": str(tmp_path / "out"),
            "runs": [[str(tmp_path / "in1"), "d1"], [str(tmp_path / "in2"), "d2"],
                     [str(tmp_path / "in1"), "d1"]]}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summaries = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [s["checkpoint_id"] for s in summaries] == [2, 3, 2]
    assert [s["skipped"] for s in summaries] == [False, False, True]
    assert summaries[0]["events_rejected"] == 8
    # Executors restored from S3 or from their own local folder, never from another's.
    assert set(summaries[1]["restore_modes"]) <= {"download", "local-instance",
                                                  "local-snapshot"}
    assert all(os.path.isdir(d) for d in standalone_cluster.worker_local_dirs)

    cluster_state = dump_latest(s3_url, "agg")
    assert_state_equals(cluster_state, expected_totals(days))

    # The same inputs in local mode give the identical final state.
    local_url = f"file://{tmp_path}/local-store"
    for d in range(3):
        run(JobConfig(input=str(tmp_path / f"in{d}"), storage=local_url, job="agg",
                      run_id=f"d{d}", output=str(tmp_path / "local-out"), parallelism=3), spark)
    assert dump_latest(local_url, "agg") == cluster_state
    assert store_of(s3_url, "agg").latest().parallelism == 3


@pytest.mark.slow
def test_example_job_through_submit_script_on_the_cluster(standalone_cluster, s3_server,
                                                          tmp_path):
    """`spark-submit statebackend/cli/submit.py examples.user_activity:job`: the example on
    the cluster with S3 storage, two runs and a skipped re-run, against pandas."""
    from tests.conftest import S3_BUCKET
    from tests.jobs.run_reference import (
        activity_events,
        activity_reference,
        final_state,
        read_output,
    )

    days = [activity_events(str(tmp_path / f"in{d}"), rows=1200, users=200, seed=80 + d, day=d)
            for d in range(2)]
    expected, state = activity_reference(days)
    s3_url = f"s3://{S3_BUCKET}/example-{uuid.uuid4().hex[:8]}"
    env = cluster_env(standalone_cluster)
    env.pop("CKPT_ENGINE", None)  # the user's default: under spark-submit, Spark

    def submit(d: int) -> dict:
        proc = subprocess.run(
            [os.path.join(spark_home(), "bin", "spark-submit"), "--master",
             standalone_cluster.master_url, "--conf", "spark.ui.enabled=false",
             os.path.join(ROOT, "statebackend", "cli", "submit.py"),
             "examples.user_activity:job", "--input", str(tmp_path / f"in{d}"),
             "--storage", s3_url, "--run-id", f"d{d}", "--output", str(tmp_path / "out"),
             "--parallelism", "3", "--json"],
            env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout[proc.stdout.index("{"):])

    first, second, again = submit(0), submit(1), submit(1)
    assert (first["checkpoint_id"], second["checkpoint_id"], again["skipped"]) == (1, 2, True)
    assert (first["engine"], second["engine"]) == ("spark", "spark")
    for d in (0, 1):
        got = read_output(str(tmp_path / "out"), f"run=d{d}").set_index("user").sort_index()
        import pandas as pd

        pd.testing.assert_frame_equal(got, expected[d], check_dtype=False)
    assert final_state(s3_url, "user_activity") == state


S3_INPUT_DRIVER = """
import json, sys
from jobs.keyed_aggregation import JOB
from statebackend.job import RunConfig, run_job
from statebackend.spark.session import get_spark
args = json.loads(sys.argv[1])
spark = get_spark(args["master"], app_name="s3-input-test")
for inp, run_id in args["runs"]:
    s = run_job(JOB, RunConfig(input=inp, storage=args["storage"], job="agg", run_id=run_id,
                               output=args["output"], master=args["master"], parallelism=2,
                               storage_options=args["options"]), spark)
    print(json.dumps(s), flush=True)
spark.stop()
"""


@pytest.mark.slow
def test_s3_input_on_the_cluster_equals_local_mode(standalone_cluster, s3_server, spark,
                                                   tmp_path, monkeypatch):
    """Input on s3:// (Parquet, and gzip JSON lines with a bad line) read by the executors
    with pyarrow over fsspec: no Hadoop connector, credentials only as storage options
    (the driver process has no AWS_* variables). State equals a local-mode run."""
    import gzip

    import fsspec

    from tests.conftest import S3_BUCKET

    days = [generate_events(str(tmp_path / f"in{d}"), n_events=3000, n_keys=800, seed=60 + d,
                            start_ts_ms=1_800_000_000_000 + d * 86_400_000,
                            fmt="parquet" if d == 0 else "json")
            for d in range(2)]
    jsonl = tmp_path / "in1" / "part-00000.jsonl"
    with open(jsonl, "rb") as src, gzip.open(tmp_path / "in1" / "part-00000.jsonl.gz", "wb") as gz:
        gz.write(src.read() + b'{"key":"bad","ts":1,"value":1} trailing\n')
    os.remove(jsonl)
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": s3_server}}
    fs = fsspec.filesystem("s3", **options)
    prefix = f"{S3_BUCKET}/input-{uuid.uuid4().hex[:8]}"
    for d in range(2):
        fs.put(str(tmp_path / f"in{d}") + "/", f"{prefix}/in{d}/", recursive=True)
    s3_store = f"s3://{S3_BUCKET}/s3in-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in standalone_cluster.env.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = ROOT
    args = {"master": standalone_cluster.master_url, "storage": s3_store,
            "output": str(tmp_path / "out"), "options": options,
            "runs": [[f"s3://{prefix}/in0", "d0"], [f"s3://{prefix}/in1", "d1"]]}
    proc = subprocess.run([sys.executable, "-c", S3_INPUT_DRIVER, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summaries = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [s["input_reader"] for s in summaries] == ["arrow", "arrow"]
    assert [(s["events_read"], s["events_rejected"]) for s in summaries] == \
        [(3000, 0), (3001, 1)]
    assert summaries[1]["rejects_by_reason"] == {"malformed": 1}
    assert "testing" not in proc.stdout + proc.stderr  # the secret is never printed

    cluster_state = dump_latest(s3_store, "agg")
    assert_state_equals(cluster_state, expected_totals(days))
    local_url = f"file://{tmp_path}/local-store"
    # The cluster's tasks each read the small input themselves (spark_direct); here the
    # same days take Spark's reader and shuffle, and must give the same state.
    monkeypatch.setenv(DIRECT_READ_MAX_BYTES_ENV, "0")
    readers = [run(JobConfig(input=str(tmp_path / f"in{d}"), storage=local_url, job="agg",
                             run_id=f"d{d}", output=str(tmp_path / "local-out"), parallelism=2),
                   spark)["input_reader"] for d in range(2)]
    # "auto" on local files: Spark's reader for Parquet, Arrow for (gzip) JSON lines
    assert readers == ["spark", "arrow"]
    assert dump_latest(local_url, "agg") == cluster_state


@pytest.mark.slow
def test_memory_backend_on_the_cluster_with_s3_equals_pandas(standalone_cluster, s3_server,
                                                             tmp_path):
    """The memory backend with its state in two executors' processes and its key-group
    files on S3: runs, a rescale and a run after it, through ``ckpt`` against the
    cluster; every executor restores its subtasks from S3 or its own live instance."""
    from tests.conftest import S3_BUCKET

    days = [generate_events(str(tmp_path / f"in{d}"), n_events=3000, n_keys=1200, seed=70 + d,
                            start_ts_ms=1_800_000_000_000 + d * 86_400_000)
            for d in range(3)]
    s3_url = f"s3://{S3_BUCKET}/cluster-memory-{uuid.uuid4().hex[:8]}"
    env = cluster_env(standalone_cluster)
    ckpt = os.path.join(os.path.dirname(sys.executable), "ckpt")

    def call(*args: str) -> dict:
        done = subprocess.run([ckpt, *args, "--json"], env=env, capture_output=True, text=True,
                              timeout=400, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout)

    def run_day(d: int, *flags: str) -> dict:
        return call("run", "jobs.keyed_aggregation:JOB", "--input", str(tmp_path / f"in{d}"),
                    "--storage", s3_url, "--job", "agg", "--run-id", f"d{d}", "--output",
                    str(tmp_path / "out"), "--master", standalone_cluster.master_url,
                    "--engine", "spark", *flags)

    first = run_day(0, "--parallelism", "3", "--backend", "memory")
    second = run_day(1)
    scaled = call("--storage", s3_url, "--job", "agg", "rescale", "-p", "2")
    last = run_day(2)
    assert (first["engine"], first["parallelism"], second["checkpoint_id"]) == ("spark", 3, 2)
    assert set(second["restore_modes"]) <= {"download", "local-instance", "local-snapshot"}
    assert (scaled["bytes_downloaded"], scaled["bytes_uploaded"]) == (0, 0)
    assert (last["checkpoint_id"], last["parallelism"]) == (4, 2)
    assert store_of(s3_url, "agg").latest().state_backend == "memory"
    assert_state_equals(dump_latest(s3_url, "agg"), expected_totals(days))
