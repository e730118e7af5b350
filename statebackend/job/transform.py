"""Transform a job's state into a savepoint of a new job: the escape hatch for what the
schema-evolution rules refuse (a state split or merged, a kind or codec changed, the
key changed).

``transform_state(storage, source, transform, target, savepoint)``:

1. plan (`plan_transform`, pure reads, printable with ``dry_run``): ``source`` is a
   start-point spec (``<job>:latest``, ``<job>:<id>``, ``<job>/savepoints/<name>`` or a
   savepoint's name); the savepoint ``<target_job>/savepoints/<savepoint>`` must be
   free; the new lineage's parallelism and key groups default to the source's;
2. hold the source (a lease: retention and GC keep a checkpoint's files while it is
   read; a savepoint cannot be deleted meanwhile) and read its record again;
3. every source subtask is restored read-only and its state read span by span through
   the user's function (`statebackend.job.transform_apply`: per key or per Arrow batch,
   across the states of the same key);
4. the results are written as the new job's savepoint by the bootstrap writer
   (`statebackend.job.bootstrap`: rows routed by the key-group rule, sorted SSTs
   ingested per subtask, files checked, ``_metadata`` last). Without Spark, in this
   process's threads; with ``spark``, one Spark task per source subtask runs the
   function and the rows are shuffled by the new key's subtask to one Spark task per
   new subtask (`statebackend.job.transform_spark`): a change of key goes through
   that shuffle.

The savepoint records where it came from (``source``: job, checkpoint, savepoint and
the transform's name) and carries the source's watermark and processing time, so the
new lineage's event time and TTL clocks continue. A new lineage ``--start-from``s it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from statebackend.checkpoint.layout import savepoint_dir
from statebackend.checkpoint.leases import hold
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.restore import current_external_read, external_read
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.job.bootstrap import Origin, bootstrap_task, write_savepoint, write_tables
from statebackend.job.bootstrap_write import Destination
from statebackend.job.load import load_object
from statebackend.job.transform_apply import (
    SourceRead,
    StateTransform,
    empty_table,
    transformed_spans,
)
from statebackend.lifecycle.registry import check_savepoint_name, load_savepoint
from statebackend.lifecycle.savepoint import (
    check_savepoint_free,
    load_start_point,
    parse_start_spec,
    savepoint_purpose,
)
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.spark.connect_sessions import kept_session
from statebackend.state.external_store import ExternalStore
from statebackend.state.families import TIMERS
from statebackend.state.keygroups import check_parallelism
from statebackend.state.kinds import StateDescriptor
from statebackend.state.state_table import readable
from statebackend.storage import Storage, open_storage
from statebackend.subtasks import run_in_threads

LABEL = "source subtasks"


@dataclass(frozen=True)
class TransformOptions:
    """How a transform writes and runs.

    ``target_job``: the new job's folder (default its name); ``parallelism`` and
    ``max_parallelism`` of the new lineage (default the source's); ``spark``: a session
    to run on, or ``master`` (``local[2]``, ``spark://...``, ``sc://...``) to get one
    (stopped after if this call started it); neither: this process's threads;
    ``dry_run``: the plan only; ``local_dir``: the local-recovery root the source's
    subtasks are looked for in; ``state_db``: the database of an external-backend source
    (its key groups are queried at the source's version); ``connect_session`` on a Connect
    ``master``: ``job`` attaches to the session kept for the new job's migrations, ``new``
    opens one (statebackend.spark.connect_sessions); ``progress``: where progress goes.
    """

    target_job: str | None = None
    parallelism: int | None = None
    max_parallelism: int | None = None
    master: str | None = None
    dry_run: bool = False
    local_dir: str | None = None
    state_db: ExternalStore | None = None
    connect_session: str = "job"
    spark: Any = field(default=None, compare=False, repr=False)
    progress: ProgressSink = field(default=NO_PROGRESS, compare=False, repr=False)

    @property
    def engine(self) -> str:
        return "local" if self.spark is None and not self.master else "spark"


@dataclass(frozen=True)
class TransformPlan:
    """What a transform reads and writes (printed by ``--dry-run``)."""

    source_job: str
    source_kind: str  # "checkpoint" or "savepoint"
    source_savepoint: str | None
    checkpoint_id: int
    source_parallelism: int
    source_states: tuple[str, ...]
    source_entries: int
    target_job: str
    target_states: tuple[str, ...]
    savepoint: str
    parallelism: int
    max_parallelism: int
    transform: str
    per: str
    engine: str  # "local" (this process's threads) or "spark"
    watermark: int | None
    processing_time: int | None

    @property
    def source_label(self) -> str:
        return f"savepoint {self.source_savepoint} of job {self.source_job}" \
            if self.source_savepoint else \
            f"checkpoint {self.checkpoint_id} of job {self.source_job}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "source_states": list(self.source_states),
                "target_states": list(self.target_states)}

    def lines(self) -> list[str]:
        return [
            f"read:  {self.source_label}: {self.source_entries} entries of "
            f"{list(self.source_states)} in {self.source_parallelism} subtasks",
            f"apply: {self.transform} per {self.per}, on {self.engine}",
            f"write: savepoint {self.savepoint} of job {self.target_job}: "
            f"{list(self.target_states)} in {self.parallelism} subtasks, "
            f"{self.max_parallelism} key groups; start a new lineage from it with "
            f"--start-from {self.target_job}/{savepoint_dir(self.savepoint)}"]


def as_transform(transform: object) -> StateTransform:
    """A function alone is taken per key."""
    if isinstance(transform, StateTransform):
        return transform
    if not callable(transform):
        raise UsageError(f"transform is a {type(transform).__name__}; give a function or a "
                         "StateTransform")
    return StateTransform(transform)


def load_transform(ref: str) -> StateTransform:
    """``module:attr`` naming a `StateTransform` or a function (taken per key)."""
    return as_transform(load_object(ref, "transform", "mypkg.migrations:split_totals"))


def plan_transform(storage: Storage, source: str, transform: StateTransform, target: Job,
                   savepoint: str, options: TransformOptions = TransformOptions()
                   ) -> TransformPlan:
    """The plan of a transform (module doc, step 1); one-line errors for an unknown
    source, a taken savepoint name or a bad parallelism."""
    check_savepoint_name(savepoint)
    kind, job, what = parse_start_spec(storage, source)
    meta = load_start_point(storage, kind, job, what)
    current_external_read(meta, options.state_db)  # one line if it cannot be read
    target_store = CheckpointStore(storage, options.target_job or target.name)
    check_savepoint_free(target_store, savepoint)
    p = options.parallelism or meta.parallelism
    m = options.max_parallelism or meta.max_parallelism
    check_parallelism(p, m)
    read = _states(meta)
    return TransformPlan(
        source_job=meta.job, source_kind=kind,
        source_savepoint=what if kind == "savepoint" else None,
        checkpoint_id=meta.checkpoint_id, source_parallelism=meta.parallelism,
        source_states=read,
        source_entries=sum(h.row_counts.get(s, 0) for h in meta.subtasks for s in read),
        target_job=target_store.job,
        target_states=tuple(d.name for d in target.states)
        + ((TIMERS,) if target.on_timer is not None else ()),
        savepoint=savepoint, parallelism=p, max_parallelism=m, transform=transform.name,
        per=transform.per, engine=options.engine, watermark=meta.watermark,
        processing_time=meta.processing_time)


def transform_state(storage: str | Storage, source: str,
                    transform: StateTransform | Callable[..., Any], target: Job,
                    savepoint: str, options: TransformOptions = TransformOptions()
                    ) -> dict[str, Any]:
    """Transform ``source``'s state through ``transform`` into savepoint ``savepoint`` of
    ``target`` (module doc); returns the plan (``plan``), and unless ``dry_run`` the
    savepoint's summary (``start_from``, ``entries`` ...) and ``seconds``."""
    started = time.perf_counter()
    root = open_storage(storage) if isinstance(storage, str) else storage
    fn = as_transform(transform)
    if options.engine == "spark" and root.process_local:
        raise UsageError(f"storage {root.url} lives in this process only: Spark tasks cannot "
                         "read it; use file:// or s3:// storage")
    plan = plan_transform(root, source, fn, target, savepoint, options)
    out: dict[str, Any] = {"plan": plan.to_json(), "plan_text": plan.lines(),
                           "dry_run": options.dry_run}
    if options.dry_run:
        return out
    source_store = CheckpointStore(root, plan.source_job)
    purpose = (savepoint_purpose(plan.source_savepoint, f"transform into {plan.target_job}")
               if plan.source_savepoint else f"transform into {plan.target_job}")
    with hold(source_store.storage, purpose,
              [] if plan.source_savepoint else [plan.checkpoint_id]):
        meta = load_savepoint(source_store, plan.source_savepoint) \
            if plan.source_savepoint else source_store.load(plan.checkpoint_id)
        read = _source_read(plan, meta, root, fn, target, options)
        origin = Origin({"job": plan.source_job, "checkpoint": plan.checkpoint_id,
                         "savepoint": plan.source_savepoint,
                         "transform": {"function": fn.name, "per": fn.per}},
                        meta.watermark, meta.processing_time)
        summary = _write(CheckpointStore(root, plan.target_job), plan, read, origin, options)
    return dict(out, **summary, seconds=round(time.perf_counter() - started, 3))


def _write(store: CheckpointStore, plan: TransformPlan, read: SourceRead, origin: Origin,
           options: TransformOptions) -> dict[str, Any]:
    """The savepoint written into ``store`` from the function's results (module doc, steps
    3 and 4)."""
    task = bootstrap_task(read.target, store, plan.parallelism, plan.max_parallelism,
                          Destination(savepoint=plan.savepoint))
    claim = {"transform": read.transform.name}
    if options.engine == "local":
        return write_tables(task, store, _transform_local(read, options.progress), claim,
                            origin)
    # Spark only when asked for
    from statebackend.job.transform_spark import transform_with_spark
    from statebackend.spark.session import get_spark, owned_session

    with owned_session():
        progress = options.progress
        if options.spark is None:
            progress.phase("starting Spark")
        spark = options.spark or get_spark(
            options.master, app_name="ckpt-migrate", job_session=kept_session(
                options.master, store.root_storage.url, store.job, purpose="migrate",
                mode=options.connect_session, local_dir=options.local_dir))
        progress.phase(f"{LABEL} (Spark tasks)")
        summary, _ = write_savepoint(task, store, plan.savepoint,
                                     lambda: transform_with_spark(spark, read, task), claim,
                                     origin)
    return summary


def _states(meta: CheckpointMetadata) -> tuple[str, ...]:
    """The source's states the function sees (the job's own, and the timers)."""
    return tuple(d.name for d in readable(StateDescriptor.from_json(s) for s in meta.states))


def _source_read(plan: TransformPlan, meta: CheckpointMetadata, root: Storage,
                 transform: StateTransform, target: Job, options: TransformOptions
                 ) -> SourceRead:
    if meta.checkpoint_id != plan.checkpoint_id:
        raise UsageError(f"{plan.source_label} changed since the plan; run the transform "
                         "again")
    return SourceRead(
        storage_url=root.url, storage_options=root.options, job_dir=plan.source_job,
        checkpoint_id=meta.checkpoint_id, max_parallelism=meta.max_parallelism,
        descriptors=tuple(StateDescriptor.from_json(s) for s in meta.states),
        handles=tuple(meta.subtasks),
        clocks={"event": meta.watermark, "processing": meta.processing_time},
        transform=transform, target=target, local_dir=options.local_dir,
        external=external_read(meta, options.state_db))


def _transform_local(read: SourceRead, progress: ProgressSink) -> dict[str, pa.Table]:
    """Every source subtask through the function in threads; the results per state."""
    progress.phase(LABEL, total=len(read.handles), unit="subtasks")
    parts = run_in_threads(len(read.handles), lambda i: list(transformed_spans(read, i)),
                           workers=2, progress=progress, word="source subtask")
    by_state: dict[str, list[pa.Table]] = {}
    for spans in parts:
        for result in spans:
            for state, table in result.items():
                by_state.setdefault(state, []).append(table)
    if not by_state:  # nothing to write: an empty savepoint of the new job's states
        return _empty(read)
    out = {}
    for state, parts_of_state in by_state.items():
        try:
            out[state] = pa.concat_tables(parts_of_state, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise UsageError(f"transform {read.transform.name}: the tables of state "
                             f"{state!r} differ in their columns' types from batch to batch: "
                             f"{exc}") from None
    return out


def _empty(read: SourceRead) -> dict[str, pa.Table]:
    first = read.target.states[0]
    return {first.name: empty_table(read, first)}


def transform_summary_lines(result: Mapping[str, Any]) -> list[str]:
    """What `ckpt migrate` prints of a result."""
    lines = list(result["plan_text"])
    if result.get("dry_run"):
        return ["dry run: nothing read or written", *lines]
    entries = result.get("entries", {})
    written = sum(n for family, n in entries.items() if not family.startswith("_"))
    return [*lines, f"wrote {written} entries of {sorted(entries)} in "
                    f"{result['seconds']} s at {result['url']}"]
