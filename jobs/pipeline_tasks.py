"""What the Airflow tasks of the checkpoint DAGs do, callable and testable without Airflow.

Each step takes a `JobSpec` (see jobs/pipeline_config.py) plus the few run values
Airflow supplies (logical date, run id, params) and returns a JSON-able dict that
becomes the task's XCom. DAG files only wire these together.

- `run_pipeline_job`   the keyed aggregation over the interval's input (in-process Spark)
- `validate_step`      validate the checkpoint a run committed (found by its run key)
- `retain_step`        keep the newest N checkpoints (plus savepoints and leases)
- `gc_step`            delete shared files nothing references (orphans after a grace period)
- `rescale_step`       rescale-restore a checkpoint to another parallelism
- `check_no_running_pipeline`  refuse a rescale while the pipeline DAG runs

Idempotency: the run key handed to the Spark job is ``interval__<logical date>``
(``run_key``), so a retry, a cleared run, a backfill or a manual re-run of the same
interval finds the checkpoint already committed and counts nothing twice. Runs
without a logical date fall back to the Airflow run id.

Storage credentials come from an Airflow connection (AWS type: login = access key,
password = secret key, extra ``endpoint_url`` / ``region_name``) and are exported
to ``AWS_*`` environment variables of the task process; values are never logged
or returned, only the names of the variables set.

Heavy modules (pyspark, great_expectations, rocksdict, pandas) are imported inside
the functions: DAG files import this module at parse time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import datetime

from statebackend.errors import CkptError

from .pipeline_config import JobSpec

log = logging.getLogger(__name__)

RUN_KEY_PREFIX = "interval__"


class PipelineRefusedError(CkptError):
    """A step refuses to run now (e.g. a rescale while the pipeline DAG runs)."""

    exit_code = 1


class ValidationFailedError(CkptError):
    """The validation of a checkpoint found critical breaks."""

    exit_code = 1


# -- run values --------------------------------------------------------------
def run_key(logical_date: datetime | str | None, airflow_run_id: str) -> str:
    """The idempotency key of a pipeline run: one per data interval."""
    if logical_date is None or logical_date == "":
        return airflow_run_id
    text = logical_date if isinstance(logical_date, str) else logical_date.isoformat()
    return f"{RUN_KEY_PREFIX}{text}"


def render(template: str | None, values: dict) -> str | None:
    """Render the Jinja fields of a configured path (``{{ ds }}``, ``{{ ts }}`` ...)."""
    if template is None or "{" not in template:
        return template
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
    try:
        return env.from_string(template).render(**values)
    except jinja2.TemplateError as exc:
        raise CkptError(f"path template {template!r} cannot be rendered ({exc}); "
                        f"available fields: {sorted(values)}") from exc


def template_values(logical_date: datetime | None, airflow_run_id: str) -> dict:
    values = {"run_id": airflow_run_id}
    if logical_date is not None:
        values.update(ds=logical_date.strftime("%Y-%m-%d"),
                      ds_nodash=logical_date.strftime("%Y%m%d"),
                      ts=logical_date.isoformat(),
                      ts_nodash=logical_date.strftime("%Y%m%dT%H%M%S"))
    return values


# -- credentials ---------------------------------------------------------------
def export_storage_credentials(spec: JobSpec, get_connection: Callable | None = None,
                               environ: dict | None = None) -> list[str]:
    """Export the job's storage connection to AWS_* variables; return the names set."""
    if not spec.storage_conn_id:
        return []
    env = os.environ if environ is None else environ
    if get_connection is None:
        from airflow.sdk import BaseHook

        get_connection = BaseHook.get_connection
    conn = get_connection(spec.storage_conn_id)
    extra = conn.extra_dejson if hasattr(conn, "extra_dejson") else dict(conn.extra or {})
    values = {
        "AWS_ACCESS_KEY_ID": conn.login,
        "AWS_SECRET_ACCESS_KEY": conn.password,
        "AWS_SESSION_TOKEN": extra.get("aws_session_token"),
        "AWS_ENDPOINT_URL": extra.get("endpoint_url")
        or (extra.get("service_config") or {}).get("s3", {}).get("endpoint_url"),
        "AWS_DEFAULT_REGION": extra.get("region_name"),
    }
    names = []
    for name, value in values.items():
        if value:
            env[name] = str(value)
            names.append(name)
    log.info("storage connection %r exported to %s", spec.storage_conn_id, ", ".join(names))
    return names


# -- storage -------------------------------------------------------------------
def open_store(spec: JobSpec):
    from statebackend.checkpoints import CheckpointStore
    from statebackend.storage import open_storage

    return CheckpointStore(open_storage(spec.storage), spec.name)


def checkpoint_facts(meta) -> dict:
    """The few figures of a checkpoint that DAGs publish (XCom, Asset event extra)."""
    s = meta.summary()
    return {key: s[key] for key in ("id", "kind", "run_id", "parallelism", "max_parallelism",
                                    "bytes_referenced", "bytes_uploaded", "rows", "created_at",
                                    "parent")}


# -- steps ---------------------------------------------------------------------
def build_job_config(spec: JobSpec, *, logical_date: datetime | None, airflow_run_id: str,
                     parallelism: int | None = None, local_dir: str | None = None):
    """The keyed aggregation's JobConfig for one interval of ``spec``."""
    from jobs.keyed_aggregation import JobConfig

    values = template_values(logical_date, airflow_run_id)
    return JobConfig(
        input=render(spec.input, values), storage=spec.storage, job=spec.name,
        run_id=run_key(logical_date, airflow_run_id), output=render(spec.output, values),
        parallelism=parallelism or spec.parallelism, max_parallelism=spec.max_parallelism,
        master=spec.spark.master, max_reject_fraction=spec.max_reject_fraction,
        quarantine=render(spec.quarantine, values), start_from=spec.start_from,
        local_dir=local_dir)


def spark_submit_args(spec: JobSpec) -> list[str]:
    """application_args for spark-submit (Airflow renders the Jinja fields)."""
    key = "{{ 'interval__' ~ ts if logical_date else run_id }}"
    args = ["--input", spec.input, "--storage", spec.storage, "--job", spec.name,
            "--run-id", key, "--output", spec.output, "--master", spec.spark.master,
            "--max-parallelism", str(spec.max_parallelism),
            "--max-reject-fraction", str(spec.max_reject_fraction), "--json"]
    if spec.parallelism:
        args += ["--parallelism", str(spec.parallelism)]
    if spec.quarantine:
        args += ["--quarantine", spec.quarantine]
    if spec.start_from:
        args += ["--start-from", spec.start_from]
    return args


def job_application() -> str:
    """Path of the spark-submit-able job module."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "keyed_aggregation.py")


def run_pipeline_job(spec: JobSpec, *, logical_date: datetime | None, airflow_run_id: str,
                     spark=None) -> dict:
    """Run one interval in this process; the job itself skips a run key already committed."""
    from jobs.keyed_aggregation import run

    config = build_job_config(spec, logical_date=logical_date, airflow_run_id=airflow_run_id)
    if not os.path.exists(config.input) and "://" not in config.input:
        raise CkptError(f"input {config.input} of job {spec.name!r} does not exist; check the "
                        "'input' pattern in ckpt_jobs and that the interval's data landed")
    summary = dict(run(config, spark=spark))
    log.info("job %s run %s: %s", spec.name, config.run_id,
             {k: summary.get(k) for k in ("checkpoint_id", "events_read", "events_rejected",
                                          "keys_touched", "bytes_uploaded", "skipped")})
    summary.setdefault("run_id", config.run_id)
    return summary


def _validation_dict(result) -> dict:
    """A compact result (the full summary stays in the stored report, not in XCom)."""
    summary = result.summary or {}
    return {"success": bool(result.success), "checkpoint_id": result.checkpoint_id,
            "deep": summary.get("deep"), "critical_failures": summary.get("critical_failures"),
            "failed_checks": list(summary.get("failed_checks") or [])[:20],
            "figures": summary.get("figures"), "report_location": result.report_location,
            "data_docs_index": result.data_docs_index}


def validate_step(spec: JobSpec, *, run_id: str | None = None, ref: str | int = "latest",
                  deep: bool = False) -> dict:
    """Validate the checkpoint committed by ``run_id`` (or ``ref``); raise if it fails."""
    from statebackend.validate import validate_checkpoint

    store = open_store(spec)
    if run_id is not None:
        meta = store.find_by_run_id(run_id)
        if meta is None:
            raise CkptError(f"no checkpoint of job {spec.name!r} was committed by run {run_id!r}; "
                            "the job task did not finish or retention already removed it")
    else:
        meta = store.resolve(ref)
    result = _validation_dict(validate_checkpoint(store, meta.checkpoint_id, deep=deep))
    result["checkpoint"] = checkpoint_facts(meta)
    if not result["success"]:
        raise ValidationFailedError(
            f"checkpoint {meta.checkpoint_id} of job {spec.name!r} failed validation; report: "
            f"{result['data_docs_index'] or result['report_location']}")
    return result


def retain_step(spec: JobSpec, *, keep: int | None = None, dry_run: bool = False) -> dict:
    from statebackend.retention import retain

    return retain(open_store(spec), keep or spec.keep, dry_run=dry_run).to_json()


def gc_step(spec: JobSpec, *, grace_seconds: float | None = None, dry_run: bool = False) -> dict:
    from statebackend.gc import collect_garbage

    grace = spec.gc_grace_seconds if grace_seconds is None else grace_seconds
    return collect_garbage(open_store(spec), grace_seconds=float(grace), dry_run=dry_run).to_json()


def rescale_step(spec: JobSpec, *, parallelism: int, checkpoint: str | int = "latest",
                 dry_run: bool = False, spark=None) -> dict:
    from statebackend.rescale import rescale

    if not isinstance(parallelism, int) or not 1 <= parallelism <= spec.max_parallelism:
        raise CkptError(f"parallelism {parallelism!r} must be an integer in "
                        f"1..{spec.max_parallelism} (the job's max parallelism)")
    return rescale(open_store(spec), checkpoint, parallelism, master=spec.spark.master,
                   spark=spark, dry_run=dry_run)


def check_no_running_pipeline(spec: JobSpec, count_running: Callable[[str], int]) -> dict:
    """Refuse while ``<job>_pipeline`` has a running or queued run."""
    dag_id = spec.pipeline_dag_id
    running = int(count_running(dag_id))
    if running:
        raise PipelineRefusedError(
            f"DAG {dag_id} has {running} active run(s); a rescale-restore would race with it. "
            f"Pause {dag_id}, wait for the run to finish, then trigger the rescale again")
    return {"pipeline_dag_id": dag_id, "active_runs": 0}


def publish_extra(validation: dict) -> dict:
    """The Asset event extra of a published checkpoint (small, JSON)."""
    chk = validation.get("checkpoint") or {}
    return {"checkpoint_id": chk.get("id"), "run_id": chk.get("run_id"),
            "parallelism": chk.get("parallelism"), "bytes_referenced": chk.get("bytes_referenced"),
            "bytes_uploaded": chk.get("bytes_uploaded"), "validated": validation.get("success"),
            "report": validation.get("data_docs_index") or validation.get("report_location")}


def spark_submit_operator(spec: JobSpec, *, task_id: str, **kwargs):
    """A SparkSubmitOperator running the job on ``spec.spark`` (submit mode).

    The storage connection is exported in ``execute`` (the spark-submit process
    inherits the environment), so no secret ends up in rendered template fields.
    """
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    class CkptSparkSubmitOperator(SparkSubmitOperator):
        def execute(self, context):
            export_storage_credentials(spec)
            return super().execute(context)

    conf = {"spark.ui.enabled": "false", **{k: str(v) for k, v in spec.spark.conf.items()}}
    return CkptSparkSubmitOperator(
        task_id=task_id, application=job_application(), conn_id=spec.spark.conn_id,
        application_args=spark_submit_args(spec), conf=conf, name=f"ckpt-{spec.name}",
        env_vars={"PYTHONUNBUFFERED": "1"}, **kwargs)


def state_totals(spec: JobSpec, ref: str | int = "latest"):
    """The ``totals`` state of a checkpoint as a pandas frame (key -> count, sum, min_ts, max_ts).

    Same shape as jobs.sample_data.expected_totals, for checks and the demo.
    """
    import pandas as pd

    from statebackend.dump import checkpoint_rows

    store = open_store(spec)
    meta = store.resolve(ref)
    records = []
    for row in checkpoint_rows(store, meta):
        if row["state"] != "totals":
            continue
        value = row["value"]
        if not isinstance(value, dict):
            value = dict(zip(("count", "sum", "min_ts", "max_ts"), value, strict=False))
        records.append({"key": str(row["key"]), **value})
    frame = pd.DataFrame.from_records(records, columns=["key", "count", "sum", "min_ts", "max_ts"])
    return frame.set_index("key").sort_index()
