"""What the checkpoint tasks do, callable and testable without Airflow.

Two layers. The operators (`statebackend.airflow.operators`) call the first,
which takes plain values; the second takes a configured `JobSpec` (what the DAG
factory and the Checkpoints page hold) and calls the first:

- `run_job_once(job_ref, config)`      load the job named by the *configuration*,
                                        run one interval (`statebackend.job.run_job`)
- `validate_store` / `validate_step`   validate the checkpoint a run committed (found
                                        by its run key), with the job's expectations
- `retain_store` / `retain_step`       keep the newest N (plus savepoints and leases)
- `gc_store` / `gc_step`               delete what nothing references (orphans after grace)
- `rescale_store` / `rescale_step`     rescale-restore to another parallelism
- `check_no_running_pipeline`           refuse a rescale while the pipeline DAG runs

Which job runs comes from the deployment's ``ckpt_jobs`` only (`JobSpec.job`),
never from a name read from checkpoint storage.

Idempotency: the run key is ``interval__<logical date>`` (`run_key`,
`RUN_KEY_TEMPLATE`), so a retry, a cleared run, a backfill or a manual re-run of
the same interval finds the checkpoint already committed and counts nothing twice.
Runs without a logical date fall back to the Airflow run id.

Storage credentials come from the job's AWS connection as storage options
(`storage_options_for`); they are passed to the library and to Spark executors,
never written into ``os.environ``, never logged.

A run reports its progress (phases, subtasks done) to this module's logger, so
the task log shows it every few seconds (`statebackend.progress`, lines mode;
``CKPT_PROGRESS=off`` silences it).

Heavy modules (pyspark, great_expectations, rocksdict, pyarrow and the job package,
pandas) are imported inside the functions: DAG files import this module at parse time.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from datetime import datetime
from typing import IO, Any, cast
from urllib.parse import urlsplit

from statebackend import defaults
from statebackend.airflow.config import SPEC_RUN_OPTIONS, JobSpec, resolve_job_ref
from statebackend.airflow.connection import (
    StateDatabase,
    index_key_from_connection,
    storage_options_from_connection,
)
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CkptError, UsageError
from statebackend.lifecycle.gc import collect_garbage
from statebackend.lifecycle.retention import retain
from statebackend.lifecycle.vacuum import vacuum_after_retention
from statebackend.progress import NO_PROGRESS, Progress, choose_mode
from statebackend.run_options import command_line, run_options
from statebackend.spark.session import add_to_pythonpath
from statebackend.state.external_store import ExternalStore
from statebackend.state.keygroups import check_parallelism
from statebackend.storage import open_storage

log = logging.getLogger(__name__)

RUN_KEY_PREFIX = "interval__"
# The run key as an Airflow template (operators' template fields); same value as `run_key`.
RUN_KEY_TEMPLATE = "{{ '" + RUN_KEY_PREFIX + "' ~ ts if logical_date else run_id }}"
SUMMARY_LOG_KEYS = ("checkpoint_id", "events_read", "events_rejected", "keys_touched",
                    "bytes_uploaded", "skipped")


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


def render(template: Any, values: dict) -> Any:
    """Render the Jinja fields of a configured value (``{{ ds }}``, ``{{ ts }}`` ...): a
    string, or each string of a mapping; anything else as it is."""
    if isinstance(template, Mapping):
        return {key: render(value, values) for key, value in template.items()}
    if not isinstance(template, str) or "{" not in template:
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


# -- storage -------------------------------------------------------------------
def storage_options_for(spec: JobSpec, get_connection: Callable[[str], Any] | None = None
                        ) -> dict:
    """The job's storage options from its ``storage_conn_id`` ({} without one)."""
    return storage_options_from_connection(spec.storage_conn_id, get_connection)


def state_db_for(spec: JobSpec, get_connection: Callable[[str], Any] | None = None
                 ) -> str | None:
    """The external backend's database URL: ``state_db``, else its connection's."""
    return state_database(spec).url_now(get_connection)


def state_database(spec: JobSpec) -> StateDatabase:
    """Where ``spec``'s external-backend state lives, as configured."""
    return StateDatabase(spec.state_db, spec.state_db_conn_id, spec.state_table)


def external_store_for(spec: JobSpec) -> ExternalStore | None:
    """`state_db_for` and the job's state table (None: no database configured)."""
    return state_database(spec).store()


def open_store(spec: JobSpec, storage_options: Mapping[str, Any] | None = None, *,
               get_connection: Callable[[str], Any] | None = None):
    """The job's `CheckpointStore`; options from its connection unless given, and the
    registry index's key from ``index_key_conn_id`` (else this host's)."""
    if storage_options is None:
        storage_options = storage_options_for(spec, get_connection)
    return CheckpointStore(open_storage(spec.storage, **storage_options), spec.name,
                           index_key_from_connection(spec.index_key_conn_id, get_connection))


def checkpoint_facts(meta) -> dict:
    """The few figures of a checkpoint that DAGs publish (XCom, Asset event extra)."""
    s = meta.summary()
    return {key: s[key] for key in ("id", "kind", "run_id", "parallelism", "max_parallelism",
                                    "bytes_referenced", "bytes_uploaded", "rows", "created_at",
                                    "parent")}


# -- run -------------------------------------------------------------------------
def load_configured_job(job_ref: str, entry: str):
    """The `Job` a configuration names (built-in name or module:attr); one-line errors."""
    # the job package (pyarrow, RocksDB) only when a task runs: DAG files import this module
    from statebackend.job.load import load_job, module_root

    ref = resolve_job_ref(job_ref, entry)
    try:
        job = load_job(ref)
    except UsageError as exc:
        raise UsageError(f"ckpt_jobs entry {entry!r}: {exc}") from exc
    # Executors import the job's module from the same place as this process.
    root = module_root(ref)
    if root:
        add_to_pythonpath(root)
    return job


def checked_options(job, entry: str, options: Mapping[str, Any] | None) -> dict:
    """``options`` checked against ``job.options``: one line naming the entry and option."""
    try:
        return dict(job.resolve_options(options or {}))
    except UsageError as exc:
        raise UsageError(f"ckpt_jobs entry {entry!r}: {exc}") from exc


def run_job_once(job_ref: str, config, *, entry: str | None = None, spark=None) -> dict:
    """Load the configured job, check its options and input, run one interval."""
    # the job package (pyarrow, RocksDB) only when a task runs: DAG files import this module
    from statebackend.job.run import run_job

    entry = entry or config.job or job_ref
    job = load_configured_job(job_ref, entry)
    config = replace(config, options=checked_options(job, entry, config.options))
    if "://" not in config.input and not os.path.exists(config.input):
        raise UsageError(f"input {config.input} of ckpt_jobs entry {entry!r} does not exist; "
                         "check the 'input' pattern and that the interval's data landed")
    # `Progress` types its stream as typing.IO, a nominal class io.TextIOBase does not
    # derive from; LogLines has what Progress calls (write, flush, isatty)
    stream = cast(IO[str], LogLines(log))
    mode = "off" if choose_mode(stream) == "off" else "lines"  # a log has no live bar
    with Progress("run", stream=stream, mode=mode) as progress:
        summary = dict(run_job(job, config, spark=spark, progress=progress))
    log.info("job %s run %s: %s", entry, config.run_id,
             {k: summary.get(k) for k in SUMMARY_LOG_KEYS})
    summary.setdefault("run_id", config.run_id)
    return summary


class LogLines(io.TextIOBase):
    """A text stream whose lines go to ``logger`` at INFO: progress in the task log."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                self.logger.info("%s", line.rstrip())
        return len(text)


def spec_run_values(spec: JobSpec) -> dict[str, Any]:
    """The run options ``spec`` sets, by `RunConfig` field (not rendered): its declared
    run settings, its entry name as the job's folder, ``spark.master`` as the master."""
    values = {opt.name: getattr(spec, opt.name) for opt in SPEC_RUN_OPTIONS}
    values.update(job=spec.name, master=spec.spark.master)
    return values


def make_run_config(values: Mapping[str, Any]):
    """A `RunConfig` of ``values`` (by field name; a typo is a TypeError naming it)."""
    # the job package (pyarrow, RocksDB) only when a run is built: DAG files import this
    from statebackend.job.config import RunConfig

    return RunConfig(**values)


def build_run_config(spec: JobSpec, *, logical_date: datetime | None, airflow_run_id: str,
                     storage_options: Mapping[str, Any] | None = None, **overrides: Any):
    """The `RunConfig` of one interval of ``spec``: its templated run options rendered
    for that interval; ``overrides`` (RunConfig fields, e.g. ``parallelism``) win."""
    values = template_values(logical_date, airflow_run_id)
    templated = {opt.name for opt in run_options() if opt.templated}
    run = {name: render(value, values) if name in templated else value
           for name, value in spec_run_values(spec).items()}
    return make_run_config({**run, "run_id": run_key(logical_date, airflow_run_id),
                            "storage_options": dict(storage_options or {}), **overrides})


def run_pipeline_job(spec: JobSpec, *, logical_date: datetime | None, airflow_run_id: str,
                     spark=None, storage_options: Mapping[str, Any] | None = None) -> dict:
    """Run one interval of ``spec`` in this process; a committed run key is skipped."""
    if storage_options is None:
        storage_options = storage_options_for(spec)
    config = build_run_config(spec, logical_date=logical_date, airflow_run_id=airflow_run_id,
                              storage_options=storage_options, state_db=state_db_for(spec))
    return run_job_once(spec.job, config, entry=spec.name, spark=spark)


# -- validate ----------------------------------------------------------------------
def _validation_dict(result) -> dict:
    """A compact result (the full summary stays in the stored report, not in XCom)."""
    summary = result.summary or {}
    return {"success": bool(result.success), "checkpoint_id": result.checkpoint_id,
            "deep": summary.get("deep"), "level": summary.get("level"),
            "critical_failures": summary.get("critical_failures"),
            "failed_checks": list(summary.get("failed_checks") or [])[:20],
            "figures": summary.get("figures"), "report_location": result.report_location,
            "data_docs_index": result.data_docs_index}


def validate_store(store, options=None, *, run_id: str | None = None,
                   ref: str | int = "latest", job_ref: str | None = None) -> dict:
    """Validate the checkpoint committed by ``run_id`` (or ``ref``); raise if it fails.

    ``options``: a `ValidationOptions` (default: the manifest level, the report now):
    its ``level`` ("manifest", "deep" or "full"), ``report`` (``"none"`` decides without
    importing Great Expectations: the scheduled pipeline's verdict must not wait ~10 s
    for GE; maintenance renders the report) and ``state_db`` (an external-backend job's
    database: the deep and full levels read it). ``job_ref`` (the configured job) adds
    the job's expectations on its states.
    """
    # checkpoint storage (fsspec) only when the task runs: DAG files import this module
    from statebackend.validation.options import ValidationOptions
    from statebackend.validation.validate import validate_checkpoint

    checks = load_configured_job(job_ref, store.job).expectations if job_ref else None
    options = replace(options or ValidationOptions(), state_checks=checks or None)
    if run_id is not None:
        meta = store.find_by_run_id(run_id)
        if meta is None:
            if (retired := _retired_run(store, run_id)) is not None:
                return retired
            raise CkptError(f"no checkpoint of job {store.job!r} was committed by run "
                            f"{run_id!r}; the job task did not finish or retention already "
                            "removed it")
    else:
        meta = store.resolve(ref)
    result = _validation_dict(validate_checkpoint(store, meta.checkpoint_id, options))
    result["checkpoint"] = checkpoint_facts(meta)
    if not result["success"]:
        raise ValidationFailedError(
            f"checkpoint {meta.checkpoint_id} of job {store.job!r} failed validation; report: "
            f"{result['data_docs_index'] or result['report_location']}")
    return result


def _retired_run(store, run_id: str) -> dict | None:
    """The result of validating a re-run whose checkpoint retention has retired since its
    run committed it (validated then): nothing is left to check, and nothing failed."""
    done = store.find_run(run_id)
    if done is None or done.checkpoint_id in store.checkpoint_ids():
        return None
    return {"success": True, "checkpoint_id": done.checkpoint_id,
            "skipped": f"run {run_id!r} committed checkpoint {done.checkpoint_id}, since "
                       "retired by retention: nothing left to validate"}


def validation_options(spec: JobSpec, level: str = "manifest", report: str = "now"):
    """The `ValidationOptions` of a validation of ``spec``'s checkpoints (its database
    on the external backend)."""
    from statebackend.validation.options import ValidationOptions  # as validate_store

    return ValidationOptions(level=level, report=report, state_db=external_store_for(spec))


def validate_step(spec: JobSpec, *, run_id: str | None = None, ref: str | int = "latest",
                  level: str | None = None,
                  storage_options: Mapping[str, Any] | None = None,
                  report: str = "now") -> dict:
    return validate_store(open_store(spec, storage_options),
                          validation_options(spec, level or "manifest", report),
                          run_id=run_id, ref=ref, job_ref=spec.job)


# -- lifecycle -----------------------------------------------------------------------
def retain_store(store, *, keep: int = defaults.RETENTION_KEEP, dry_run: bool = False,
                 state_db: ExternalStore | None = None) -> dict:
    """Retention, then (external backend) the vacuum of its database."""
    report = retain(store, int(keep), dry_run=bool(dry_run))
    out = report.to_json()
    if not report.failures:
        vacuumed = vacuum_after_retention(store, state_db, bool(dry_run), NO_PROGRESS)
        if vacuumed:
            out["vacuum"] = vacuumed.to_json()
    return out


def retain_step(spec: JobSpec, *, keep: int | None = None, dry_run: bool = False,
                storage_options: Mapping[str, Any] | None = None) -> dict:
    return retain_store(open_store(spec, storage_options), keep=keep or spec.keep,
                        dry_run=dry_run, state_db=external_store_for(spec))


def gc_store(store, *, grace_seconds: float = defaults.GC_GRACE_SECONDS,
             dry_run: bool = False) -> dict:
    return collect_garbage(store, grace_seconds=float(grace_seconds),
                           dry_run=bool(dry_run)).to_json()


def gc_step(spec: JobSpec, *, grace_seconds: float | None = None, dry_run: bool = False,
            storage_options: Mapping[str, Any] | None = None) -> dict:
    grace = spec.gc_grace_seconds if grace_seconds is None else grace_seconds
    return gc_store(open_store(spec, storage_options), grace_seconds=grace, dry_run=dry_run)


def rescale_store(store, options=None, *, parallelism: int, checkpoint: str | int = "latest",
                  spark=None) -> dict:
    """Rescale ``checkpoint`` to ``parallelism``. ``options``: a `RescaleOptions` (its
    ``master``, ``dry_run``, and ``state_db``: an external checkpoint's database, if
    configured, checked to be the checkpoint's own)."""
    # Spark and RocksDB only when a rescale runs: DAG files import this module
    from statebackend.rescale.executor import RescaleOptions, rescale

    options = options or RescaleOptions()

    max_parallelism = store.resolve(checkpoint).max_parallelism
    if not isinstance(parallelism, int) or isinstance(parallelism, bool):
        raise UsageError(f"parallelism {parallelism!r} must be an integer in "
                         f"1..{max_parallelism} (the job's max parallelism)")
    check_parallelism(parallelism, max_parallelism)
    # The ref, not the id resolved above: rescale resolves it again under its lease.
    result = rescale(store, checkpoint, parallelism, spark=spark, options=options)
    if options.dry_run:
        print(result.get("plan_text", ""))
    return result


def migrate_storage(storage, source: str, transform_ref: str, target_ref: str, savepoint: str,
                    options) -> dict:
    """`ckpt migrate` as a task: ``source``'s state through the transform ``transform_ref``
    (module:attr) into savepoint ``savepoint`` of the job ``target_ref`` (a built-in name
    or module:attr); ``options``: a `TransformOptions` (on Spark with its ``master``)."""
    # the job package (pyarrow, RocksDB) only when a task runs: DAG files import this module
    from statebackend.job.transform import load_transform, transform_state, transform_summary_lines

    transform = load_transform(transform_ref)
    target = load_configured_job(target_ref, options.target_job or target_ref)
    result = transform_state(storage, source, transform, target, savepoint, options)
    if options.dry_run:
        print("\n".join(transform_summary_lines(result)))
    return result


def rescale_step(spec: JobSpec, *, parallelism: int, checkpoint: str | int = "latest",
                 dry_run: bool = False, spark=None,
                 storage_options: Mapping[str, Any] | None = None) -> dict:
    if not isinstance(parallelism, int) or not 1 <= parallelism <= spec.max_parallelism:
        raise CkptError(f"parallelism {parallelism!r} must be an integer in "
                        f"1..{spec.max_parallelism} (the job's max parallelism)")
    from statebackend.rescale.executor import RescaleOptions  # as rescale_store

    options = RescaleOptions(master=spec.spark.master, dry_run=bool(dry_run),
                             state_db=external_store_for(spec))
    return rescale_store(open_store(spec, storage_options), options, parallelism=parallelism,
                         checkpoint=checkpoint, spark=spark)


def check_no_running_pipeline(dag_id: str | JobSpec, count_running: Callable[[str], int]
                              ) -> dict:
    """Refuse while DAG ``dag_id`` (a job's pipeline) has a running or queued run."""
    if isinstance(dag_id, JobSpec):
        dag_id = dag_id.pipeline_dag_id
    running = int(count_running(dag_id))
    if running:
        raise PipelineRefusedError(
            f"DAG {dag_id} has {running} active run(s); a rescale-restore would race with it. "
            f"Pause {dag_id}, wait for the run to finish, then trigger the rescale again")
    return {"pipeline_dag_id": dag_id, "active_runs": 0}


def published_checkpoint(events: Any, asset: Any, kept: Collection[int]) -> str | int:
    """The newest checkpoint in ``kept`` that the triggering ``events`` of ``asset``
    published (``publish_extra``'s ``checkpoint_id``); ``"latest"`` without one (a
    manual run, or retention retired them all)."""
    try:
        found = list(events[asset]) if events else []
    except KeyError:
        found = []
    extras = [getattr(e, "extra", None) for e in found]
    ids = [x.get("checkpoint_id") for x in extras if isinstance(x, dict)]
    published = [i for i in ids if isinstance(i, int) and i in kept]
    return max(published) if published else "latest"


def publish_extra(validation: dict) -> dict:
    """The Asset event extra of a published checkpoint (small, JSON)."""
    chk = validation.get("checkpoint") or {}
    return {"checkpoint_id": chk.get("id"), "run_id": chk.get("run_id"),
            "parallelism": chk.get("parallelism"), "bytes_referenced": chk.get("bytes_referenced"),
            "bytes_uploaded": chk.get("bytes_uploaded"), "validated": validation.get("success"),
            "report": validation.get("data_docs_index") or validation.get("report_location")}


# -- spark-submit ------------------------------------------------------------------
def submit_application() -> str:
    """Path of the spark-submit entry point for any job (`statebackend.cli.submit`)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(here, "cli", "submit.py")


def spark_submit_args(spec: JobSpec) -> list[str]:
    """application_args for spark-submit (Airflow renders the Jinja fields): ``ckpt run``'s
    flags of the spec's run options (`statebackend.run_options.command_line`)."""
    values = {**spec_run_values(spec), "run_id": RUN_KEY_TEMPLATE,
              # spark-submit started the application: its tasks run on the cluster
              "engine": "spark", "state_db": submitted_state_db(spec, spec.state_db)}
    return [spec.job_ref(), *command_line(values), "--json"]


def submitted_state_db(spec: JobSpec, url: str | None) -> str | None:
    """``url`` for spark-submit's command line: never with a password (Airflow logs the
    command), so a password there is refused in one line."""
    if url and urlsplit(url).password:
        raise UsageError(f"ckpt_jobs entry {spec.name!r}: spark.mode submit would put the "
                         "state database's password on the spark-submit command line; keep "
                         "it in ~/.pgpass on the driver host and leave it out of "
                         f"{'state_db' if spec.state_db else 'the connection'}")
    return url


def s3_environment(options: Mapping[str, Any]) -> dict[str, str]:
    """The standard ``AWS_*`` variables of storage options, for a child process only.

    spark-submit's driver is another process whose `ckpt run` reads the standard
    variables; they go into that process's environment (Popen ``env``), never into
    this process's ``os.environ``.
    """
    names = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY",
             "token": "AWS_SESSION_TOKEN", "profile": "AWS_PROFILE"}
    env = {var: str(options[k]) for k, var in names.items() if options.get(k)}
    client = options.get("client_kwargs") or {}
    if client.get("endpoint_url"):
        env["AWS_ENDPOINT_URL"] = str(client["endpoint_url"])
    if client.get("region_name"):
        env["AWS_DEFAULT_REGION"] = str(client["region_name"])
    return env


def spark_submit_operator(spec: JobSpec, *, task_id: str, **kwargs):
    """A SparkSubmitOperator running ``spec``'s job on ``spec.spark`` (submit mode).

    The connection's credentials go into the spark-submit process's own environment
    in ``execute`` (after templates are rendered, so they never show as a rendered
    field); this process's environment is not touched.
    """
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    class CkptSparkSubmitOperator(SparkSubmitOperator):
        def execute(self, context):
            self.env_vars = {**(self.env_vars or {}),
                             **s3_environment(storage_options_for(spec))}
            if spec.state_db_conn_id:  # read when the task runs, never while parsing
                url = submitted_state_db(spec, state_db_for(spec))
                self.application_args = [*(self.application_args or []), "--state-db", url]
            return super().execute(context)

    conf = {"spark.ui.enabled": "false", **{k: str(v) for k, v in spec.spark.conf.items()}}
    return CkptSparkSubmitOperator(
        task_id=task_id, application=submit_application(), conn_id=spec.spark.conn_id,
        application_args=spark_submit_args(spec), conf=conf, name=f"ckpt-{spec.name}",
        env_vars={"PYTHONUNBUFFERED": "1"}, **kwargs)


def state_totals(spec: JobSpec, ref: str | int = "latest",
                 storage_options: Mapping[str, Any] | None = None):
    """keyed_aggregation's ``totals`` state as a pandas frame (key -> count, sum, min_ts,
    max_ts), the shape of demo.sample_data.expected_totals (checks and the demo)."""
    import pandas as pd

    # RocksDB only when state is read: DAG files import this module
    from statebackend.checkpoint.dump import checkpoint_rows

    store = open_store(spec, storage_options)
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
