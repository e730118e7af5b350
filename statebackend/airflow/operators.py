"""Operators for a stateful job's checkpoints, usable in your own DAGs.

Each operator takes keyword-only arguments, declares its templated fields, makes
one call into the library (`statebackend.airflow.steps`) through its cached ``hook``
(`CheckpointHook`) and returns a JSON-able dict (the XCom). Storage credentials come
from ``storage_conn_id`` (an ``aws`` connection) as storage options, never from or
into the environment::

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

Every operator takes ``storage``, ``job`` and ``storage_conn_id`` (and, for a job on
the external backend, ``state_db_conn_id`` or ``state_db``, and ``state_table``: the
run writes to that database, validation reads it, retention vacuums it), then its own
arguments (`ARGUMENTS` of its class: name -> default), then BaseOperator's
(``task_id``, ``retries`` ...). ``CkptRunJobOperator``'s own arguments are the run
options declared in `statebackend.run_options` (``input_path``, ``output_path``,
``parallelism``, ``engine`` ...; the templated ones are its template fields). An
unknown argument is refused in one line naming it. Yes/no arguments (``dry_run``,
``deep``) accept a bool or its text (``"True"``, a rendered template) and refuse
anything else, naming the argument.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, ClassVar

from airflow.sdk import BaseOperator

from statebackend import defaults
from statebackend.airflow.connection import StateDatabase
from statebackend.airflow.hook import CheckpointHook
from statebackend.airflow.steps import (
    RUN_KEY_TEMPLATE,
    gc_store,
    make_run_config,
    migrate_storage,
    publish_extra,
    rescale_store,
    retain_store,
    run_job_once,
    validate_store,
)
from statebackend.run_options import RunOption, run_options
from statebackend.settings import boolean
from statebackend.state.external_store import DEFAULT_TABLE

REQUIRED = object()  # an argument without a default
# BaseOperator's own keyword arguments (task_id, retries, default_args ...), and the private
# ones Airflow passes when it maps or validates an operator.
BASE_ARGUMENTS = frozenset(name for name in inspect.signature(BaseOperator.__init__).parameters
                           if name not in ("self", "kwargs"))
# An external-backend job's database: arguments every operator takes beside the common
# ones (read into the hook's `StateDatabase`)
DATABASE_ARGUMENTS: Mapping[str, Any] = {"state_db": None, "state_db_conn_id": None,
                                         "state_table": DEFAULT_TABLE}
COMMON_ARGUMENTS = ("storage", "job", "storage_conn_id", *DATABASE_ARGUMENTS)


def _as_int(value: Any) -> Any:
    """A rendered template ("3") as an int; other values unchanged (the library checks)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value


class _CheckpointOperator(BaseOperator):
    """Common arguments: the storage root, the job's folder, the storage connection, and
    an external-backend job's database (``state_db`` URL or ``state_db_conn_id``, a
    postgres connection, and ``state_table``); the class's own arguments (`ARGUMENTS`)
    become attributes (templates render them)."""

    ui_color = "#e8f1fb"
    ARGUMENTS: ClassVar[Mapping[str, Any]] = {}
    # the DATABASE_ARGUMENTS, set by __init__
    state_db: str | None
    state_db_conn_id: str | None
    state_table: str

    def __init__(self, *, storage: str, job: str, storage_conn_id: str | None = None,
                 **kwargs: Any) -> None:
        arguments = {**DATABASE_ARGUMENTS, **self.ARGUMENTS}
        own = {name: kwargs.pop(name) for name in list(kwargs) if name in arguments}
        self._refuse_unknown(kwargs)
        super().__init__(**kwargs)
        self.storage = storage
        self.job = job
        self.storage_conn_id = storage_conn_id
        for name, default in arguments.items():
            value = own.get(name, default)
            if value is REQUIRED:
                raise TypeError(f"{type(self).__name__} (task_id {self.task_id!r}): missing "
                                f"argument {name!r}")
            setattr(self, name, dict(value) if isinstance(value, Mapping) else value)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give each operator an ``__init__`` whose signature names its own arguments:
        Airflow reads it to fill them from ``default_args``, to require those without a
        default and to check ``partial()``/``expand()`` arguments (the body is the base's)."""
        super().__init_subclass__(**kwargs)
        if "__init__" in vars(cls):
            return

        def __init__(self: _CheckpointOperator, **kw: Any) -> None:
            _CheckpointOperator.__init__(self, **kw)

        base = inspect.signature(_CheckpointOperator.__init__).parameters
        own = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                 default=inspect.Parameter.empty if default is REQUIRED
                                 else default)
               for name, default in {**DATABASE_ARGUMENTS, **cls.ARGUMENTS}.items()]
        params = [*list(base.values())[:-1], *own, base["kwargs"]]
        __init__.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        cls.__init__ = __init__  # type: ignore[method-assign]

    @classmethod
    def _refuse_unknown(cls, kwargs: Mapping[str, Any]) -> None:
        """One line naming the first argument neither ours nor BaseOperator's."""
        known = [*COMMON_ARGUMENTS, *cls.ARGUMENTS, *sorted(BASE_ARGUMENTS)]
        for name in kwargs:
            if name in BASE_ARGUMENTS or name.startswith("_airflow"):
                continue
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{cls.__name__} (task_id {kwargs.get('task_id')!r}): unknown "
                            f"argument {name!r}{hint}; its own arguments are "
                            f"{[*COMMON_ARGUMENTS, *cls.ARGUMENTS]}")

    @cached_property
    def hook(self) -> CheckpointHook:
        """The job's checkpoint store through ``storage_conn_id``, and its database
        (built once per task; the connections are read when a task needs them)."""
        return CheckpointHook(self.storage_conn_id, storage=self.storage, job=self.job,
                              state_db=StateDatabase(self.state_db, self.state_db_conn_id,
                                                     self.state_table))

    def yes_no(self, name: str) -> bool:
        """Yes/no argument ``name`` (a bool, or its text from a rendered template)."""
        return boolean(getattr(self, name), f"{type(self).__name__} argument {name}")


# The run options the operator takes beside storage and job (its base's), by argument name.
RUN_ARGUMENTS: dict[str, RunOption] = {
    opt.argument: opt for opt in run_options()
    if opt.argument is not None and opt.argument not in COMMON_ARGUMENTS}


class CkptRunJobOperator(_CheckpointOperator):
    """Run one interval of a stateful job in this worker (local Spark or ``master``).

    Arguments: ``job_ref`` (required), then the run options (`statebackend.run_options`),
    e.g. ``input_path`` (required), ``output_path``, ``run_key`` (default:
    `RUN_KEY_TEMPLATE`), ``job_options``, ``parallelism``, ``engine``: ``auto`` (a small
    interval runs in this task's process, no JVM), ``spark`` or ``local``.
    """

    ARGUMENTS: ClassVar[Mapping[str, Any]] = {
        "job_ref": REQUIRED,
        **{argument: RUN_KEY_TEMPLATE if opt.name == "run_id"
           else REQUIRED if opt.required else opt.default_value()
           for argument, opt in RUN_ARGUMENTS.items()}}
    template_fields: Sequence[str] = tuple(
        opt.argument for opt in run_options() if opt.templated and opt.argument)
    job_ref: str  # each ARGUMENTS entry is an attribute, set by the base's __init__

    def execute(self, context) -> dict:
        values = {opt.name: opt.parse(getattr(self, argument), f"CkptRunJobOperator argument "
                                                               f"{argument}")
                  for argument, opt in RUN_ARGUMENTS.items()}
        config = make_run_config({
            **values, "storage": self.storage, "job": self.job,
            "storage_options": self.hook.storage_options(),
            "state_db": self.hook.state_db_url(), "state_table": self.state_table,
            "context": _airflow_context(context), "logical_time_ms": _interval_end_ms(context)})
        return run_job_once(self.job_ref, config, entry=self.job)


class CkptValidateOperator(_CheckpointOperator):
    """Validate the checkpoint committed by ``run_key`` (or ``checkpoint``); fail on breaks.

    With ``outlets`` (Assets), each gets the checkpoint's figures as its event extra.
    ``level``: ``"manifest"`` (default), ``"deep"`` or ``"full"``; ``deep=True`` is
    ``level="deep"``. ``report``: ``"now"`` renders the Great Expectations report after
    the verdict, ``"none"`` decides without importing GE (summary and overview page only).
    """

    ARGUMENTS: ClassVar[Mapping[str, Any]] = {
        "run_key": None, "checkpoint": "latest", "deep": False, "level": None,
        "job_ref": None, "report": "now"}
    template_fields: Sequence[str] = ("storage", "run_key", "checkpoint")
    # the ARGUMENTS, set by the base's __init__ (templates render them to text)
    run_key: str | None
    checkpoint: str | int
    deep: bool | str
    level: str | None
    job_ref: str | None
    report: str

    def execute(self, context) -> dict:
        # the validation package when a task runs: DAG files import this module
        from statebackend.validation.options import ValidationOptions

        level = self.level or ("deep" if self.yes_no("deep") else "manifest")
        options = ValidationOptions(level=level, report=self.report,
                                    state_db=self.hook.get_state_db())
        result = validate_store(self.hook.get_store(), options, run_id=self.run_key or None,
                                ref=_as_int(self.checkpoint), job_ref=self.job_ref)
        for asset in self.outlets or ():
            context["outlet_events"][asset].extra = publish_extra(result)
        return result


class CkptRetainOperator(_CheckpointOperator):
    """Keep the newest ``keep`` checkpoints (plus savepoints and leased ones)."""

    ARGUMENTS: ClassVar[Mapping[str, Any]] = {"keep": defaults.RETENTION_KEEP, "dry_run": False}
    template_fields: Sequence[str] = ("storage", "keep", "dry_run")
    # the ARGUMENTS, set by the base's __init__ (templates render text); ``dry_run`` is
    # read with `yes_no` (its attribute shadows BaseOperator.dry_run())
    keep: int | str

    def execute(self, context) -> dict:
        return retain_store(self.hook.get_store(), keep=_as_int(self.keep),
                            dry_run=self.yes_no("dry_run"), state_db=self.hook.get_state_db())


class CkptGcOperator(_CheckpointOperator):
    """Delete shared files nothing references (orphans only after ``grace_seconds``)."""

    ARGUMENTS: ClassVar[Mapping[str, Any]] = {
        "grace_seconds": defaults.GC_GRACE_SECONDS, "dry_run": False}
    template_fields: Sequence[str] = ("storage", "grace_seconds", "dry_run")
    grace_seconds: float | str  # the ARGUMENTS, set by the base's __init__

    def execute(self, context) -> dict:
        return gc_store(self.hook.get_store(), grace_seconds=float(self.grace_seconds),
                        dry_run=self.yes_no("dry_run"))


class CkptRescaleOperator(_CheckpointOperator):
    """Rescale-restore ``checkpoint`` to ``parallelism`` subtasks (a new checkpoint)."""

    ARGUMENTS: ClassVar[Mapping[str, Any]] = {
        "parallelism": REQUIRED, "checkpoint": "latest", "dry_run": False, "master": None}
    template_fields: Sequence[str] = ("storage", "parallelism", "checkpoint", "dry_run")
    # the ARGUMENTS, set by the base's __init__ (templates render them to text)
    parallelism: int | str
    checkpoint: str | int
    master: str | None

    def execute(self, context) -> dict:
        # Spark and RocksDB when a rescale runs: DAG files import this module
        from statebackend.rescale.executor import RescaleOptions

        options = RescaleOptions(master=self.master, dry_run=self.yes_no("dry_run"),
                                 state_db=self.hook.get_state_db())
        return rescale_store(self.hook.get_store(), options,
                             parallelism=_as_int(self.parallelism),
                             checkpoint=_as_int(self.checkpoint))


class CkptMigrateOperator(_CheckpointOperator):
    """Transform ``source``'s state (``<job>:latest``, ``<job>:<id>``,
    ``<job>/savepoints/<name>``) through ``transform_ref`` (module:attr of a StateTransform
    or a per-key function) into savepoint ``savepoint`` of ``target_ref``'s job, in the
    folder ``job`` (`ckpt migrate`); on Spark with ``master``. The result's
    ``start_from`` is what the new job's first run starts from. An external-backend
    source is read from its database (the common ``state_db_conn_id`` or ``state_db``,
    and ``state_table``)."""

    ARGUMENTS: ClassVar[Mapping[str, Any]] = {
        "source": REQUIRED, "transform_ref": REQUIRED, "target_ref": REQUIRED,
        "savepoint": REQUIRED, "parallelism": None, "max_parallelism": None, "master": None,
        "dry_run": False}
    template_fields: Sequence[str] = ("storage", "source", "savepoint", "parallelism",
                                      "dry_run")
    # the ARGUMENTS, set by the base's __init__ (templates render them to text)
    source: str
    transform_ref: str
    target_ref: str
    savepoint: str
    parallelism: int | str | None
    max_parallelism: int | str | None
    master: str | None

    def execute(self, context) -> dict:
        # the job package only when a task runs: DAG files import this module
        from statebackend.job.transform import TransformOptions

        options = TransformOptions(
            target_job=self.job, parallelism=_as_int(self.parallelism) or None,
            max_parallelism=_as_int(self.max_parallelism) or None, master=self.master,
            dry_run=self.yes_no("dry_run"), state_db=self.hook.get_state_db())
        return migrate_storage(self.hook.get_storage(), self.source, self.transform_ref,
                               self.target_ref, self.savepoint, options)


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
