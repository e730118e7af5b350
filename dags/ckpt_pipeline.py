"""``<job>_pipeline``: one interval of a stateful job, then its checkpoint lifecycle.

run_job (Spark, idempotent by interval) -> validate (publishes the checkpoint
Asset) -> retain -> gc. One DAG per job in ckpt_jobs (jobs/pipeline_config.py).
Thin on purpose: the steps live in jobs/pipeline_tasks.py.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Asset, CronDataIntervalTimetable, dag, task

from jobs.pipeline_config import JobSpec, load_job_specs


def default_args(spec: JobSpec) -> dict:
    return {"owner": "ckpt", "retries": spec.retries,
            "retry_delay": timedelta(seconds=spec.retry_delay_seconds),
            "retry_exponential_backoff": 2.0,
            "max_retry_delay": timedelta(seconds=spec.max_retry_delay_seconds)}


def checkpoint_asset(spec: JobSpec) -> Asset:
    return Asset(name=spec.asset_name, uri=spec.asset_uri, extra={"job": spec.name})


def build_pipeline(spec: JobSpec):
    asset = checkpoint_asset(spec)

    @dag(dag_id=spec.pipeline_dag_id, start_date=spec.start_datetime(), catchup=spec.catchup,
         schedule=CronDataIntervalTimetable(spec.schedule, timezone="UTC"), max_active_runs=1,
         default_args=default_args(spec), tags=["ckpt", spec.name, *spec.tags],
         doc_md=f"Stateful job **{spec.name}**: Spark run on `{spec.input}`, then validate, "
                f"retain {spec.keep}, GC. Checkpoints: `{spec.asset_uri}`.")
    def pipeline():
        if spec.spark.mode == "submit":
            from jobs.pipeline_tasks import spark_submit_operator

            run_job = spark_submit_operator(spec, task_id="run_job")
        else:
            @task(task_id="run_job")
            def run_job_local(**context) -> dict:
                from jobs import pipeline_tasks as steps

                steps.export_storage_credentials(spec)
                return steps.run_pipeline_job(spec, logical_date=context.get("logical_date"),
                                              airflow_run_id=context["run_id"])

            run_job = run_job_local()

        @task(task_id="validate", outlets=[asset])
        def validate(**context) -> dict:
            from jobs import pipeline_tasks as steps

            steps.export_storage_credentials(spec)
            key = steps.run_key(context.get("logical_date"), context["run_id"])
            result = steps.validate_step(spec, run_id=key)
            context["outlet_events"][asset].extra = steps.publish_extra(result)
            return result

        @task(task_id="retain")
        def retain() -> dict:
            from jobs import pipeline_tasks as steps

            steps.export_storage_credentials(spec)
            return steps.retain_step(spec)

        @task(task_id="gc")
        def gc() -> dict:
            from jobs import pipeline_tasks as steps

            steps.export_storage_credentials(spec)
            return steps.gc_step(spec)

        run_job >> validate() >> retain() >> gc()

    return pipeline()


for _spec in load_job_specs():
    build_pipeline(_spec)
