"""Jobs and rescale as Spark Connect clients: the same state as a local classic session.

The Connect client runs in its own process (`ckpt run/rescale --remote`): pyspark's
functions answer for one mode per process, and this process holds the classic
``spark`` fixture for the local reference run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from demo.sample_data import generate_events
from jobs.keyed_aggregation import JOB
from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import UsageError
from statebackend.job.config import RunConfig
from statebackend.job.run import run_job
from statebackend.lifecycle.registry import load_savepoint
from statebackend.rescale.executor import rescale
from statebackend.spark.dispatch import task_failure
from statebackend.spark.session import get_spark
from statebackend.state.external_store import ExternalStore
from statebackend.storage import open_storage
from tests.evolution.card_spend import VERSIONS, dumped, events
from tests.evolution.test_evolution import same
from tests.jobs import transform_data as data
from tests.jobs.run_reference import (
    assert_totals_equal,
    check_totals_output,
    final_state,
    read_output,
    totals_days,
    totals_reference,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CKPT_BIN = os.path.join(os.path.dirname(sys.executable), "ckpt")
JOB_REF = "jobs.keyed_aggregation:JOB"
CLIENT_TIMEOUT_S = 300


def _client(server, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env={**server.env, **(env or {})},
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)


def _ckpt_json(server, storage: str, *args: str, job: str = "agg",
               env: dict | None = None) -> dict:
    """``ckpt --storage S --job JOB ARGS --remote URL --json``: the printed summary."""
    done = _client(server, CKPT_BIN, "--storage", storage, "--job", job, *args,
                   "--remote", server.url, "--json", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _run_args(folder: str, day: int, out: str) -> tuple[str, ...]:
    return ("run", JOB_REF, "--input", f"{folder}/in{day}", "--output", out,
            "--run-id", f"day{day}")


def _local_run(spark, folder: str, day: int, storage: str, out: str,
               parallelism: int | None = None) -> dict:
    return run_job(JOB, RunConfig(input=f"{folder}/in{day}", storage=storage, job="agg",
                                  run_id=f"day{day}", output=out, parallelism=parallelism),
                   spark)


@pytest.mark.slow
def test_runs_rerun_and_rescale_through_connect_equal_the_local_run(connect_server, spark,
                                                                     tmp_path):
    folder = str(tmp_path)
    days = totals_days(folder, 3, seed=41)
    remote_store, remote_out = f"file://{tmp_path}/remote", f"{tmp_path}/remote-out"
    local_store, local_out = f"file://{tmp_path}/local", f"{tmp_path}/local-out"

    # Through the Connect server: two runs, a re-run, a rescale 3 -> 2, one more run.
    first = _ckpt_json(connect_server, remote_store, *_run_args(folder, 0, remote_out),
                       "--parallelism", "3")
    second = _ckpt_json(connect_server, remote_store, *_run_args(folder, 1, remote_out))
    again = _ckpt_json(connect_server, remote_store, *_run_args(folder, 1, remote_out))
    # --engine spark: the new subtasks run as tasks of the Connect server (a small
    # state would otherwise rescale in this client's threads)
    scaled = _ckpt_json(connect_server, remote_store, "rescale", "-p", "2", "--engine", "spark")
    last = _ckpt_json(connect_server, remote_store, *_run_args(folder, 2, remote_out))
    assert (first["checkpoint_id"], first["parallelism"]) == (1, 3)
    assert (second["checkpoint_id"], second["skipped"]) == (2, False)
    assert (again["checkpoint_id"], again["skipped"]) == (2, True)
    assert (scaled["from_parallelism"], scaled["to_parallelism"]) == (3, 2)
    assert scaled["engine"] == "spark"
    assert (last["checkpoint_id"], last["parallelism"]) == (4, 2)

    # The same sequence on the local classic session.
    _local_run(spark, folder, 0, local_store, local_out, parallelism=3)
    _local_run(spark, folder, 1, local_store, local_out)
    assert _local_run(spark, folder, 1, local_store, local_out)["skipped"]
    rescale(CheckpointStore(open_storage(local_store), "agg"), "latest", 2, spark=spark)
    _local_run(spark, folder, 2, local_store, local_out)

    remote_state = final_state(remote_store, "agg")
    assert remote_state == final_state(local_store, "agg")  # bit-identical float sums
    _, reference = totals_reference(days)
    assert_totals_equal(remote_state["totals"], reference["totals"])
    for day in range(3):
        got, want = (read_output(out, f"run=day{day}").sort_values("key", ignore_index=True)
                     for out in (remote_out, local_out))
        pd.testing.assert_frame_equal(got, want)


@pytest.mark.slow
def test_first_run_on_connect_takes_the_servers_cores(connect_server, tmp_path):
    days = totals_days(str(tmp_path), 1, seed=5)
    # with progress lines: the Connect client reports the subtasks from the server's stream
    done = _client(connect_server, CKPT_BIN, "--storage", f"file://{tmp_path}/store", "--job",
                   "agg", *_run_args(str(tmp_path), 0, f"{tmp_path}/out"), "--remote",
                   connect_server.url, "--json",
                   env={"CKPT_PROGRESS": "lines", "CKPT_PROGRESS_INTERVAL": "0.5"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    # The server runs local[2]; a Connect client has no SparkContext.defaultParallelism.
    assert summary["parallelism"] == 2
    assert summary["events_read"] == len(days[0]) + summary["events_rejected"]
    assert "ckpt run: run day0, checkpoint 1: 2/2 subtasks (100%)" in done.stderr


PID_JOB = "tests.spark.worker_pid_job:JOB"
RELEASE_SESSION = """
import sys
from pyspark.sql import SparkSession
SparkSession.builder.remote(sys.argv[1] + "/;session_id=" + sys.argv[2]).create().stop()
"""


def _pid_run(server, folder: str, day: int, *extra: str) -> set[int]:
    """A run of the worker-pid job as a Connect client process: the pids of the Python
    workers that ran its subtasks."""
    out = f"{folder}/pid-out"
    summary = _ckpt_json(server, f"file://{folder}/pid-store", "run", PID_JOB, "--input",
                         f"{folder}/in{day}", "--output", out, "--run-id", f"day{day}",
                         "--local-dir", f"{folder}/local", "--parallelism", "2", *extra)
    assert summary["checkpoint_id"] == day + 1 and summary["engine"] == "spark"
    pids = set(read_output(out, f"run=day{day}")["pid"])
    assert pids and os.getpid() not in pids
    return pids


def _recorded_session(folder: str, purpose: str = "run") -> str:
    """The session id recorded for the job's ``purpose`` commands (the only record)."""
    records = []
    for name in os.listdir(f"{folder}/local/connect-sessions"):
        with open(f"{folder}/local/connect-sessions/{name}") as fh:
            records.append(json.load(fh))
    (record,) = [r for r in records if r.get("purpose", "run") == purpose]
    return record["session_id"]


@pytest.mark.slow
def test_runs_of_a_job_reuse_the_python_workers_of_its_kept_session(connect_server, tmp_path):
    """Each run is its own client process, as under Airflow: the second run attaches to
    the session the first one recorded and its subtasks run in the same Python workers;
    ``--connect-session new`` runs in new ones; a session the server closed (released
    here, as its idle timeout would) is replaced by a new recorded one."""
    folder = str(tmp_path)
    days = totals_days(folder, 5, seed=13)
    first = _pid_run(connect_server, folder, 0)
    session = _recorded_session(folder)
    second = _pid_run(connect_server, folder, 1)
    assert second & first, (first, second)
    assert _recorded_session(folder) == session
    fresh = _pid_run(connect_server, folder, 2, "--connect-session", "new")
    assert not fresh & (first | second)
    assert _recorded_session(folder) == session
    released = _client(connect_server, sys.executable, "-c", RELEASE_SESSION,
                       connect_server.url, session)
    assert released.returncode == 0, released.stderr[-2000:]
    after = _pid_run(connect_server, folder, 3)
    assert not after & (first | second)
    replaced = _recorded_session(folder)
    assert replaced != session
    assert _pid_run(connect_server, folder, 4) & after
    assert _recorded_session(folder) == replaced
    # the state is every run's: counts per key equal pandas over the five days
    state = final_state(f"file://{folder}/pid-store", "agg")["counts"]
    want = pd.concat(days).groupby("key").size()
    assert state == {(k, None): int(v) for k, v in want.items()}


FAILING_RUN = """
import sys
from demo.sample_data import generate_events
from jobs.keyed_aggregation import JOB
from statebackend.errors import CkptError
from statebackend.job.config import RunConfig
from statebackend.job.run import run_job
from statebackend.lifecycle.registry import load_savepoint
folder, url = sys.argv[1], sys.argv[2]
config = RunConfig(input=folder + "/in0", storage="file://" + folder + "/store", job="agg",
                   run_id="boom", output=folder + "/out", parallelism=3, master=url,
                   fail_subtask=1)
try:
    run_job(JOB, config)
except CkptError as exc:
    print(exc)
    sys.exit(3)
"""


@pytest.mark.slow
def test_failed_task_on_connect_is_one_line_and_commits_nothing(connect_server, tmp_path):
    totals_days(str(tmp_path), 1, seed=9)
    done = _client(connect_server, sys.executable, "-c", FAILING_RUN, str(tmp_path),
                   connect_server.url)
    assert done.returncode == 3, done.stderr[-3000:]
    message = done.stdout.strip()
    assert "\n" not in message
    assert "injected failure in subtask 1" in message
    assert "no checkpoint was committed" in message
    store = CheckpointStore(open_storage(f"file://{tmp_path}/store"), "agg")
    assert store.latest() is None and store.checkpoint_ids() == []


def test_connect_client_next_to_a_local_session_is_refused_in_one_line(spark):
    # pyspark's functions answer for the mode started first: mixing them would fail later,
    # deep in a plan, so the library refuses up front and names the way out.
    with pytest.raises(UsageError, match=r"sc://127\.0\.0\.1:1: .*\(ckpt run --remote\)"):
        get_spark(remote="sc://127.0.0.1:1")


def test_a_connect_url_must_use_the_sc_scheme():
    with pytest.raises(UsageError, match="'http://x:1' is not a Spark Connect URL"):
        from statebackend.spark.session import get_connect

        get_connect("http://x:1")


JVM_FAILURE = """Job aborted due to stage failure: Task 0 in stage 1.0 failed 1 times, most \
recent failure: Lost task 0.0 in stage 1.0 (TID 1) (localhost executor driver): \
java.io.IOException: Cannot run program "/no/python" (in directory "/tmp"): error=2, No such file
\tat java.base/java.lang.ProcessBuilder.start(ProcessBuilder.java:1143)
\tat org.apache.spark.api.python.PythonWorkerFactory.create(PythonWorkerFactory.scala:120)
Caused by: java.io.IOException: error=2, No such file or directory
\tat java.base/java.lang.ProcessImpl.forkAndExec(Native Method)
\t... 36 more
\tat java.lang.Thread.run(Thread.java:840)"""


def test_a_jvm_failure_is_reported_by_its_cause_not_a_stack_frame():
    # Spark Connect hands the client the JVM text, stack frames last.
    assert task_failure(RuntimeError(JVM_FAILURE)) == \
        "java.io.IOException: error=2, No such file or directory"


def test_parquet_input_is_read_without_a_schema_inference_job(spark, tmp_path):
    from statebackend.job.input import list_input
    from statebackend.job.spark_input import read_input

    generate_events(str(tmp_path / "in"), n_events=300, n_keys=40, seed=3)
    files = list_input(str(tmp_path / "in"))
    tracker = spark.sparkContext.statusTracker()
    before = set(tracker.getJobIdsForGroup())
    df = read_input(spark, files, JOB.input)
    assert set(tracker.getJobIdsForGroup()) == before  # planning ran no Spark job
    want = pd.read_parquet(str(tmp_path / "in"))
    got = df.toPandas()
    assert sorted(got["key"]) == sorted(want["key"])
    assert got["value"].sum() == pytest.approx(want["value"].sum(), rel=1e-12)


def test_a_timestamp_column_leaves_the_schema_to_spark(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from statebackend.job.api import Input
    from statebackend.job.spark_input import parquet_read_schema

    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"k": ["a"], "at": pa.array([1], pa.timestamp("us"))}), path)
    schema = pa.schema([("k", pa.string()), ("at", pa.timestamp("us"))])
    assert parquet_read_schema(Input(schema=schema, key="k"), path) is None
    assert parquet_read_schema(Input(schema=pa.schema([("k", pa.string())]), key="k"),
                               path) == "`k` string"


def _rescale_pids(server, folder: str, parallelism: int, *extra: str) -> set[int]:
    """A rescale as a Connect client process: the pids of the Python workers that built
    its new subtasks."""
    summary = _ckpt_json(server, f"file://{folder}/store", "rescale", "-p", str(parallelism),
                         "--engine", "spark", *extra, env={"CKPT_LOCAL_DIR": f"{folder}/local"})
    assert summary["engine"] == "spark" and summary["to_parallelism"] == parallelism
    pids = {s["pid"] for s in summary["subtasks"]}
    assert pids and os.getpid() not in pids
    return pids


@pytest.mark.slow
def test_rescales_and_migrations_of_a_job_keep_a_connect_session_each(connect_server,
                                                                      tmp_path):
    """``ckpt rescale --remote`` and ``ckpt migrate --remote`` attach to a session kept for
    the job's rescales (or migrations), as runs do: the second rescale runs in the first
    one's Python workers, ``--connect-session new`` in new ones; each purpose has its own
    record. Every key stays once across the rescales (pandas), and both migrations write
    what pandas says the transform gives."""
    folder = str(tmp_path)
    store = f"file://{folder}/store"
    days = totals_days(folder, 2, seed=29)
    local = RunConfig(input=f"{folder}/in0", storage=store, job="agg", run_id="day0",
                      output=f"{folder}/out", parallelism=4, engine="local")
    run_job(JOB, local)
    first = _rescale_pids(connect_server, folder, 2)
    session = _recorded_session(folder, "rescale")
    second = _rescale_pids(connect_server, folder, 3)
    assert second & first, (first, second)
    fresh = _rescale_pids(connect_server, folder, 4, "--connect-session", "new")
    assert not fresh & (first | second)
    assert _recorded_session(folder, "rescale") == session
    run_job(JOB, RunConfig(input=f"{folder}/in1", storage=store, job="agg", run_id="day1",
                           output=f"{folder}/out", engine="local"))
    assert_totals_equal(final_state(store, "agg")["totals"], totals_reference(days)[1]["totals"])

    card = events(250, 30, 101, 1)
    os.makedirs(f"{folder}/card-in")
    card.to_parquet(f"{folder}/card-in/part.parquet")
    run_job(VERSIONS[1], RunConfig(input=f"{folder}/card-in", storage=store, job="card_spend",
                                   run_id="day1", output=f"{folder}/card-out", parallelism=2,
                                   engine="local"))
    want = data.split_reference(data.with_new_ids(card))
    sessions = []
    for name in ("split-a", "split-b"):
        summary = _ckpt_json(connect_server, store, "migrate", "card_spend:latest",
                             "tests.jobs.transform_data:SPLIT_AND_REKEY", "--to",
                             "tests.jobs.transform_data:SPLIT_BY_ID", "--savepoint", name,
                             job="card_split", env={"CKPT_LOCAL_DIR": f"{folder}/local"})
        assert summary["plan"]["engine"] == "spark"
        sessions.append(_recorded_session(folder, "migrate"))
        target = CheckpointStore(open_storage(store), "card_split")
        got = dumped(checkpoint_rows(target, load_savepoint(target, name)))
        assert set(got) == set(want) and all(same(got[s], want[s]) for s in got)
    assert sessions[0] == sessions[1] != session


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["memory", "external"])
def test_the_other_backends_run_and_rescale_through_connect(connect_server, postgres_server,
                                                            tmp_path, backend):
    """A job on the memory or external backend runs as tasks of a Connect server (its
    subtasks' state in the server's Python workers, or in the database), rescales
    (key-group files change hands, or nothing moves) and runs on: equal to pandas."""
    folder = str(tmp_path)
    days = totals_days(folder, 3, seed=43)
    store, out = f"file://{tmp_path}/store", f"{tmp_path}/out"
    db = ["--state-db", postgres_server.url, "--state-table", "connect_agg"] \
        if backend == "external" else []
    first = _ckpt_json(connect_server, store, *_run_args(folder, 0, out), "--parallelism", "3",
                       "--backend", backend, "--engine", "spark", *db)
    second = _ckpt_json(connect_server, store, *_run_args(folder, 1, out), "--engine", "spark",
                        *db)
    scaled = _ckpt_json(connect_server, store, "rescale", "-p", "2", *db)
    last = _ckpt_json(connect_server, store, *_run_args(folder, 2, out), "--engine", "spark",
                      *db)
    assert (first["engine"], first["parallelism"], second["checkpoint_id"]) == ("spark", 3, 2)
    assert (scaled["to_parallelism"], scaled["bytes_downloaded"]) == (2, 0)
    assert (last["checkpoint_id"], last["parallelism"], last["engine"]) == (4, 2, "spark")
    meta = CheckpointStore(open_storage(store), "agg").latest()
    assert meta.state_backend == backend
    if backend == "memory":
        assert first["state_memory"]["held_bytes"] > 0
    state_db = ExternalStore(postgres_server.url, "connect_agg") if db else None
    outputs, reference = totals_reference(days)
    assert_totals_equal(final_state(store, "agg", state_db)["totals"], reference["totals"])
    for day in range(3):
        check_totals_output(read_output(out, f"run=day{day}"), outputs[day])
