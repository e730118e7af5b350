"""``<job>_maintenance``: full retention + GC, then a deep validation report of the latest.

Daily by default (``maintenance_schedule`` in ckpt_jobs). Safe beside a running
pipeline: retention keeps leased checkpoints, GC spares young orphans.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import dag, task

from jobs.pipeline_config import JobSpec, load_job_specs


def build_maintenance(spec: JobSpec):
    @dag(dag_id=spec.maintenance_dag_id, start_date=spec.start_datetime(), catchup=False,
         schedule=spec.maintenance_schedule, max_active_runs=1,
         default_args={"owner": "ckpt", "retries": 1, "retry_delay": timedelta(minutes=5)},
         tags=["ckpt", spec.name, "maintenance"],
         doc_md=f"Retention (keep {spec.keep}), GC and a deep validation report of the "
                f"latest checkpoint of **{spec.name}**.")
    def maintenance():
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

        @task(task_id="validate_latest_deep")
        def validate_latest_deep() -> dict:
            from jobs import pipeline_tasks as steps

            steps.export_storage_credentials(spec)
            return steps.validate_step(spec, ref="latest", deep=True)

        retain() >> gc() >> validate_latest_deep()

    return maintenance()


for _spec in load_job_specs():
    build_maintenance(_spec)
