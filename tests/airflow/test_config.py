"""ckpt_jobs: loading, precedence, env expansion, job and options, library defaults,
refusal of bad definitions."""

from __future__ import annotations

import json
import os

import pytest

from statebackend import defaults
from statebackend.airflow import config as pc
from statebackend.airflow.config import JobConfigError, load_job_specs, specs_from_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(ROOT, "dags", "ckpt_jobs.yaml")

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
    assert spec.reports_dag_id == "clicks_reports"
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
    ({"job": "jobs/x.py"}, "must be a built-in job name or package.module:attribute"),
    ({"job": "a.b:"}, "'job'"),
    ({"options": ["normalize_case"]}, "'options' must be a mapping"),
    ({"engine": "turbo"}, "engine 'turbo' is not one of"),
    ({"engine": "local", "spark": {"mode": "submit"}}, "engine 'local' runs in the Airflow task"),
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
    assert "clicks" in [s.name for s in load_job_specs(default=SHIPPED)]  # the DAG files' default
    monkeypatch.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(tmp_path))  # else the DAGs folder's
    (tmp_path / "ckpt_jobs.yaml").write_text(json.dumps(variable))
    assert [s.name for s in load_job_specs()] == ["other"]
    monkeypatch.setenv(pc.CONFIG_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(JobConfigError, match="cannot be read"):
        load_job_specs()


def test_shipped_config_parses_with_and_without_env(monkeypatch):
    for var in ("CKPT_STORAGE", "CKPT_DATA", "CKPT_SPARK_MODE", "CKPT_SPARK_MASTER"):
        monkeypatch.delenv(var, raising=False)
    (spec,) = load_job_specs(SHIPPED)
    assert spec.spark.mode == "local" and spec.storage_conn_id is None
    assert spec.job == "keyed_aggregation" and spec.options == {}
    monkeypatch.setenv("CKPT_STORAGE", "s3://bucket/ckpt")
    monkeypatch.setenv("CKPT_SPARK_MODE", "submit")
    monkeypatch.setenv("CKPT_STORAGE_CONN_ID", "ckpt_s3")
    (spec,) = load_job_specs(SHIPPED)
    assert spec.asset_uri == "s3://bucket/ckpt/clicks"
    assert spec.spark.mode == "submit" and spec.storage_conn_id == "ckpt_s3"


def test_unset_settings_take_the_library_defaults():
    (spec,) = specs_from_config(BASE)
    assert (spec.keep, spec.gc_grace_seconds, spec.max_parallelism, spec.max_reject_fraction) \
        == (defaults.RETENTION_KEEP, defaults.GC_GRACE_SECONDS, defaults.MAX_PARALLELISM,
            defaults.MAX_REJECT_FRACTION)
    assert spec.job == "keyed_aggregation" and spec.options == {}


def test_defaults_are_defined_once():
    """The CLI, the run config and the lifecycle read statebackend.defaults (same values)."""
    from statebackend.cli.app import build_parser
    from statebackend.job.config import RunConfig
    from statebackend.lifecycle.gc import DEFAULT_GRACE_SECONDS
    from statebackend.state.keygroups import DEFAULT_MAX_PARALLELISM

    config = RunConfig(input="i", storage="s", run_id="r")
    assert config.max_parallelism == defaults.MAX_PARALLELISM == DEFAULT_MAX_PARALLELISM
    assert config.max_reject_fraction == defaults.MAX_REJECT_FRACTION
    assert DEFAULT_GRACE_SECONDS == defaults.GC_GRACE_SECONDS
    args = build_parser().parse_args(["--storage", "s", "run", "examples.user_activity:job",
                                      "--input", "i", "--run-id", "r"])
    assert args.max_parallelism == defaults.MAX_PARALLELISM
    assert args.max_reject_fraction == defaults.MAX_REJECT_FRACTION


def test_job_names_a_builtin_or_module_attribute():
    data = json.loads(json.dumps(BASE))
    data["jobs"]["mine"] = {**data["jobs"]["clicks"], "job": "examples.user_activity:job",
                            "options": {"normalize_case": False}}
    clicks, mine = specs_from_config(data)
    assert clicks.job_ref() == "jobs.keyed_aggregation:JOB"  # the entry point of the package
    assert mine.job_ref() == "examples.user_activity:job"
    assert mine.options == {"normalize_case": False}
    data["jobs"]["clicks"]["job"] = "sessionz"
    (spec, _) = specs_from_config(data)
    with pytest.raises(JobConfigError) as err:
        spec.job_ref()
    assert "'sessionz' is neither a built-in job [" in str(err.value)
    assert "'keyed_aggregation'" in str(err.value)
    assert "ckpt_jobs entry 'clicks'" in str(err.value) and "\n" not in str(err.value)


def test_builtin_jobs_come_from_entry_points_not_from_the_library():
    assert pc.builtin_jobs()["keyed_aggregation"] == "jobs.keyed_aggregation:JOB"


def test_packaged_default_is_used_when_the_deployment_has_no_file(tmp_path, monkeypatch):
    from statebackend.airflow import config

    monkeypatch.delenv(config.CONFIG_ENV, raising=False)
    monkeypatch.delenv("AIRFLOW_VAR_CKPT_JOBS", raising=False)
    monkeypatch.setenv("CKPT_JOBS_SKIP_VARIABLE", "1")
    where, text = config.config_source(default=str(tmp_path / "nowhere" / "ckpt_jobs.yaml"))
    assert where.endswith("(packaged default)")
    specs = config.specs_from_config(config.parse_config_text(text, where), where)
    assert [s.name for s in specs] == ["clicks"] and specs[0].job == "keyed_aggregation"
