"""Operators for a stateful job's checkpoints, usable in your own DAGs.

Each operator takes keyword-only arguments, declares its templated fields, makes
one call into the library (`statebackend.airflow.steps`) and returns a JSON-able
dict (the XCom). Storage credentials come from ``storage_conn_id`` (an ``aws``
connection, see `CheckpointHook`) as storage options, never from or into the
environment::

    run = CkptRunJobOperator(task_id="run", job_ref="mypkg.jobs:job", job="sessions",
                             storage="s3://bucket/ckpt", storage_conn_id="aws_ckpt",
                             input_path="s3://bucket/events/dt={{ ds }}",
                             output_path="s3://bucket/out/sessions")
    run >> CkptValidateOperator(task_id="validate", job="sessions", job_ref="mypkg.jobs:job",
                                storage="s3://bucket/ckpt", storage_conn_id="aws_ckpt",
                                run_key=RUN_KEY_TEMPLATE)

``job`` is the job's folder under the storage root; ``job_ref`` the code that
runs (a built-in job name or ``pkg.module:attribute``), taken only from the DAG,
never from storage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator

from statebackend import defaults
from statebackend.airflow.hook import CheckpointHook
from statebackend.airflow.steps import RUN_KEY_TEMPLATE


def _as_int(value: Any) -> Any:
    """A rendered template ("3") as an int; other values unchanged (the library checks)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class _CheckpointOperator(BaseOperator):
    """Common arguments: the storage root, the job's folder, the storage connection."""

    ui_color = "#e8f1fb"

    def __init__(self, *, storage: str, job: str, storage_conn_id: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.storage = storage
        self.job = job
        self.storage_conn_id = storage_conn_id

    def hook(self) -> CheckpointHook:
        return CheckpointHook(self.storage_conn_id, storage=self.storage, job=self.job)


class CkptRunJobOperator(_CheckpointOperator):
    """Run one interval of a stateful job in this worker (local Spark or ``master``).

    ``engine``: ``auto`` (a small interval runs in this task's process, no JVM),
    ``spark`` or ``local`` (`statebackend.job.engine`); None: ``$CKPT_ENGINE``, else auto.
    """

    template_fields: Sequence[str] = ("input_path", "output_path", "quarantine_path", "storage",
                                      "run_key", "job_options", "start_from")

    def __init__(self, *, job_ref: str, input_path: str, storage: str, job: str,
                 output_path: str | None = None, run_key: str = RUN_KEY_TEMPLATE,
                 job_options: Mapping[str, Any] | None = None,
                 storage_conn_id: str | None = None, parallelism: int | None = None,
                 max_parallelism: int = defaults.MAX_PARALLELISM,
                 max_reject_fraction: float = defaults.MAX_REJECT_FRACTION,
                 quarantine_path: str | None = None, start_from: str | None = None,
                 master: str = "local[*]", engine: str | None = None, **kwargs: Any) -> None:
        super().__init__(storage=storage, job=job, storage_conn_id=storage_conn_id, **kwargs)
        self.job_ref = job_ref
        self.input_path = input_path
        self.output_path = output_path  # (``output`` is BaseOperator's XCom reference)
        self.run_key = run_key
        self.job_options = dict(job_options or {})
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.max_reject_fraction = max_reject_fraction
        self.quarantine_path = quarantine_path
        self.start_from = start_from
        self.master = master
        self.engine = engine

    def execute(self, context) -> dict:
        from statebackend.airflow.steps import run_job_once
        from statebackend.job.config import RunConfig

        config = RunConfig(
            input=self.input_path, storage=self.storage, job=self.job, run_id=self.run_key,
            output=self.output_path or None, parallelism=self.parallelism,
            max_parallelism=self.max_parallelism, master=self.master,
            max_reject_fraction=self.max_reject_fraction, quarantine=self.quarantine_path or None,
            start_from=self.start_from or None, options=self.job_options,
            storage_options=self.hook().storage_options(), context=_airflow_context(context),
            logical_time_ms=_interval_end_ms(context), engine=self.engine)
        return run_job_once(self.job_ref, config, entry=self.job)


class CkptValidateOperator(_CheckpointOperator):
    """Validate the checkpoint committed by ``run_key`` (or ``checkpoint``); fail on breaks.

    With ``outlets`` (Assets), each gets the checkpoint's figures as its event extra.
    ``report``: ``"now"`` renders the Great Expectations report after the verdict,
    ``"none"`` decides without importing GE (summary and overview page only).
    """

    template_fields: Sequence[str] = ("storage", "run_key", "checkpoint")

    def __init__(self, *, storage: str, job: str, run_key: str | None = None,
                 checkpoint: str | int = "latest", deep: bool = False,
                 level: str | None = None, job_ref: str | None = None,
                 storage_conn_id: str | None = None, report: str = "now",
                 **kwargs: Any) -> None:
        super().__init__(storage=storage, job=job, storage_conn_id=storage_conn_id, **kwargs)
        self.run_key = run_key
        self.checkpoint = checkpoint
        self.deep = deep
        self.level = level
        self.job_ref = job_ref
        self.report = report

    def execute(self, context) -> dict:
        from statebackend.airflow.steps import publish_extra, validate_store

        result = validate_store(self.hook().get_store(), run_id=self.run_key or None,
                                ref=_as_int(self.checkpoint), deep=self.deep,
                                level=self.level, job_ref=self.job_ref, report=self.report)
        for asset in self.outlets or ():
            context["outlet_events"][asset].extra = publish_extra(result)
        return result


class CkptRetainOperator(_CheckpointOperator):
    """Keep the newest ``keep`` checkpoints (plus savepoints and leased ones)."""

    template_fields: Sequence[str] = ("storage", "keep", "dry_run")

    def __init__(self, *, storage: str, job: str, keep: int = defaults.RETENTION_KEEP,
                 dry_run: bool = False, storage_conn_id: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(storage=storage, job=job, storage_conn_id=storage_conn_id, **kwargs)
        self.keep = keep
        self.dry_run = dry_run

    def execute(self, context) -> dict:
        from statebackend.airflow.steps import retain_store

        return retain_store(self.hook().get_store(), keep=_as_int(self.keep),
                            dry_run=_as_bool(self.dry_run))


class CkptGcOperator(_CheckpointOperator):
    """Delete shared files nothing references (orphans only after ``grace_seconds``)."""

    template_fields: Sequence[str] = ("storage", "grace_seconds", "dry_run")

    def __init__(self, *, storage: str, job: str,
                 grace_seconds: float = defaults.GC_GRACE_SECONDS, dry_run: bool = False,
                 storage_conn_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(storage=storage, job=job, storage_conn_id=storage_conn_id, **kwargs)
        self.grace_seconds = grace_seconds
        self.dry_run = dry_run

    def execute(self, context) -> dict:
        from statebackend.airflow.steps import gc_store

        return gc_store(self.hook().get_store(), grace_seconds=float(self.grace_seconds),
                        dry_run=_as_bool(self.dry_run))


class CkptRescaleOperator(_CheckpointOperator):
    """Rescale-restore ``checkpoint`` to ``parallelism`` subtasks (a new checkpoint)."""

    template_fields: Sequence[str] = ("storage", "parallelism", "checkpoint", "dry_run")

    def __init__(self, *, storage: str, job: str, parallelism: int | str,
                 checkpoint: str | int = "latest", dry_run: bool | str = False,
                 master: str | None = None, storage_conn_id: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(storage=storage, job=job, storage_conn_id=storage_conn_id, **kwargs)
        self.parallelism = parallelism
        self.checkpoint = checkpoint
        self.dry_run = dry_run
        self.master = master

    def execute(self, context) -> dict:
        from statebackend.airflow.steps import rescale_store

        return rescale_store(self.hook().get_store(),
                             parallelism=_as_int(self.parallelism),
                             checkpoint=_as_int(self.checkpoint),
                             dry_run=_as_bool(self.dry_run), master=self.master)


def _interval_end_ms(context) -> int | None:
    """The run's processing time: the data interval's end (a re-run sees the same time)."""
    end = context.get("data_interval_end") if hasattr(context, "get") else None
    return int(end.timestamp() * 1000) if end is not None else None


def _airflow_context(context) -> dict:
    """Who ran it (recorded with the run): DAG, run, task, try."""
    ti = context.get("ti") if hasattr(context, "get") else None
    if ti is None:
        return {}
    return {"airflow": {"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id,
                        "try_number": getattr(ti, "try_number", None)}}


__all__ = ["CkptGcOperator", "CkptRescaleOperator", "CkptRetainOperator",
           "CkptRunJobOperator", "CkptValidateOperator"]
