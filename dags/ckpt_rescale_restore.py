"""``<job>_rescale_restore``: rescale a checkpoint to another parallelism (manual only).

Typed params, checked by their JSON schema before the run exists:
``parallelism`` (integer, 1..max_parallelism), ``checkpoint`` (``latest``, an id or
``chk-<id>``), ``dry_run`` (only print the plan). Refuses while ``<job>_pipeline``
has an active run; validates the new checkpoint.
"""

from __future__ import annotations

from datetime import UTC, datetime

from airflow.sdk import Param, dag, task

from jobs.pipeline_config import JobSpec, load_job_specs

CHECKPOINT_PATTERN = r"^(latest|chk-[0-9]+|[0-9]+)$"
# Manual runs are created "now": a start_date after that (the job's first interval may lie
# in the future) would leave a triggered run with no task to run.
MANUAL_START = datetime(2020, 1, 1, tzinfo=UTC)


def build_rescale(spec: JobSpec):
    @dag(dag_id=spec.rescale_dag_id, schedule=None, start_date=MANUAL_START,
         catchup=False, max_active_runs=1, tags=["ckpt", spec.name, "rescale"],
         default_args={"owner": "ckpt", "retries": 0},
         params={
             "parallelism": Param(type="integer", minimum=1, maximum=spec.max_parallelism,
                                  title="New parallelism",
                                  description=f"Number of subtasks (1..{spec.max_parallelism})"),
             "checkpoint": Param("latest", type="string", pattern=CHECKPOINT_PATTERN,
                                 title="Source checkpoint",
                                 description="'latest', a checkpoint id or chk-<id>"),
             "dry_run": Param(False, type="boolean", title="Dry run",
                              description="Only plan; change nothing"),
         },
         doc_md=f"Rescale-restore a checkpoint of **{spec.name}** to a new parallelism.")
    def rescale_restore():
        @task(task_id="check_no_running_pipeline")
        def check_no_running_pipeline(**context) -> dict:
            from jobs import pipeline_tasks as steps

            ti = context["ti"]
            return steps.check_no_running_pipeline(
                spec, lambda dag_id: ti.get_dr_count(dag_id=dag_id, states=["running", "queued"]))

        @task(task_id="rescale")
        def rescale(params=None) -> dict:
            from jobs import pipeline_tasks as steps

            steps.export_storage_credentials(spec)
            result = steps.rescale_step(spec, parallelism=params["parallelism"],
                                        checkpoint=params["checkpoint"],
                                        dry_run=params["dry_run"])
            if params["dry_run"]:
                print(result.get("plan_text", ""))
            return result

        @task(task_id="validate")
        def validate(result: dict) -> dict:
            from jobs import pipeline_tasks as steps

            if result.get("dry_run"):
                return {"skipped": "dry run: nothing to validate"}
            steps.export_storage_credentials(spec)
            return steps.validate_step(spec, ref=result["checkpoint_id"])

        result = rescale()
        check_no_running_pipeline() >> result
        validate(result)

    return rescale_restore()


for _spec in load_job_specs():
    build_rescale(_spec)
