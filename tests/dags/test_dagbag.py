"""Every DAG file loads in a DagBag without errors, fast, without heavy imports."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime

import pytest

# Airflow reads AIRFLOW_HOME once, at first import: never let it default to ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="ckpt-airflow-home-"))
os.environ.setdefault("CKPT_JOBS_SKIP_VARIABLE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAGS = os.path.join(ROOT, "dags")
HEAVY = ("pyspark", "great_expectations", "rocksdict", "pandas", "numpy", "pyarrow")
DAG_FILES = sorted(f for f in os.listdir(DAGS) if f.endswith(".py"))

PROBE = r"""
import json, os, sys, time
from airflow.dag_processing.dagbag import DagBag
before = set(sys.modules)
out = {}
for name in sys.argv[2:]:
    started = time.perf_counter()
    bag = DagBag(dag_folder=os.path.join(sys.argv[1], name))
    out[name] = {"seconds": time.perf_counter() - started, "dags": sorted(bag.dags),
                 "errors": {k: str(v) for k, v in bag.import_errors.items()}}
new = sorted({m.split(".")[0] for m in set(sys.modules) - before})
print("RESULT" + json.dumps({"files": out, "new_modules": new}))
"""


@pytest.fixture(scope="module")
def dagbag_result(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow_home")
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": DAGS, "CKPT_JOBS_FILE": os.path.join(DAGS,
                                                                              "ckpt_jobs.yaml")}
    proc = subprocess.run([sys.executable, "-c", PROBE, DAGS, *DAG_FILES], env=env,
                          capture_output=True, text=True, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


def test_every_dag_file_loads_without_errors_in_under_2s(dagbag_result):
    files = dagbag_result["files"]
    assert set(files) == set(DAG_FILES) and len(DAG_FILES) == 3
    for name, res in files.items():
        assert res["errors"] == {}, name
        assert res["seconds"] < 2.0, (name, res["seconds"])
    dag_ids = sorted(d for res in files.values() for d in res["dags"])
    assert dag_ids == ["clicks_maintenance", "clicks_pipeline", "clicks_reports",
                       "clicks_rescale_restore"]


def test_loading_dags_imports_nothing_heavy(dagbag_result):
    assert not set(dagbag_result["new_modules"]) & set(HEAVY), dagbag_result["new_modules"]


@pytest.mark.parametrize("name", DAG_FILES)
def test_dag_files_have_no_heavy_top_level_imports(name):
    tree = ast.parse(open(os.path.join(DAGS, name), encoding="utf-8").read())
    for node in tree.body:  # module level only: task bodies import lazily
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [node.module or ""]
        for mod in mods:
            assert mod.split(".")[0] not in HEAVY, (name, mod)
            assert mod not in ("statebackend.airflow.steps", "jobs.keyed_aggregation"), \
                (name, mod)


def test_dag_shapes_params_and_retries():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=DAGS)
    pipe = bag.dags["clicks_pipeline"]
    assert pipe.max_active_runs == 1
    assert [t.task_id for t in pipe.topological_sort()] == ["run_job", "validate", "retain", "gc"]
    run_job = pipe.get_task("run_job")
    assert run_job.retries == 2 and run_job.retry_exponential_backoff == 2.0
    outlets = pipe.get_task("validate").outlets
    assert [a.name for a in outlets] == ["ckpt_clicks"]
    res = bag.dags["clicks_rescale_restore"]
    # Manual runs are created "now": a future start_date would leave them without tasks.
    assert res.start_date <= datetime.now(UTC)
    assert all(t.start_date is None or t.start_date <= datetime.now(UTC) for t in res.tasks)
    assert res.schedule is None if hasattr(res, "schedule") else True
    assert set(res.params) == {"parallelism", "checkpoint", "dry_run"}
    schema = res.params.get_param("parallelism").schema
    assert schema["type"] == "integer" and schema["minimum"] == 1 and schema["maximum"] == 128
    assert res.params["checkpoint"] == "latest" and res.params["dry_run"] is False
    order = [t.task_id for t in res.topological_sort()]
    assert order.index("check_no_running_pipeline") < order.index("rescale") < order.index(
        "validate")
    # the Data Docs off the pipeline's path: a DAG on the Asset its validate publishes,
    # while the pipeline's verdict imports no GE
    assert pipe.get_task("validate").report == "none"
    reports = bag.dags["clicks_reports"]
    assert [a.name for a in reports.timetable.asset_condition.objects] == ["ckpt_clicks"]
    assert [t.task_id for t in reports.tasks] == ["render_report"]
    assert reports.max_active_runs == 1 and reports.get_task("render_report").retries == 1
    maint = bag.dags["clicks_maintenance"]
    assert [t.task_id for t in maint.topological_sort()] == ["retain", "gc",
                                                             "validate_latest_deep"]
    assert maint.get_task("validate_latest_deep").level == "full"


def test_submit_mode_uses_spark_submit_operator(monkeypatch):
    monkeypatch.setenv("CKPT_SPARK_MODE", "submit")
    monkeypatch.setenv("CKPT_SPARK_MASTER", "spark://spark-master:7077")
    monkeypatch.setenv("CKPT_STORAGE", "s3://ckpt/checkpoints")
    monkeypatch.setenv("CKPT_STORAGE_CONN_ID", "ckpt_s3")
    from airflow.dag_processing.dagbag import DagBag
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    bag = DagBag(dag_folder=os.path.join(DAGS, "ckpt_pipeline.py"))
    assert bag.import_errors == {}
    op = bag.dags["clicks_pipeline"].get_task("run_job")
    assert isinstance(op, SparkSubmitOperator)
    assert op.retries == 2
    args = op.application_args
    assert args[args.index("--storage") + 1] == "s3://ckpt/checkpoints"
    assert args[args.index("--master") + 1] == "spark://spark-master:7077"
    assert "application_args" in op.template_fields
    assert not any("secret" in str(v).lower() for v in (op.env_vars or {}).values())
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(
        {"conn_type": "spark", "host": "spark://spark-master", "port": 7077,
         "extra": {"deploy-mode": "client", "spark-binary": "spark-submit"}}))
    hook = SparkSubmitHook(conf=op.conf, conn_id=op._conn_id, name=op.name,
                           application_args=op.application_args)
    cmd = hook._build_spark_submit_command(op.application)
    assert cmd[:3] == ["spark-submit", "--master", "spark://spark-master:7077"]
    assert cmd[cmd.index("--deploy-mode") + 1] == "client"
    app = cmd.index(op.application)
    assert op.application.endswith("statebackend/cli/submit.py")
    assert cmd[app + 1] == "jobs.keyed_aggregation:JOB"  # the configured job, then its args
