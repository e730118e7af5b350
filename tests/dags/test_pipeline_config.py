"""ckpt_jobs: loading, precedence, env expansion, refusal of bad definitions."""

from __future__ import annotations

import json

import pytest

from jobs import pipeline_config as pc
from jobs.pipeline_config import JobConfigError, load_job_specs, specs_from_config

BASE = {"defaults": {"storage": "file:///tmp/s", "spark": {"master": "local[2]"}},
        "jobs": {"clicks": {"input": "/in/day={{ ds }}", "output": "/out/{{ ds }}",
                            "parallelism": 2}}}


def test_defaults_merge_and_job_keys_win():
    data = json.loads(json.dumps(BASE))
    data["jobs"]["clicks"]["spark"] = {"mode": "submit"}
    (spec,) = specs_from_config(data)
    assert spec.name == "clicks" and spec.storage == "file:///tmp/s"
    assert spec.spark.mode == "submit" and spec.spark.master == "local[2]"
    assert spec.pipeline_dag_id == "clicks_pipeline"
    assert spec.rescale_dag_id == "clicks_rescale_restore"
    assert spec.maintenance_dag_id == "clicks_maintenance"
    assert spec.asset_uri == "file:///tmp/s/clicks"
    assert spec.start_datetime().tzinfo is not None


def test_env_expansion_with_defaults():
    data = {"jobs": {"j": {"input": "${D:-/d}/in", "output": "${D}/out",
                           "storage": "${S:-file:///x}"}}}
    (spec,) = specs_from_config(data, environ={"D": "/data"})
    assert (spec.input, spec.output, spec.storage) == ("/data/in", "/data/out", "file:///x")
    with pytest.raises(JobConfigError, match="environment variable D is not set"):
        specs_from_config(data, environ={})


@pytest.mark.parametrize("patch, message", [
    ({"parallelizm": 2}, "unknown setting"),
    ({"spark": {"mode": "yarn"}}, "spark.mode"),
    ({"spark": {"mastr": "x"}}, "spark has unknown"),
    ({"parallelism": 0}, "parallelism 0"),
    ({"parallelism": 200}, "parallelism 200"),
    ({"keep": 0}, "keep 0"),
    ({"output": ""}, "needs 'output'"),
    ({"start_date": "yesterday"}, "start_date"),
])
def test_bad_definitions_are_refused(patch, message):
    data = json.loads(json.dumps(BASE))
    data["jobs"]["clicks"].update(patch)
    with pytest.raises(JobConfigError, match=message):
        specs_from_config(data)


def test_bad_job_name_and_top_level_key():
    with pytest.raises(Exception, match="invalid"):
        specs_from_config({"jobs": {"../x": BASE["jobs"]["clicks"]}, "defaults": BASE["defaults"]})
    with pytest.raises(JobConfigError, match="top-level"):
        specs_from_config({**BASE, "job": {}})


def test_precedence_file_env_then_variable_then_default(tmp_path, monkeypatch):
    path = tmp_path / "jobs.yaml"
    path.write_text(json.dumps(BASE))
    monkeypatch.setenv("CKPT_JOBS_SKIP_VARIABLE", "1")
    monkeypatch.delenv("AIRFLOW_VAR_CKPT_JOBS", raising=False)
    monkeypatch.setenv(pc.CONFIG_ENV, str(path))
    assert [s.name for s in load_job_specs()] == ["clicks"]
    monkeypatch.delenv(pc.CONFIG_ENV)
    variable = {"jobs": {"other": {**BASE["jobs"]["clicks"], "storage": "file:///v"}}}
    monkeypatch.setenv("AIRFLOW_VAR_CKPT_JOBS", json.dumps(variable))
    assert [s.name for s in load_job_specs()] == ["other"]
    monkeypatch.delenv("AIRFLOW_VAR_CKPT_JOBS")
    assert "clicks" in [s.name for s in load_job_specs()]  # dags/ckpt_jobs.yaml
    monkeypatch.setenv(pc.CONFIG_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(JobConfigError, match="cannot be read"):
        load_job_specs()


def test_shipped_config_parses_with_and_without_env(monkeypatch):
    for var in ("CKPT_STORAGE", "CKPT_DATA", "CKPT_SPARK_MODE", "CKPT_SPARK_MASTER"):
        monkeypatch.delenv(var, raising=False)
    (spec,) = load_job_specs(pc.DEFAULT_CONFIG)
    assert spec.spark.mode == "local" and spec.storage_conn_id is None
    monkeypatch.setenv("CKPT_STORAGE", "s3://bucket/ckpt")
    monkeypatch.setenv("CKPT_SPARK_MODE", "submit")
    monkeypatch.setenv("CKPT_STORAGE_CONN_ID", "ckpt_s3")
    (spec,) = load_job_specs(pc.DEFAULT_CONFIG)
    assert spec.asset_uri == "s3://bucket/ckpt/clicks"
    assert spec.spark.mode == "submit" and spec.storage_conn_id == "ckpt_s3"
