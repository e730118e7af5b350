"""End to end: the three DAGs run with ``dag.test`` against a migrated SQLite Airflow.

Two pipeline intervals, a re-run of the first (nothing counted twice), the
rescale-restore DAG with bad params (refused by the params schema before a run
exists), a dry run and a real rescale, then maintenance. The final state must
equal the pandas reference over the two intervals' events.

A user's job (`examples.user_activity:job`, with a job option) configured in the
same ``ckpt_jobs`` runs through its own pipeline DAG: three intervals and a re-run;
each run's output and the final state equal the pandas reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg
import pytest

from demo.sample_data import DAY_MS, expected_totals, generate_events
from statebackend.checkpoint.store import CheckpointStore
from statebackend.job.publish import run_dir_name
from statebackend.state.external_store import ExternalStore
from statebackend.storage import open_storage
from tests.jobs.run_reference import (
    activity_events,
    activity_reference,
    assert_totals_equal,
    final_state,
    read_output,
    totals_reference,
)

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAGS = os.path.join(ROOT, "dags")
START_MS = 1_798_761_600_000  # 2027-01-01T00:00:00Z


def airflow_env(home: str, extra: dict) -> dict:
    return {**os.environ, "AIRFLOW_HOME": home, "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": DAGS,
            "AIRFLOW__CORE__PLUGINS_FOLDER": os.path.join(ROOT, "plugins"),
            "AIRFLOW__CORE__PARALLELISM": "4", "CKPT_JOBS_SKIP_VARIABLE": "1", **extra}


# The same job and input on the two other state backends: their pipelines, a rescale
# and maintenance (validation, retention with the database's vacuum, GC) under Airflow.
OTHER_BACKENDS = {"clicks_mem": {"backend": "memory", "memory_limit_mb": 64},
                  "clicks_ext": {"backend": "external", "state_db_conn_id": "ckpt_state",
                                 "state_table": "e2e_clicks", "keep": 1}}


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, postgres_server):
    base = tmp_path_factory.mktemp("e2e")
    home, data = base / "airflow_home", base / "data"
    frames = []
    for d, label in enumerate(("2027-01-01", "2027-01-02")):
        frames.append(generate_events(str(data / "events" / f"day={label}"), n_events=3000,
                                      n_keys=400, seed=11 + d, start_ts_ms=START_MS + d * DAY_MS))
    activity = [activity_events(str(data / "activity" / f"day=2027-01-0{d + 1}"), rows=1500,
                                users=120, seed=40 + d, day=d) for d in range(3)]
    config = base / "ckpt_jobs.yaml"
    # clicks takes the default engine choice (auto: these small intervals run in the
    # task, no JVM), activity runs on Spark: both engines under Airflow
    config.write_text(json.dumps({"defaults": {"spark": {"master": "local[2]"},
                                               "engine": "auto"}, "jobs": {
        "clicks": {"input": f"{data}/events/day={{{{ ds }}}}",
                   "output": f"{data}/out/day={{{{ ds }}}}",
                   "storage": f"file://{base}/store", "parallelism": 2, "keep": 5,
                   "start_date": "2027-01-01",  # after "now": manual runs must still run
                   "retries": 0},
        **{name: {"input": f"{data}/events/day={{{{ ds }}}}",
                  "output": f"{data}/{name}_out/day={{{{ ds }}}}",
                  "storage": f"file://{base}/store", "parallelism": 2, "keep": 5,
                  "start_date": "2027-01-01", "retries": 0, **settings}
           for name, settings in OTHER_BACKENDS.items()},
        "activity": {"job": "examples.user_activity:job",
                     "options": {"normalize_case": False},
                     "input": f"{data}/activity/day={{{{ ds }}}}",
                     "output": f"{data}/activity_out", "storage": f"file://{base}/store",
                     "parallelism": 3, "start_date": "2027-01-01", "retries": 0,
                     "engine": "spark"}}}))
    # the external backend's credentials: an Airflow connection (here from Airflow's own
    # environment variable form), never an option of the job
    env = airflow_env(str(home), {"CKPT_JOBS_FILE": str(config),
                                  "AIRFLOW_CONN_CKPT_STATE": postgres_server.url})
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "airflow"), "db", "migrate"],
                   env=env, check=True, capture_output=True, timeout=300)
    log_path, result_path = base / "driver.log", base / "result.json"
    with open(log_path, "w") as log:  # task logs of every dag.test run (kept on failure)
        proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__),
                                                            "e2e_driver.py"), DAGS,
                               str(result_path)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    assert proc.returncode == 0 and result_path.exists(), f"driver failed, log: {log_path}"
    result = json.loads(result_path.read_text())
    result["log"] = str(log_path)
    result["activity"] = {"frames": activity, "output": str(data / "activity_out"),
                          "storage": f"file://{base}/store"}
    result["engines"] = {job: CheckpointStore(open_storage(f"file://{base}/store"), job)
                         .load(1).extra.get("engine") for job in ("clicks", "activity")}
    result["other_backends"] = {
        name: final_state(f"file://{base}/store", name, ExternalStore(
            postgres_server.url, settings["state_table"]) if "state_table" in settings else None)
        for name, settings in OTHER_BACKENDS.items()}
    with psycopg.connect(postgres_server.url) as conn:  # what retention left of the rows
        result["external_rows"] = conn.execute("SELECT count(*) FROM e2e_clicks").fetchone()[0]
    return result, frames


def test_pipeline_runs_two_intervals(e2e):
    out, _ = e2e
    assert out["import_errors"] == {}
    for key in ("day1", "day2"):
        assert out[key]["state"] == "success", (out[key], out["log"])
        assert set(out[key]["tasks"].values()) == {"success"}, out[key]
    assert out["after_day1"] == [{"id": 1, "kind": "checkpoint", "parallelism": 2,
                                  "run_id": "interval__2027-01-01T00:00:00+00:00"}]
    assert out["engines"] == {"clicks": "local", "activity": "spark"}


def test_rerun_of_first_interval_counts_nothing_twice(e2e):
    out, _ = e2e
    assert out["rerun_day1"]["state"] == "success"
    assert out["rerun_day1"]["run_id"] != out["day1"]["run_id"]  # a new Airflow run ...
    assert [c["id"] for c in out["after_rerun"]] == [1, 2]  # ... but no new checkpoint


def test_rescale_bad_params_are_refused_before_a_run_exists(e2e):
    out, _ = e2e
    for key, word in (("rescale_bad_zero", "parallelism"), ("rescale_bad_type", "parallelism"),
                      ("rescale_bad_ref", "checkpoint")):
        assert out[key].get("error_type") == "ParamValidationError", out[key]
        assert word in out[key]["error"]
    assert out["after_bad"] == out["after_rerun"]


def test_rescale_dry_run_then_real(e2e):
    out, _ = e2e
    assert out["rescale_dry"]["state"] == "success", out["rescale_dry"]
    assert out["rescale"]["state"] == "success", out["rescale"]
    assert set(out["rescale"]["tasks"]) == {"check_no_running_pipeline", "rescale", "validate"}
    last = out["after_rescale"][-1]
    assert (last["id"], last["kind"], last["parallelism"]) == (3, "rescale", 3)
    assert len(out["after_rescale"]) == 3  # the dry run committed nothing


def test_reports_dag_renders_the_data_docs_the_pipeline_left_out(e2e):
    """The pipeline's validate decides without GE (no Data Docs); the DAG scheduled on
    its Asset renders them for the checkpoint it published, off the pipeline's path."""
    out, _ = e2e
    before, after = out["report_before"], out["report_after"]
    assert before["success"] is True and not before.get("data_docs_index"), before
    assert out["reports"]["state"] == "success", (out["reports"], out["log"])
    assert out["reports"]["tasks"] == {"render_report": "success"}
    assert after["success"] is True and after["checkpoint_id"] == 2
    assert after["data_docs_index"] and os.path.exists(after["data_docs_index"]
                                                       .removeprefix("file://")), after


def test_maintenance_writes_full_report(e2e):
    """Maintenance validates the latest checkpoint at the full level (every entry)."""
    out, _ = e2e
    assert out["maintenance"]["state"] == "success", out["maintenance"]
    report = out["latest_report"]
    assert report["success"] is True and report["deep"] is True and report["checkpoint_id"] == 3
    assert report["level"] == "full"


def test_final_state_equals_pandas_reference(e2e):
    out, frames = e2e
    want = expected_totals(frames)
    got = out["state"]
    assert sorted(got) == sorted(want.index)
    for key, row in want.iterrows():
        count, total, min_ts, max_ts = got[key]
        assert count == int(row["count"]) and min_ts == int(row["min_ts"])
        assert max_ts == int(row["max_ts"]) and abs(total - float(row["sum"])) < 1e-6


def test_user_job_runs_through_its_pipeline_dag_like_the_pandas_reference(e2e):
    out, _ = e2e
    for key in ("activity_day1", "activity_day2", "activity_rerun_day1", "activity_day3"):
        assert out[key]["state"] == "success", (key, out[key], out["log"])
        assert set(out[key]["tasks"].values()) == {"success"}, out[key]
    assert [c["id"] for c in out["after_activity_rerun_day1"]] == [1, 2]  # re-run: skipped
    assert [(c["id"], c["parallelism"]) for c in out["after_activity_day3"]] == [
        (1, 3), (2, 3), (3, 3)]
    act = out["activity"]
    # normalize_case false (the job option from ckpt_jobs): categories keep their case
    want_outputs, want_state = activity_reference(act["frames"], normalize=False)
    for d, want in enumerate(want_outputs):
        key = f"interval__2027-01-0{d + 1}T00:00:00+00:00"
        got = read_output(act["output"], run_dir_name(key)).set_index("user").sort_index()
        assert list(got.index) == list(want.index), d
        for column in want.columns:
            assert got[column].tolist() == want[column].tolist(), (d, column)
    assert final_state(act["storage"], "activity") == want_state


@pytest.mark.parametrize("name", sorted(OTHER_BACKENDS))
def test_the_other_backends_through_their_dags_like_the_pandas_reference(e2e, name):
    """On the memory and the external backend (its database from an Airflow connection):
    two intervals, a re-run, a rescale to 3 and maintenance all succeed; the final state
    equals pandas."""
    out, frames = e2e
    got = out[name]
    for key in ("day1", "day2", "rerun_day1", "rescale", "maintenance"):
        assert got[key]["state"] == "success", (name, key, got[key], out["log"])
        assert set(got[key]["tasks"].values()) == {"success"}, (name, key, got[key])
    backend = OTHER_BACKENDS[name]["backend"]
    assert [(c["id"], c["kind"], c["parallelism"], c["backend"]) for c in got["after"]][-1] \
        == (3, "rescale", 3, backend)
    assert [c["id"] for c in got["after_day2"]] == ([1, 2] if backend == "memory" else [2])
    assert got["report"]["success"] is True and got["report"]["level"] == "full", got["report"]
    want = totals_reference(frames)[1]["totals"]
    assert_totals_equal(out["other_backends"][name]["totals"], want)
    if backend == "external":  # keep 1: the tasks' retention vacuumed the database down
        assert out["external_rows"] == len(want)  # to the latest version's, one per key
        assert [c["id"] for c in got["after"]] == [3]
