"""The package as an Airflow provider: registered, and its operators usable in a DAG of
one's own.

The composed DAG runs a user's job on S3 (the moto server) with credentials only in an
Airflow AWS connection: the driver process has no AWS_* variable, so the Spark tasks
reach the storage only if the storage options travel inside the task parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from statebackend.airflow.provider import get_provider_info
from statebackend.job.publish import run_dir_name
from tests.jobs.run_reference import activity_events, activity_reference, final_state, read_output

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AIRFLOW = os.path.join(os.path.dirname(sys.executable), "airflow")
SECRET = f"secret-{uuid.uuid4().hex}"  # moto takes any keys; this one must never be logged

DAG_FILE = '''
from datetime import UTC, datetime

from airflow.sdk import DAG, Param

from statebackend.airflow.operators import (
    CkptGcOperator, CkptRescaleOperator, CkptRetainOperator, CkptRunJobOperator,
    CkptValidateOperator)
from statebackend.airflow.steps import RUN_KEY_TEMPLATE

S = {{"storage": "{storage}", "job": "activity", "storage_conn_id": "ckpt_s3"}}
with DAG("my_activity", schedule=None, start_date=datetime(2020, 1, 1, tzinfo=UTC),
         catchup=False, render_template_as_native_obj=True,
         params={{"p": Param(2, type="integer", minimum=1)}}):
    (CkptRunJobOperator(task_id="run", job_ref="examples.user_activity:job",
                        input_path="{data}/day={{{{ ds }}}}", output_path="{out}",
                        parallelism=2, master="local[2]", engine="auto", **S)
     >> CkptValidateOperator(task_id="validate", run_key=RUN_KEY_TEMPLATE,
                             job_ref="examples.user_activity:job", **S)
     >> CkptRescaleOperator(task_id="rescale", parallelism="{{{{ params.p }}}}",
                            master="local[2]", **S)
     >> CkptRetainOperator(task_id="retain", keep=2, **S)
     >> CkptGcOperator(task_id="gc", grace_seconds=0, **S))
'''


def airflow_env(home, dags, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags), "CKPT_JOBS_SKIP_VARIABLE": "1",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
            **extra}


def test_provider_info_matches_airflow_schema():
    import jsonschema
    from airflow import providers_manager

    schema_path = os.path.join(os.path.dirname(providers_manager.__file__),
                               "provider_info.schema.json")
    with open(schema_path, encoding="utf-8") as fh:
        jsonschema.validate(get_provider_info(), json.load(fh))
    assert get_provider_info()["package-name"] == "ckpt-lifecycle"


def test_airflow_providers_list_shows_the_provider(tmp_path):
    proc = subprocess.run([AIRFLOW, "providers", "list", "--output", "json"],
                          env=airflow_env(tmp_path / "home", tmp_path, {}),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = {p["package_name"]: p for p in json.loads(proc.stdout[proc.stdout.index("["):])}
    assert "ckpt-lifecycle" in listed, sorted(listed)


def test_installed_entry_points_are_the_projects():
    """Airflow reads entry points from the installed metadata: an install older than
    pyproject.toml hides the provider or the page (reinstall: `make install`)."""
    import tomllib
    from importlib.metadata import distribution

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        declared = tomllib.load(fh)["project"]["entry-points"]
    installed = distribution("ckpt-lifecycle").entry_points
    for group in ("apache_airflow_provider", "airflow.plugins"):
        found = {ep.name: ep.value for ep in installed.select(group=group)}
        assert found == declared[group], (
            f"installed entry points of {group!r} differ from pyproject.toml: reinstall")


def test_airflow_plugins_shows_the_page_once_from_the_entry_point(tmp_path):
    from statebackend.airflow.plugin import PLUGIN_NAME

    env = airflow_env(tmp_path / "home", tmp_path, {
        "AIRFLOW__CORE__PLUGINS_FOLDER": os.path.join(ROOT, "plugins")})
    proc = subprocess.run([AIRFLOW, "plugins", "--output", "json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = json.loads(proc.stdout[proc.stdout.index("["):])
    ours = [p for p in listed if p["name"] == PLUGIN_NAME]
    assert len(ours) == 1, listed
    assert "group='airflow.plugins'" in ours[0]["source"]
    assert "statebackend.airflow.plugin:CheckpointsPlugin" in ours[0]["source"]
    assert ours[0]["fastapi_apps"][0]["url_prefix"] == "/ckpt"
    assert "already registered" not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.s3
def test_own_dag_of_operators_runs_a_user_job_on_s3_through_a_connection(tmp_path, s3_server):
    storage = f"s3://ckpt-test/{uuid.uuid4().hex}"
    data, out, dags = tmp_path / "data", tmp_path / "out", tmp_path / "dags"
    dags.mkdir()
    frames = [activity_events(str(data / f"day=2027-01-0{d + 1}"), rows=800, users=60,
                              seed=70 + d, day=d) for d in range(2)]
    (dags / "my_activity.py").write_text(DAG_FILE.format(storage=storage, data=data, out=out))
    conn = {"conn_type": "aws", "login": "ckpt-test-key", "password": SECRET,
            "extra": {"endpoint_url": s3_server}}
    env = airflow_env(tmp_path / "home", dags, {"AIRFLOW_CONN_CKPT_S3": json.dumps(conn)})
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    log_path, result_path = tmp_path / "driver.log", tmp_path / "result.json"
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__),
                                                            "operators_driver.py"),
                               str(dags), str(result_path)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    text = log_path.read_text()
    assert proc.returncode == 0 and result_path.exists(), f"driver failed, log: {log_path}"
    got = json.loads(result_path.read_text())
    assert got["import_errors"] == {}
    assert got["aws_env_at_start"] == [] and got["aws_env_at_end"] == []
    for key in ("day1", "day2", "rerun_day2"):
        assert got[key]["state"] == "success", (key, got[key], str(log_path))
        assert set(got[key]["tasks"].values()) == {"success"}, got[key]
    assert SECRET not in text and "'ckpt_s3'" in text

    want_outputs, want_state = activity_reference(frames)
    for d, want in enumerate(want_outputs):
        run = run_dir_name(f"interval__2027-01-0{d + 1}T00:00:00+00:00")
        got_out = read_output(str(out), run).set_index("user").sort_index()
        assert list(got_out.index) == list(want.index)
        for column in want.columns:
            assert got_out[column].tolist() == want[column].tolist(), (d, column)
    assert final_state(storage, "activity") == want_state  # (this process: env credentials)
    from statebackend.checkpoint.runs import read_run_record
    from statebackend.checkpoint.store import CheckpointStore
    from statebackend.storage import open_storage

    # the operator's engine="auto": these small intervals ran in the task, no Spark job
    store = CheckpointStore(open_storage(storage), "activity")
    ledger = [read_run_record(store.storage, f"interval__2027-01-0{d + 1}T00:00:00+00:00")
              for d in range(2)]  # the ledger outlives the checkpoints retention retired
    assert [r.extra.get("engine") for r in ledger] == ["local", "local"]
