"""The run protocol, written once for every job: `run_job(job, RunConfig(...))`.

One run (driver side; executors: `statebackend.job.task`)::

    committed run id?  -> skipped; finish its output publication (_SUCCESS) if a crash
                          came between its commit and the marker (no lease needed)
    writer lease       -> a concurrent writer is refused (LeaseConflictError)
    parent = latest checkpoint (or --start-from on the first run); its states must
             be the job's states (name, kind, codec), else a one-line UsageError
    list input         -> unsupported files counted; Parquet footers checked (one-line
                          InputError naming a bad file, before any Spark work)
    engine             -> Spark, or the local engine in this process for a small input
                          (statebackend.job.engine decides; job.local_engine runs the
                          same tasks by the same rules without a JVM); below, the Spark
                          engine's steps (job.spark_engine)
    read               -> the job's input columns, typed, with raw text (job.input)
    key group, subtask -> partition i holds exactly subtask i's rows (spark.dispatch)
    task i             -> restore, validate + logic (SubtaskProcessor), outputs and
                          quarantine, snapshot + upload, handle (job.task)
    event time         -> the new watermark: advance(parent's, max event time of the rows
                          that are not late, allowed lateness), before the tasks: the
                          latest rows by event time (a JVM top-k) validated on the driver,
                          or a pass over every row when they do not settle it; subtasks
                          with a due timer or expiry run without rows
    task i             -> ... then fire due timers (handler, time order), purge expired
                          TTL entries (compacting), snapshot
    driver             -> reject check, commit chk-<id>/_metadata (run id, input,
                          watermark, processing time) through
                          one `Attempt`, or discard every upload and leave the parent latest;
                          then _SUCCESS in every run folder of the outputs

Outputs: ``<output>/run=<run>/part-<subtask>.parquet`` for a job with one output,
``<output>/<name>/run=<run>/...`` with several; rejected rows go to
``<quarantine>/run=<run>/`` (default quarantine: ``<output>/_quarantine``).
The summary (`run_job`'s result) is one JSON-able dict; see `summary`.

Progress (``run_job(..., progress=)``, a `statebackend.progress.ProgressSink`), from the
driver: planning, checking the input files, starting Spark, the event-time pass and
reading the input (Spark tasks done), the subtasks done of P as their tasks finish
(`statebackend.spark.progress`), committing, publishing the outputs.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from statebackend import settings
from statebackend.checkpoint.attempt import Attempt, cleanup_committed
from statebackend.checkpoint.metadata import (
    MAX_COUNT,
    CheckpointMetadata,
    SubtaskHandle,
    utc_now_iso,
)
from statebackend.checkpoint.runs import RunOutcome, RunRecord, record_outcome, safe_run_name
from statebackend.checkpoint.store import CheckpointStore, build_metadata
from statebackend.errors import (
    CkptError,
    JobRunError,
    RejectThresholdError,
    TaskFailedError,
    UsageError,
)
from statebackend.job.api import Job
from statebackend.job.config import RunConfig
from statebackend.job.core import LATE
from statebackend.job.engine import (
    Engine,
    EngineChoice,
    choose_engine,
    input_weight,
    is_local_master,
    local_master_cores,
    requested_engine,
)
from statebackend.job.input import (
    READERS,
    InputFiles,
    check_parquet,
    choose_reader,
    list_input,
)
from statebackend.job.task import TaskParams, output_folder, part_name
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.settings import number
from statebackend.state.keygroups import DEFAULT_MAX_PARALLELISM, check_parallelism
from statebackend.state.kinds import INTERNAL_STATES
from statebackend.state.schema import (
    KEY,
    MIGRATE_HINT,
    EvolutionPlan,
    StateChange,
    plan_evolution,
)
from statebackend.state.watermark import advance
from statebackend.storage import Storage

ARROW_BATCH_ROWS = 100_000  # rows per Arrow batch handed to the logic
TIMING_KEYS = ("restoring", "processing", "snapshotting", "uploading", "committing")
log = logging.getLogger(__name__)


def run_dir_name(run_id: str) -> str:
    """Folder of one run under output/quarantine: readable, path-safe, collision-free."""
    return f"run={safe_run_name(run_id)}"


def run_folders(job: Job, run_id: str) -> dict[str, str]:
    """{output name: its run folder relative to the output root}."""
    run_dir = run_dir_name(run_id)
    return {o.name: "/".join(x for x in (output_folder(job, o.name), run_dir) if x)
            for o in job.outputs}


def summary(job: Job, config: RunConfig, *, checkpoint_id: int | None,
            parallelism: int | None, started: float, skipped: bool, events: int = 0,
            rejected: int = 0, keys: int = 0, uploaded: int = 0, timings: dict | None = None,
            **extra: object) -> dict:
    out = {
        "run_id": config.run_id, "job": config.job_dir(job), "checkpoint_id": checkpoint_id,
        "events_read": events, "events_rejected": rejected, "keys_touched": keys,
        "bytes_uploaded": uploaded, "duration_s": round(time.perf_counter() - started, 3),
        "parallelism": parallelism, "skipped": skipped,
        "timings": {k: round((timings or {}).get(k, 0.0), 3) for k in TIMING_KEYS},
        "job_kind": job.name,
    }
    out.update(extra)
    return out


# -- the run ---------------------------------------------------------------------------
def run_job(job: Job, config: RunConfig, spark=None,
            progress: ProgressSink = NO_PROGRESS) -> dict:
    """Run ``job`` once; return the summary. Raises CkptError subclasses (one line).

    Every outcome (committed, skipped, failed) is recorded in the run history
    (``runs/history/``, runs.py) for the Checkpoints page. ``progress`` receives the
    run's phases and counts (module docstring).
    """
    started = time.perf_counter()
    started_at = utc_now_iso()
    options = _check_config(job, config)
    job = job.configured(options)
    store = CheckpointStore(config.open(config.storage), config.job_dir(job))
    progress.phase(f"run {config.run_id}: planning")
    done = store.find_run(config.run_id)
    if done is not None and not store.run_still_counts(done):
        done = None  # it names a lost commit: the lineage check under the lease says so
    if done is None:
        # a job that cannot continue its lineage is refused before anything is written
        base = _base_of(config, store)
        evolution_plan(job, base, store.job)
        _check_max_parallelism(config, base)
    outcome = RunOutcome(config.run_id, "failed", None, started_at, 0.0, None,
                         dict(config.context))
    try:
        result = _skipped(job, config, store, done, started) if done is not None else \
            _run(job, config, spark, options, store, started, progress)
    except CkptError as exc:
        outcome = replace(outcome, error=str(exc))
        raise
    else:
        outcome = replace(outcome, outcome="skipped" if result["skipped"] else "committed",
                          checkpoint_id=result["checkpoint_id"])
        return result
    finally:
        record_outcome(store.storage, replace(
            outcome, duration_s=round(time.perf_counter() - started, 3)))


def _run(job: Job, config: RunConfig, spark, options: dict, store: CheckpointStore,
         started: float, progress: ProgressSink) -> dict:
    # The lineage is checked (forks, lost commits, forgotten runs) under the lease,
    # before anything else: a run id is counted once (checkpoint/lineage.py).
    with store.writer(f"{job.name} run {config.run_id}") as session:
        done = store.find_run(config.run_id, session.lineage)
        if done is not None:
            return _skipped(job, config, store, done, started)
        warnings: list[str] = []
        evolution = evolution_plan(job, session.lineage.latest or _base_of(config, store),
                                   store.job)
        parent = _parent(config, store, session.lineage.latest, warnings)
        files = list_input(config.input, config.storage_options)
        progress.phase(f"run {config.run_id}: checking {files.count} input files")
        check_parquet(files, job.input)  # before Spark starts: a bad file costs no session
        # Weighing decompresses gzip input (downloads it from S3): only ``auto`` needs it.
        weight = (input_weight(files) if requested_engine(config.engine) == "auto"
                  else files.total_bytes)
        choice = choose_engine(
            config.engine, input_bytes=weight, master=config.master,
            first_run_without_parallelism=parent is None and config.parallelism is None,
            parent_state_bytes=parent.bytes_referenced if parent else 0)
        engine = _engine(choice, job, config, store, files, spark, progress)
        return _run_attempt(engine, choice, job, config, options, store, parent, files,
                            started, warnings, progress, evolution)


def _engine(choice: EngineChoice, job: Job, config: RunConfig, store: CheckpointStore,
            files: InputFiles, spark, progress: ProgressSink) -> Engine:
    """The engine object of ``choice``: the local engine, or Spark (started if needed)."""
    if choice.engine == "local":
        from statebackend.job.local_engine import LocalEngine

        return LocalEngine(files, job, cores=local_master_cores(config.master)
                           if is_local_master(config.master) else None)
    if store.storage.process_local:
        raise UsageError(f"storage {config.storage} lives in one process, but Spark tasks run "
                         "in others: use a file:// path or s3://, or --engine local")
    from statebackend.job.spark_engine import SparkEngine

    if spark is None:
        from statebackend.spark.session import get_spark, quiet_console

        progress.phase("starting Spark")
        # A caller that shows progress (even CKPT_PROGRESS=off) wants no Spark console bar.
        quiet = None if progress is NO_PROGRESS else quiet_console(config.master)
        spark = get_spark(config.master, app_name=f"{job.name}-{store.job}", conf=quiet)
    return SparkEngine(spark, files, config.input_reader)


def _check_config(job: Job, config: RunConfig) -> dict:
    settings.check_environment()  # every CKPT_* setting, before any work
    number(config.max_reject_fraction, "--max-reject-fraction", maximum=1.0)
    if config.logical_time_ms is not None:
        number(config.logical_time_ms, "--logical-time-ms", minimum=-MAX_COUNT,
               maximum=MAX_COUNT, integer=True)
    if not config.run_id:
        raise UsageError("--run-id must not be empty")
    if job.outputs and not config.output:
        raise UsageError(f"job {job.name!r} writes outputs {[o.name for o in job.outputs]}: "
                         "give --output")
    config.quarantine_url  # noqa: B018 - raises when neither is given
    requested_engine(config.engine)  # a bad --engine / $CKPT_ENGINE fails before any work
    if config.input_reader not in READERS:
        raise UsageError(f"input reader {config.input_reader!r} is unknown; use one of "
                         f"{list(READERS)}")
    return dict(job.resolve_options(config.options))


def _parent(config: RunConfig, store: CheckpointStore, parent: CheckpointMetadata | None,
            warnings: list[str]) -> CheckpointMetadata | None:
    if parent is None and config.start_from:
        from statebackend.lifecycle.savepoint import import_start_point

        return import_start_point(store.root_storage, store.job, config.start_from)
    if config.start_from:
        _warn(warnings, f"--start-from ignored: job {store.job!r} already has checkpoint "
                        f"{parent.checkpoint_id}")
    return parent


def _warn(warnings: list[str], text: str) -> None:
    log.warning("%s", text)
    warnings.append(text)


def _check_max_parallelism(config: RunConfig, base: CheckpointMetadata | None) -> None:
    """Key groups never change once data exists: another max parallelism is refused."""
    asked = config.max_parallelism
    if base is not None and asked not in (DEFAULT_MAX_PARALLELISM, base.max_parallelism):
        raise UsageError(f"--max-parallelism {asked} differs from the lineage's "
                         f"{base.max_parallelism}: key groups never change once data exists; "
                         f"{MIGRATE_HINT}")


def new_lineage_plan(job: Job) -> EvolutionPlan:
    """The schemas of a lineage's first checkpoint: every state added at version 1."""
    return plan_evolution((), job.descriptors, internal=tuple(INTERNAL_STATES))


def _base_of(config: RunConfig, store: CheckpointStore) -> CheckpointMetadata | None:
    """What the run would build on: the latest checkpoint, else its start point (read,
    not copied)."""
    latest = store.latest()
    if latest is None and config.start_from:
        from statebackend.lifecycle.savepoint import read_start_point

        return read_start_point(store.root_storage, config.start_from)
    return latest


def evolution_plan(job: Job, base: CheckpointMetadata | None, job_dir: str
                   ) -> EvolutionPlan | None:
    """How the job's states continue ``base``'s (statebackend.state.schema); UsageError
    naming the state and the change when they cannot, before any work."""
    plan = plan_for(job, base)
    if plan is not None:
        plan.require_compatible(job.name, f"the lineage of {job_dir!r} (checkpoint "
                                          f"{base.checkpoint_id})")
    return plan


def plan_for(job: Job, base: CheckpointMetadata | None) -> EvolutionPlan | None:
    """The evolution plan of ``job`` on ``base`` (None: a new lineage), refusals included:
    a changed key column is refused like a state change. Internal families (timers, TTL
    index) are the backend's, not compared."""
    if base is None:
        return None
    plan = plan_evolution(base.states, job.descriptors, renamed=job.renamed_states,
                          dropped=job.dropped_states, checkpoint_id=base.checkpoint_id,
                          internal=tuple(INTERNAL_STATES))
    stored_key = base.extra.get("key") if base.extra else None
    if stored_key is not None and stored_key != job.key:
        key = StateChange(KEY, "refused", (
            f"the key column changes from {stored_key!r} to {job.key!r}; {MIGRATE_HINT}",))
        plan = replace(plan, changes=(key, *plan.changes))
    return plan


def _lineage_shape(config: RunConfig, parent: CheckpointMetadata | None, engine: Engine,
                   warnings: list[str]) -> tuple[int, int]:
    if parent is not None:
        if config.parallelism is not None and config.parallelism != parent.parallelism:
            _warn(warnings, f"parallelism {config.parallelism} ignored: the lineage keeps "
                            f"{parent.parallelism} (use rescale-restore to change parallelism)")
        return parent.parallelism, parent.max_parallelism
    if config.parallelism is not None:
        check_parallelism(config.parallelism, config.max_parallelism)
        return config.parallelism, config.max_parallelism
    p = min(engine.default_parallelism(), config.max_parallelism)
    check_parallelism(p, config.max_parallelism)
    return p, config.max_parallelism


def _run_attempt(engine: Engine, choice: EngineChoice, job: Job, config: RunConfig, options: dict,
                 store: CheckpointStore, parent: CheckpointMetadata | None, files: InputFiles,
                 started: float, warnings: list[str], progress: ProgressSink,
                 evolution: EvolutionPlan | None) -> dict:
    from statebackend.spark.dispatch import partition_values

    parallelism, max_parallelism = _lineage_shape(config, parent, engine, warnings)
    checkpoint_id = (parent.checkpoint_id if parent else 0) + 1  # lineage.py: parent + 1
    run_dir = run_dir_name(config.run_id)
    # Leftovers of a crashed attempt of this run id must not mix with this attempt's parts.
    _delete_run_outputs(job, config)
    config.open(config.quarantine_url).delete_tree(run_dir)
    clock = _run_clock(engine, job, config, parent, parallelism, progress)
    migration = evolution if evolution is not None and evolution.rewrites else None
    if migration is not None:  # every subtask rewrites its entries once (state/migrate.py)
        clock = replace(clock, must_run=(True,) * parallelism)
    params = TaskParams(
        job=job, options=options, storage_url=store.root_storage.url, job_dir=store.job,
        checkpoint_id=checkpoint_id, parallelism=parallelism, max_parallelism=max_parallelism,
        parent_handles=tuple(json.dumps(h.to_json()) for h in parent.subtasks) if parent else (),
        output_url=config.output, quarantine_url=config.quarantine_url, run_dir=run_dir,
        run_id=config.run_id, part_values=tuple(partition_values(parallelism)),
        local_dir=config.local_dir, fail_subtask=config.fail_subtask,
        # What the driver opened the storage with (its AWS_* captured when none were
        # given): executors on other hosts reach the same storage; nothing goes to env.
        storage_options=store.root_storage.options,
        watermark=clock.watermark, new_watermark=clock.new_watermark,
        processing_time=clock.processing_time, must_run=clock.must_run, migration=migration)
    attempt = Attempt(store, checkpoint_id, on_discard=lambda: _delete_run_outputs(job, config))
    params = replace(params, attempt_token=attempt.token)
    progress.phase(f"run {config.run_id}: reading input")
    try:
        rows = engine.run_tasks(
            params, progress, label=f"run {config.run_id}, checkpoint {checkpoint_id}",
            upstream=f"run {config.run_id}: reading input",
            description=f"{job.name} {store.job} run {config.run_id}",
            group_prefix=f"{job.name}-{store.job}-{checkpoint_id}", batch_rows=ARROW_BATCH_ROWS)
    except TaskFailedError as exc:
        attempt.discard()
        where = f"checkpoint {parent.checkpoint_id} stays latest" if parent else \
            "no checkpoint was committed"
        raise JobRunError(f"run {config.run_id!r} of job {store.job!r} failed in "
                          f"{engine.task_word}: {exc}; {where}") from exc
    progress.phase(f"run {config.run_id}: committing checkpoint {checkpoint_id}")
    return _commit(job, config, store, attempt, parent, files, parallelism, max_parallelism,
                   rows, started, warnings, clock, progress, choice, evolution)


# -- time: watermark, logical time, subtasks with due work -----------------------------
@dataclass(frozen=True)
class RunClock:
    """The run's clocks: watermark at start and end, logical time, subtasks that must run."""

    watermark: int | None
    new_watermark: int | None
    processing_time: int
    must_run: tuple[bool, ...]


def _run_clock(engine: Engine, job: Job, config: RunConfig, parent: CheckpointMetadata | None,
               parallelism: int, progress: ProgressSink) -> RunClock:
    wm = parent.watermark if parent else None
    logical = config.logical_time_ms if config.logical_time_ms is not None else \
        int(time.time() * 1000)
    new_wm = wm
    if job.input.event_time is not None:
        new_wm = advance(wm, engine.max_event_time(
            job, wm, progress, f"run {config.run_id}: scanning event times"),
            job.input.lateness_ms)
    return RunClock(wm, new_wm, logical, _must_run(job, parent, parallelism, new_wm, logical))


def _must_run(job: Job, parent: CheckpointMetadata | None, parallelism: int,
              new_wm: int | None, logical: int) -> tuple[bool, ...]:
    """Per subtask: a timer or expiry is due. Unknown (no record, e.g. after a rescale
    or a run before timers): run it, so nothing due is ever skipped."""
    if parent is None or not job.has_time:
        return ()
    recorded = (parent.extra.get("time") or {}).get("next") if parent.extra else None
    if not isinstance(recorded, list) or len(recorded) != parallelism:
        return (True,) * parallelism
    out = []
    for nxt in recorded:
        if not isinstance(nxt, dict):
            out.append(True)
            continue
        ev, pr = nxt.get("event"), nxt.get("processing")
        out.append((ev is not None and new_wm is not None and ev <= new_wm)
                   or (pr is not None and pr <= logical))
    return tuple(out)


def _next_times(parent: CheckpointMetadata | None, rows: dict[int, dict],
                parallelism: int) -> list:
    """Per subtask, the earliest timer/expiry per domain: reported, or the parent's."""
    old = ((parent.extra.get("time") or {}).get("next") if parent and parent.extra
           else None)
    out = []
    for i in range(parallelism):
        text = rows[i].get("next_times")
        if text:
            out.append(json.loads(text))
        elif isinstance(old, list) and len(old) == parallelism:
            out.append(old[i])
        else:
            out.append(None)  # unknown: the next run opens this subtask
    return out


def _commit(job: Job, config: RunConfig, store: CheckpointStore, attempt: Attempt,
            parent: CheckpointMetadata | None, files: InputFiles, parallelism: int,
            max_parallelism: int, rows: list[dict], started: float,
            warnings: list[str], clock: RunClock, progress: ProgressSink,
            choice: EngineChoice, evolution: EvolutionPlan | None) -> dict:
    """Check the task results, commit `_metadata` through the attempt, publish outputs."""
    by_subtask = {r["subtask"]: r for r in rows}
    for r in rows:
        attempt.add_uploaded(json.loads(r.get("uploaded") or "[]"))
    if sorted(by_subtask) != list(range(parallelism)):
        attempt.discard()
        raise JobRunError(f"run {config.run_id!r}: subtasks {sorted(by_subtask)} reported, "
                          f"expected 0..{parallelism - 1}; nothing committed")
    handles = []
    for i in range(parallelism):
        text = by_subtask[i]["handle"]
        # A carried-forward handle uploaded nothing in this checkpoint.
        handles.append(SubtaskHandle.from_json(json.loads(text), f"subtask {i} result")
                       if text else replace(parent.subtasks[i], bytes_uploaded=0))
    events = sum(r["events"] for r in rows)
    rejected = sum(r["rejected"] for r in rows)
    reasons: dict[str, int] = {}
    for r in rows:
        for k, v in json.loads(r["reasons"]).items():
            reasons[k] = reasons.get(k, 0) + v
    reasons = dict(sorted(reasons.items()))
    read = events + rejected
    late = reasons.get(LATE, 0)
    # Late rows are not bad data: they do not count against --max-reject-fraction.
    if rejected - late and rejected - late > config.max_reject_fraction * read:
        attempt.discard()
        detail = ", ".join(f"{k}={v}" for k, v in reasons.items())
        raise RejectThresholdError(
            f"run {config.run_id!r}: {rejected} of {read} input rows rejected "
            f"({rejected / read:.2%}) exceeds --max-reject-fraction {config.max_reject_fraction}"
            f" ({detail}); rows quarantined under {config.quarantine_url}/"
            f"{run_dir_name(config.run_id)}; nothing committed")
    timings = {k: sum(r[f"t_{k}"] for r in rows) for k in TIMING_KEYS if k != "committing"}
    t0 = time.perf_counter()
    keys = sum(r["keys_touched"] for r in rows)
    # Events, rejects and keys touched are recorded once, in "metrics" (checkpoint.metrics).
    extra = {"input_files": files.count,
             "input_files_skipped": len(files.skipped), "input_bytes": files.total_bytes,
             "input_reader": _reader(choice, files, config), "engine": choice.engine,
             "output": config.output,
             # Which parts the run wrote: a re-run may only publish complete folders.
             "output_parts": _output_parts(job, rows), "job_kind": job.name,
             "key": job.key,
             "metrics": run_metrics(rows, handles, started, reasons)}
    if config.context:
        extra["context"] = dict(config.context)
    timers_fired = sum(r.get("timers_fired") or 0 for r in rows)
    ttl_purged = sum(r.get("ttl_purged") or 0 for r in rows)
    counters: dict[str, int] = {}
    for r in rows:
        for k, v in json.loads(r.get("counters") or "{}").items():
            counters[k] = counters.get(k, 0) + v
    if job.has_time or job.input.event_time is not None:
        extra["time"] = {"late_rows": late, "timers_fired": timers_fired,
                         "ttl_purged": ttl_purged,
                         "next": _next_times(parent, by_subtask, parallelism)}
    if counters:
        extra["counters"] = dict(sorted(counters.items()))
    meta = build_metadata(
        job=store.job, checkpoint_id=attempt.checkpoint_id,
        parent=parent.checkpoint_id if parent else None, max_parallelism=max_parallelism,
        states=(evolution or new_lineage_plan(job)).states, handles=handles,
        run_id=config.run_id,
        inputs=[config.input], extra=extra)
    if job.has_time or job.input.event_time is not None:  # other jobs' records stay as they were
        meta = meta.with_changes(watermark=clock.new_watermark,
                                 processing_time=clock.processing_time)
    # Discards the attempt (uploads and output parts) if the commit fails; records the run
    # in the commit log and the ledger (checkpoint/lineage.py).
    attempt.commit(meta, winners=[(r["subtask"], r["attempt"]) for r in rows])
    # A crash from here on leaves a committed run without _SUCCESS: its re-run is
    # skipped and finishes the publication (`_skipped`).
    folders = run_folders(job, config.run_id)
    progress.phase(f"run {config.run_id}: publishing outputs", total=len(folders),
                   unit="outputs")
    for folder in folders.values():
        _write_success(config, folder)
        progress.advance()
    timings["committing"] = time.perf_counter() - t0
    detail: dict[str, float] = {}
    for r in rows:
        for k, v in json.loads(r.get("t_detail") or "{}").items():
            detail[k] = round(detail.get(k, 0.0) + v, 4)
    extra_summary: dict[str, Any] = {"warnings": warnings} if warnings else {}
    extra_summary.update(watermark=clock.new_watermark, processing_time=clock.processing_time,
                         timers_fired=timers_fired, ttl_purged=ttl_purged, late_rows=late,
                         counters=dict(sorted(counters.items())))
    # A job's counters also appear at the top level (e.g. ``duplicates_dropped``).
    extra_summary.update({k: v for k, v in counters.items() if k not in extra_summary})
    return summary(
        job, config, checkpoint_id=meta.checkpoint_id, parallelism=parallelism,
        started=started, skipped=False, events=read, rejected=rejected, keys=keys,
        uploaded=meta.bytes_uploaded, timings=timings, rejects_by_reason=reasons,
        restore_modes=[by_subtask[i]["restore_mode"] for i in range(parallelism)],
        reuploaded=sorted(p for r in rows for p in json.loads(r.get("reuploaded") or "[]")),
        parent=meta.parent, published=True, output=config.output,
        input_files=files.count, input_bytes=files.total_bytes,
        input_reader=_reader(choice, files, config), engine=choice.engine,
        engine_reason=choice.reason, logic_timings=detail,
        **files.skipped_report(), **extra_summary)


def _reader(choice: EngineChoice, files: InputFiles, config: RunConfig) -> str:
    """The summary's ``input_reader``: the local engine reads every file with Arrow."""
    if choice.engine == "local":
        return "arrow" if files.count else "none"
    return choose_reader(files, config.input_reader)


PHASES = {"restore": "t_restoring", "process": "t_processing", "snapshot": "t_snapshotting",
          "upload": "t_uploading"}


def run_metrics(rows: list[dict], handles: list[SubtaskHandle], started: float,
                reasons: dict[str, int]) -> dict:
    """``extra["metrics"]`` of a commit record (format 1; read by the Checkpoints page).

    Phases are seconds summed over subtasks (they overlap in wall time); ``commit`` is
    not in the record that the commit writes. ``timers``: firing the due timers.
    """
    by_subtask = {r["subtask"]: r for r in rows}
    subtasks = []
    for h in handles:
        r = by_subtask[h.index]
        subtasks.append({
            "index": h.index, "events": r["events"], "rejected": r["rejected"],
            "keys_touched": r["keys_touched"], "bytes_uploaded": h.bytes_uploaded,
            "state_rows": sum(h.row_counts.values()),
            "phases": {k: round(r[col], 4) for k, col in PHASES.items()} | {
                "timers": round(json.loads(r.get("t_detail") or "{}").get("timers", 0.0), 4)}})
    total = {k: round(sum(s["phases"][k] for s in subtasks), 4)
             for k in (*PHASES, "timers")}
    events = sum(s["events"] for s in subtasks)
    rejected = sum(s["rejected"] for s in subtasks)
    return {"format": 1, "subtasks": subtasks, "run": {
        "duration_s": round(time.perf_counter() - started, 3),
        "events_read": events + rejected, "events_rejected": rejected,
        "rejects_by_reason": dict(reasons),
        "keys_touched": sum(s["keys_touched"] for s in subtasks),
        "bytes_uploaded": sum(s["bytes_uploaded"] for s in subtasks),
        "state_rows": sum(s["state_rows"] for s in subtasks), "phases": total}}


def _output_parts(job: Job, rows: list[dict]) -> list[str] | dict[str, list[str]]:
    """Parts written per output: a list for a job with one output (release-1 form)."""
    written = {o.name: [] for o in job.outputs}
    for r in sorted(rows, key=lambda r: r["subtask"]):
        for name in json.loads(r.get("outputs") or "{}"):
            written[name].append(part_name(r["subtask"]))
    if len(job.outputs) == 1:
        return written[job.outputs[0].name]
    return written


def _delete_run_outputs(job: Job, config: RunConfig) -> None:
    if not job.outputs:
        return
    out = config.open(config.output)
    for folder in run_folders(job, config.run_id).values():
        out.delete_tree(folder)


def _write_success(config: RunConfig, folder: str) -> None:
    config.open(config.output).write_bytes(f"{folder}/_SUCCESS", b"")


# -- a run id already committed ----------------------------------------------------------
def _skipped(job: Job, config: RunConfig, store: CheckpointStore, done: RunRecord,
             started: float) -> dict:
    """A committed run id: count nothing again, but finish what a crash after its commit left.

    Idempotent: ``_SUCCESS`` is written only when absent and when every output part the
    commit recorded is there (a folder whose parts were removed is not published).
    """
    if done.checkpoint_id in store.checkpoint_ids():  # retired ones left nothing to clean
        cleanup_committed(store, store.load(done.checkpoint_id))
    published, missing = finish_publication(job, config, done)
    extra: dict = {"published": published}
    if missing:
        extra["output_parts_missing"] = missing
    return summary(job, config, checkpoint_id=done.checkpoint_id,
                   parallelism=done.parallelism, started=started, skipped=True, **extra)


def finish_publication(job: Job, config: RunConfig, done: RunRecord
                       ) -> tuple[bool, list[str]]:
    """Write the run's missing ``_SUCCESS`` files; returns (any written now, missing parts)."""
    if not job.outputs:
        return False, []
    out = config.open(config.output)
    recorded = done.extra.get("output_parts")
    written, missing = False, []
    for name, folder in run_folders(job, config.run_id).items():
        if out.exists(f"{folder}/_SUCCESS"):
            continue
        parts = recorded.get(name) if isinstance(recorded, dict) else recorded
        gone = _missing_parts(out, folder, parts, done)
        if gone:
            missing += [f"{folder}/{p}" if len(job.outputs) > 1 else p for p in gone]
            continue
        _write_success(config, folder)
        written = True
    return written, missing


def _missing_parts(out: Storage, folder: str, parts: Any, done: RunRecord) -> list[str]:
    if isinstance(parts, list):
        return [str(p) for p in parts if not out.exists(f"{folder}/{p}")]
    # Committed before output_parts was recorded: a folder with parts will do, or none
    # at all when the run touched no key.
    if done.extra.get("keys_touched") == 0 or any(
            n.endswith(".parquet") for n in out.list_dir(folder)):
        return []
    return ["part-*.parquet"]


# -- text form of the summary ------------------------------------------------------------
def format_summary(s: dict) -> str:
    if s["skipped"]:
        done = ("; its output is now published (_SUCCESS was missing)" if s.get("published")
                else "")
        if s.get("output_parts_missing"):
            done = (f"; output not published: parts missing "
                    f"({', '.join(s['output_parts_missing'][:5])})")
        return (f"run {s['run_id']}: skipped, already committed as checkpoint "
                f"{s['checkpoint_id']} of job {s['job']}{done}")
    t = ", ".join(f"{k} {v:.2f}s" for k, v in s["timings"].items())
    return (f"run {s['run_id']}: checkpoint {s['checkpoint_id']} of job {s['job']} "
            f"(P={s['parallelism']}): {s['events_read']} events read, {s['events_rejected']} "
            f"rejected, {s['keys_touched']} keys touched, {s['bytes_uploaded']} bytes uploaded "
            f"in {s['duration_s']:.2f}s ({t})")


def skipped_warning(input_url: str, s: dict) -> str:
    n, names = s["input_files_skipped"], s.get("input_files_skipped_names") or []
    more = f" and {n - len(names)} more" if n > len(names) else ""
    return (f"{n} input file(s) under {input_url} skipped ({', '.join(names)}{more}); "
            f"only regular *.parquet and JSON-lines files (optionally .gz) inside the "
            f"input root are read")
