"""The DAG factory: four DAGs per configured job (``ckpt_jobs``), built from the operators.

- ``<job>_pipeline`` (the job's schedule, one active run): run_job (Spark, idempotent
  by interval) -> validate (the verdict without Great Expectations; publishes the
  checkpoint Asset) -> retain -> gc;
- ``<job>_reports`` (on the checkpoint Asset): the GE Data Docs of each published
  checkpoint, rendered off the pipeline's critical path (module `build_reports_dag`);
- ``<job>_maintenance`` (``maintenance_schedule``): retention, GC, a full validation
  (every entry read and checked: the level too slow for each scheduled run) report of
  the latest checkpoint;
- ``<job>_rescale_restore`` (manual only): typed params ``parallelism`` (1..max
  parallelism), ``checkpoint`` (``latest``, an id or ``chk-<id>``), ``dry_run``;
  refuses while the pipeline has an active run; validates the new checkpoint.

A DAG file is one call::

    from statebackend.airflow.factory import build_dags
    build_dags()                     # every job of ckpt_jobs (see .config)

Nothing heavy is imported here: DAG files are parsed often.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from airflow.sdk import DAG, Asset, CronDataIntervalTimetable, Param, task

from statebackend.airflow.config import JobSpec, load_job_specs
from statebackend.airflow.operators import (
    RUN_ARGUMENTS,
    CkptGcOperator,
    CkptRescaleOperator,
    CkptRetainOperator,
    CkptRunJobOperator,
    CkptValidateOperator,
)
from statebackend.airflow.steps import (
    RUN_KEY_TEMPLATE,
    check_no_running_pipeline,
    open_store,
    published_checkpoint,
    spark_submit_operator,
    spec_run_values,
    validate_store,
    validation_options,
)

CHECKPOINT_PATTERN = r"^(latest|chk-[0-9]+|[0-9]+)$"
# Manual runs are created "now": a start_date after that (the job's first interval may lie
# in the future) would leave a triggered run with no task to run.
MANUAL_START = datetime(2020, 1, 1, tzinfo=UTC)
KINDS = ("pipeline", "reports", "maintenance", "rescale")


def default_args(spec: JobSpec) -> dict:
    return {"owner": "ckpt", "retries": spec.retries,
            "retry_delay": timedelta(seconds=spec.retry_delay_seconds),
            "retry_exponential_backoff": 2.0,
            "max_retry_delay": timedelta(seconds=spec.max_retry_delay_seconds)}


def checkpoint_asset(spec: JobSpec) -> Asset:
    return Asset(name=spec.asset_name, uri=spec.asset_uri, extra={"job": spec.name})


def _storage(spec: JobSpec) -> dict:
    """Where the job's checkpoints are and, on the external backend, its database: every
    operator's common arguments (its connections are read when the task runs)."""
    return {"storage": spec.storage, "job": spec.name, "storage_conn_id": spec.storage_conn_id,
            "state_db": spec.state_db, "state_db_conn_id": spec.state_db_conn_id,
            "state_table": spec.state_table}


def run_job_task(spec: JobSpec, task_id: str = "run_job"):
    """The job's run: in this worker (``spark.mode: local``) or through spark-submit; the
    operator gets every run option the spec sets (`steps.spec_run_values`)."""
    if spec.spark.mode == "submit":
        return spark_submit_operator(spec, task_id=task_id)
    values = spec_run_values(spec)
    run = {argument: values[opt.name] for argument, opt in RUN_ARGUMENTS.items()
           if opt.name in values}
    return CkptRunJobOperator(task_id=task_id, job_ref=spec.job, run_key=RUN_KEY_TEMPLATE,
                              **run, **_storage(spec))


def build_pipeline_dag(spec: JobSpec) -> DAG:
    asset = checkpoint_asset(spec)
    with DAG(dag_id=spec.pipeline_dag_id, start_date=spec.start_datetime(),
             catchup=spec.catchup,
             schedule=CronDataIntervalTimetable(spec.schedule, timezone="UTC"),
             max_active_runs=1, default_args=default_args(spec),
             tags=["ckpt", spec.name, *spec.tags],
             doc_md=f"Stateful job **{spec.name}** (`{spec.job}`): Spark run on "
                    f"`{spec.input}`, then validate, retain {spec.keep}, GC. "
                    f"Checkpoints: `{spec.asset_uri}`.") as dag:
        run = run_job_task(spec)
        # The verdict of every run without GE's import; <job>_reports renders the report.
        validate = CkptValidateOperator(task_id="validate", run_key=RUN_KEY_TEMPLATE,
                                        job_ref=spec.job, outlets=[asset], report="none",
                                        **_storage(spec))
        retain = CkptRetainOperator(task_id="retain", keep=spec.keep, **_storage(spec))
        gc = CkptGcOperator(task_id="gc", grace_seconds=spec.gc_grace_seconds,
                            **_storage(spec))
        run >> validate >> retain >> gc
    return dag


def build_reports_dag(spec: JobSpec) -> DAG:
    """The Data Docs of every checkpoint the pipeline publishes, in a DAG of their own.

    Why an Asset-scheduled DAG and not a long-lived worker: the pipeline's verdict is
    computed without GE (its ``validate`` task imports none), so only the rendering pays
    GE's import (5-10 s per task process). A DAG on the checkpoint Asset runs beside
    the pipeline: the pipeline's next run never waits for it (its ``max_active_runs``
    counts its own runs only), it keeps Airflow's retries, logs and UI, and needs no
    service outside Airflow; a long-lived worker would pay the import once but needs
    deploying, supervising and feeding. Events that arrive while a report renders are
    consumed together by the next run, which renders the newest.
    """
    asset = checkpoint_asset(spec)
    with DAG(dag_id=spec.reports_dag_id, schedule=[asset], start_date=MANUAL_START,
             catchup=False, max_active_runs=1, tags=["ckpt", spec.name, "reports"],
             default_args={"owner": "ckpt", "retries": 1,
                           "retry_delay": timedelta(minutes=1)},
             doc_md=f"Great Expectations Data Docs of each checkpoint of **{spec.name}** "
                    "the pipeline publishes, off the pipeline's critical path.") as dag:

        @task(task_id="render_report")
        def render_report(triggering_asset_events=None) -> dict:
            store = open_store(spec)
            ref = published_checkpoint(triggering_asset_events, asset, store.checkpoint_ids())
            return validate_store(store, validation_options(spec, report="now"), ref=ref,
                                  job_ref=spec.job)

        render_report()
    return dag


def build_maintenance_dag(spec: JobSpec) -> DAG:
    with DAG(dag_id=spec.maintenance_dag_id, start_date=spec.start_datetime(), catchup=False,
             schedule=spec.maintenance_schedule, max_active_runs=1,
             default_args={"owner": "ckpt", "retries": 1, "retry_delay": timedelta(minutes=5)},
             tags=["ckpt", spec.name, "maintenance"],
             doc_md=f"Retention (keep {spec.keep}), GC and a full validation report (every "
                    f"entry checked) of the latest checkpoint of **{spec.name}**.") as dag:
        (CkptRetainOperator(task_id="retain", keep=spec.keep, **_storage(spec))
         >> CkptGcOperator(task_id="gc", grace_seconds=spec.gc_grace_seconds, **_storage(spec))
         >> CkptValidateOperator(task_id="validate_latest_deep", checkpoint="latest",
                                 level="full", job_ref=spec.job, **_storage(spec)))
    return dag


def build_rescale_dag(spec: JobSpec) -> DAG:
    with DAG(dag_id=spec.rescale_dag_id, schedule=None, start_date=MANUAL_START,
             catchup=False, max_active_runs=1, tags=["ckpt", spec.name, "rescale"],
             default_args={"owner": "ckpt", "retries": 0},
             # Params render as their JSON types (parallelism an int, dry_run a bool).
             render_template_as_native_obj=True,
             params={
                 "parallelism": Param(type="integer", minimum=1, maximum=spec.max_parallelism,
                                      title="New parallelism",
                                      description=f"Number of subtasks "
                                                  f"(1..{spec.max_parallelism})"),
                 "checkpoint": Param("latest", type="string", pattern=CHECKPOINT_PATTERN,
                                     title="Source checkpoint",
                                     description="'latest', a checkpoint id or chk-<id>"),
                 "dry_run": Param(False, type="boolean", title="Dry run",
                                  description="Only plan; change nothing"),
             },
             doc_md=f"Rescale-restore a checkpoint of **{spec.name}** to a new "
                    "parallelism.") as dag:

        @task(task_id="check_no_running_pipeline")
        def no_running_pipeline(**context) -> dict:
            ti = context["ti"]
            return check_no_running_pipeline(
                spec.pipeline_dag_id,
                lambda dag_id: ti.get_dr_count(dag_id=dag_id, states=["running", "queued"]))

        rescale = CkptRescaleOperator(
            task_id="rescale", parallelism="{{ params.parallelism }}",
            checkpoint="{{ params.checkpoint }}", dry_run="{{ params.dry_run }}",
            master=spec.spark.master, **_storage(spec))

        @task(task_id="validate")
        def validate(result: dict) -> dict:
            if result.get("dry_run"):
                return {"skipped": "dry run: nothing to validate"}
            return validate_store(open_store(spec), validation_options(spec),
                                  ref=result["checkpoint_id"], job_ref=spec.job)

        no_running_pipeline() >> rescale
        # Airflow types a @task call with the function's own parameters; an XComArg is
        # what a DAG passes (resolved to the dict when the task runs)
        validate(rescale.output)  # type: ignore[arg-type]
    return dag


BUILDERS = {"pipeline": build_pipeline_dag, "reports": build_reports_dag,
            "maintenance": build_maintenance_dag, "rescale": build_rescale_dag}


def build_dags(specs: list[JobSpec] | None = None, *, kinds: tuple[str, ...] = KINDS,
               default_config: str | None = None) -> dict[str, DAG]:
    """The DAGs of ``kinds`` for every job (``ckpt_jobs`` when ``specs`` is None)."""
    if specs is None:
        specs = load_job_specs(default=default_config)
    dags = {}
    for spec in specs:
        for kind in kinds:
            dag = BUILDERS[kind](spec)
            dags[dag.dag_id] = dag
    return dags
