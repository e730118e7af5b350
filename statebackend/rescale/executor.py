"""Rescale-restore: redistribute a checkpoint's key-group state to a new parallelism.

Input: a committed checkpoint with parallelism P (max parallelism M). Output: a
new, full checkpoint with parallelism Q, ``kind="rescale"``, ``parent`` = the
source id, ``rescaled_from`` = P. The source is never modified.

The plan is pure (`statebackend.rescale.plan.plan_rescale`: for each new subtask,
the old subtask it restores and clips, the key groups it imports from the others,
the files it downloads); ``dry_run`` prints it. Each new subtask is one task
(`statebackend.rescale.task.run_rescale_task`), so a task reads only the files of
the old handles that meet its range: from the snapshots a job run left on its machine
when they are there (local recovery, ``RescaleOptions.local_dir``), else downloaded.

Where the tasks run is the engine policy every job run uses
(`statebackend.engines.choose_engine`, over the source's state size and the
master): in this process's threads (`statebackend.subtasks.run_in_threads`), two per
core (``TASKS_PER_CORE``: a task waits on RocksDB's background work and file I/O
about as long as it computes), or as Spark tasks, one per new subtask
(`statebackend.spark.dispatch.run_tasks`; a DataFrame, so Spark Connect clients
rescale too). With a local master the executors are this process anyway: a Spark
job would only add its scheduling and Python worker round trips. Storage that
lives in this process (``memory://``) runs the tasks one after the other: fsspec's
memory filesystem hands every reader of a file the same file object.

Order and failure handling (upload first, commit last):

1. take the job's writer lease (no job run or other rescale at the same time) and
   a hold lease on the source (retention and GC keep it while we read it); the
   source must be the lineage's latest checkpoint (else the rescaled state would
   drop the runs after it: roll back explicitly first);
2. run the tasks; each records its uploads with the attempt's token, and a task
   that fails deletes what it uploaded;
3. if any task failed: discard the attempt (every recorded upload), commit nothing,
   raise one line (the source is untouched);
4. else commit ``chk-<source + 1>/_metadata`` (`statebackend.checkpoint.attempt.Attempt`,
   the commit-or-discard every checkpoint writer shares), release the leases.

A memory-backend checkpoint needs no task: its key-group files change hands
(`statebackend.rescale.memory`).

The base's SSTs are referenced, not uploaded again: they belong to the committed
source checkpoint, which GC keeps while anything references them; each new handle
is still restorable on its own.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

from statebackend.checkpoint.attempt import Attempt
from statebackend.checkpoint.leases import hold
from statebackend.checkpoint.metadata import CheckpointMetadata, recorded_total
from statebackend.checkpoint.restore import external_read
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.engines import (
    EngineChoice,
    Workload,
    choose_engine,
    is_local_master,
    local_master_cores,
)
from statebackend.errors import CkptError, SnapshotError, TaskFailedError, UsageError
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.rescale import memory as memory_rescale
from statebackend.rescale import task as rescale_task
from statebackend.rescale.plan import RescalePlan, plan_rescale
from statebackend.rescale.task import (
    RescaleTask,
    RescaleTaskResult,
    run_rescale_batches,
    run_rescale_task,
)
from statebackend.spark.connect_sessions import kept_session
from statebackend.spark.dispatch import run_tasks as run_spark_tasks
from statebackend.spark.progress import TaskStages, report_tasks
from statebackend.state.external_store import ExternalStore
from statebackend.state.kinds import StateDescriptor
from statebackend.subtasks import one_line, run_in_threads
from statebackend.worker_processes import worker_pool

# New subtasks run at once per core of a local master (120,000 keys, load 12, medians
# of 7 interleaved rounds: 4 -> 8 took 0.44 s with one task per core, 0.33 s with two,
# 0.32 s with four; 8 -> 3 0.31, 0.31 and 0.26 s).
TASKS_PER_CORE = 2
# Backends whose rescale regroups the record and runs no task (rescale/memory.py)
IN_MEMORY_BACKENDS = ("memory", "external")
# A local rescale exports its imports in worker processes (statebackend.worker_processes)
# from this many bytes of imported files when this process's workers run already, and
# from the second figure when they would have to start: their start, paid once per
# process (about 0.3 s), is worth it only when the second core saves more than that.
# Read at call time: tests lower them.
IMPORT_PROCESSES_FROM_BYTES = 1 * 2**20
IMPORT_PROCESSES_COLD_FROM_BYTES = 64 * 2**20
TASKS_LABEL = "new subtasks written"


@dataclass(frozen=True)
class RescaleOptions:
    """How to rescale: ``engine`` (``spark``/``local``/``auto``, statebackend.engines) on
    ``master`` (default: the session's, else ``local[*]``); ``compact`` rewrites every
    new subtask to its live keys; ``dry_run`` only plans; ``fail_subtask`` is a test
    hook (that new subtask fails after its upload); ``connect_session`` on a Connect
    master: ``job`` attaches to the session kept for the job's rescales, ``new`` opens
    one (statebackend.spark.connect_sessions); ``local_dir``: the root of the
    local-recovery instances job runs left on the task's machine (None:
    ``CKPT_LOCAL_DIR``, else the temp folder's; statebackend.checkpoint.local_copy);
    ``state_db``: an external checkpoint's database, if the caller names one (a rescale
    reads none: it is checked to be the checkpoint's own, so a run pointed at another
    database fails here rather than after the new checkpoint is committed)."""

    engine: str | None = None
    master: str | None = None
    compact: bool = False
    dry_run: bool = False
    fail_subtask: int | None = None
    connect_session: str = "job"
    local_dir: str | None = None
    state_db: ExternalStore | None = None


def rescale(store: CheckpointStore, ref: str | int | None = "latest",
            parallelism: int | None = None, *, spark=None,
            options: RescaleOptions = RescaleOptions(),
            progress: ProgressSink = NO_PROGRESS) -> dict:
    """Rescale checkpoint ``ref`` to ``parallelism``; commit a new checkpoint; return a summary.

    ``spark``: a SparkSession to use when the tasks run as Spark tasks (else one is
    started on ``options.master``). ``progress`` counts the new subtasks written.
    """
    if parallelism is None:
        raise UsageError("rescale needs a target parallelism (--parallelism Q)")
    started = time.perf_counter()
    meta = store.resolve(ref)
    plan = plan_rescale(meta, parallelism)  # fail fast, before taking any lease
    if options.state_db is not None:
        external_read(meta, options.state_db)  # its own database, else one line
    in_memory = meta.state_backend in IN_MEMORY_BACKENDS
    if options.dry_run:
        return {"dry_run": True, "job": store.job, "source_checkpoint_id": meta.checkpoint_id,
                "from_parallelism": plan.from_parallelism, "to_parallelism": parallelism,
                "bytes_to_download": 0 if in_memory else plan.bytes_to_download,
                "plan": plan.to_json(),
                "plan_text": (memory_rescale.describe(plan, meta.state_backend) if in_memory
                              else plan.describe())}
    purpose = f"rescale of checkpoint {meta.checkpoint_id} to parallelism {parallelism}"
    with store.writer(purpose, checkpoint_ids=[meta.checkpoint_id]) as session, \
            hold(store.storage, purpose, [meta.checkpoint_id]):
        # Re-read under the lease: "latest" may have moved since the check above.
        meta = store.resolve(ref)
        _require_latest(store, meta, session.lineage.latest)
        plan = plan_rescale(meta, parallelism)
        choice = choose_rescale_engine(store, meta, options, spark)
        attempt = Attempt(store, meta.checkpoint_id + 1)  # lineage.py: parent + 1
        try:
            t_tasks = time.perf_counter()
            results = memory_rescale.regrouped(meta, plan) if in_memory else _run_tasks(
                _tasks(store, meta, plan, options, attempt.token,
                       import_processes=_import_processes(store, plan, choice,
                                                          _master(options, spark))),
                store, choice, spark, options, progress)
            tasks_seconds = time.perf_counter() - t_tasks
            attempt.add_uploaded(p for r in results for p in r.uploaded_paths)
            new_meta = attempt.commit(_record(store, meta, results, options),
                                      winners=[(r.index, r.attempt) for r in results])
        except BaseException as exc:
            attempt.discard()
            error = _failure(meta, parallelism, exc)
            if error is exc:
                raise
            raise error from exc
    return _summary(store, new_meta, plan, results, choice, options) | {
        "tasks_seconds": round(tasks_seconds, 4),
        "duration_seconds": round(time.perf_counter() - started, 4)}


def _require_latest(store: CheckpointStore, meta: CheckpointMetadata,
                    latest: CheckpointMetadata | None) -> None:
    if latest is not None and latest.checkpoint_id != meta.checkpoint_id:
        # the rescaled state would become the latest and silently drop every run
        # committed after the source: a fork (checkpoint/lineage.py)
        raise UsageError(
            f"checkpoint {meta.checkpoint_id} of job {store.job!r} is not the latest "
            f"({latest.checkpoint_id}): a rescale continues the lineage from its latest "
            f"checkpoint; to go back to checkpoint {meta.checkpoint_id} first, roll back "
            f"explicitly (`ckpt doctor --rollback-to {meta.checkpoint_id} --reason ...`)")


def choose_rescale_engine(store: CheckpointStore, meta: CheckpointMetadata,
                          options: RescaleOptions, spark=None) -> EngineChoice:
    """Where the new subtasks run (`statebackend.engines.choose_engine`): a memory or
    external checkpoint's in this process whatever was asked, since it runs no task
    (key-group files change hands, or nothing moves): a Spark session would be started
    for nothing."""
    if meta.state_backend in IN_MEMORY_BACKENDS:
        return EngineChoice("local", f"a {meta.state_backend}-backend rescale runs no "
                                     "task: it regroups the record in this process")
    return choose_engine(options.engine, _master(options, spark), Workload(
        state_bytes=meta.bytes_referenced,
        storage_in_process=store.root_storage.url if store.storage.process_local else None))


def _master(options: RescaleOptions, spark) -> str:
    if options.master:
        return options.master
    if spark is not None:
        from statebackend.spark.session import master_of  # Spark only with a session

        return master_of(spark)
    return "local[*]"


def _import_processes(store: CheckpointStore, plan: RescalePlan, choice: EngineChoice,
                      master: str) -> bool:
    """Whether the imports' exports run in this process's worker processes: a local
    rescale on several cores with enough to import (``IMPORT_PROCESSES_FROM_BYTES``)."""
    if choice.engine != "local" or store.storage.process_local or local_master_cores(
            master if is_local_master(master) else None) < 2:
        return False
    return plan.bytes_to_import >= (IMPORT_PROCESSES_FROM_BYTES if worker_pool().started()
                                    else IMPORT_PROCESSES_COLD_FROM_BYTES)


def _tasks(store: CheckpointStore, meta: CheckpointMetadata, plan: RescalePlan,
           options: RescaleOptions, token: str, *, import_processes: bool = False
           ) -> list[RescaleTask]:
    by_index = {h.index: h for h in meta.subtasks}
    states = tuple(StateDescriptor.from_json(dict(s)) for s in meta.states)
    return [RescaleTask(
        storage_url=store.root_storage.url, job=store.job,
        source_checkpoint_id=meta.checkpoint_id, checkpoint_id=meta.checkpoint_id + 1,
        max_parallelism=meta.max_parallelism, states=states, plan=s,
        sources=tuple(by_index[i] for i in s.sources), compact=options.compact,
        # read at call time: bench/bench_rescale.py varies the rule
        compact_clipped_share=rescale_task.COMPACT_CLIPPED_SHARE,
        fail=options.fail_subtask == s.index, attempt_token=token,
        import_processes=import_processes, local_dir=options.local_dir,
        # What the driver opened the storage with: tasks on other hosts reach the same
        # storage; nothing goes through the environment.
        storage_options=store.root_storage.options) for s in plan.subtasks]


def _run_tasks(tasks: list[RescaleTask], store: CheckpointStore, choice: EngineChoice,
               spark, options: RescaleOptions, progress: ProgressSink
               ) -> list[RescaleTaskResult]:
    """Every new subtask, in this process's threads or as Spark tasks (module doc)."""
    if choice.engine == "local":
        progress.phase(TASKS_LABEL, total=len(tasks), unit="subtasks")
        master = _master(options, spark)
        cores = local_master_cores(master if is_local_master(master) else None)
        workers = 1 if store.storage.process_local else TASKS_PER_CORE * cores
        return run_in_threads(len(tasks), lambda i: run_rescale_task(tasks[i]),
                              workers=workers, progress=progress, word="new subtask")
    if spark is None:
        spark = rescale_spark(store, options)
    # range() puts exactly one id in each of its n partitions: one task per subtask.
    df = spark.range(0, len(tasks), 1, len(tasks)).mapInArrow(
        functools.partial(run_rescale_batches, tuple(tasks)), "result string")
    first = tasks[0]
    with report_tasks(spark, progress, TaskStages(TASKS_LABEL, total=len(tasks))):
        rows = run_spark_tasks(
            spark, df, f"ckpt rescale {first.job} chk-{first.source_checkpoint_id} -> "
                       f"{len(tasks)} subtasks", group_prefix=f"ckpt-rescale-{first.job}")
    # Other processes wrote under the job root: drop this process's cached listings
    # (s3fs would otherwise answer "does not exist" for the new files).
    store.storage.invalidate_cache()
    return sorted((RescaleTaskResult.from_json(json.loads(r["result"])) for r in rows),
                  key=lambda r: r.index)


def rescale_spark(store: CheckpointStore, options: RescaleOptions, conf: dict | None = None):
    """A Spark session for the rescale tasks on ``options.master``; on Spark Connect the
    session kept for the job's rescales (``options.connect_session``)."""
    from statebackend.spark.session import get_spark  # Spark only for Spark tasks

    kept = kept_session(options.master, store.root_storage.url, store.job, purpose="rescale",
                        mode=options.connect_session)
    return get_spark(options.master, app_name="ckpt-rescale", conf=conf, job_session=kept)


def _record(store: CheckpointStore, meta: CheckpointMetadata,
            results: list[RescaleTaskResult], options: RescaleOptions) -> CheckpointMetadata:
    """The new checkpoint's commit record: the source's, at the new parallelism."""
    parallelism = len(results)
    new_meta = build_metadata(MetadataParts(
        job=store.job, checkpoint_id=meta.checkpoint_id + 1, parent=meta.checkpoint_id,
        max_parallelism=meta.max_parallelism, states=meta.states,
        handles=tuple(r.handle for r in results), kind="rescale",
        rescaled_from=meta.parallelism, inputs=meta.input,
        source={"checkpoint_id": meta.checkpoint_id, "parallelism": meta.parallelism,
                "run_id": meta.run_id},
        extra={**meta.extra, "rescale": {"from_parallelism": meta.parallelism,
                                         "to_parallelism": parallelism,
                                         "source_checkpoint_id": meta.checkpoint_id,
                                         "compacted": options.compact}},
        key_hash=meta.key_hash))
    # Time is state too: the rescaled lineage keeps its watermark and clock.
    # ... and an external-backend checkpoint its database version (no state moved).
    return new_meta.with_changes(watermark=meta.watermark, processing_time=meta.processing_time,
                                 external=meta.external)


def _failure(meta: CheckpointMetadata, parallelism: int, exc: BaseException) -> BaseException:
    """The error a failed rescale raises: one line saying nothing was committed."""
    if not isinstance(exc, Exception) or (isinstance(exc, CkptError)
                                          and not isinstance(exc, TaskFailedError)):
        return exc
    return SnapshotError(
        f"rescale of checkpoint {meta.checkpoint_id} to parallelism {parallelism} failed: "
        f"{one_line(exc)}; nothing was committed and checkpoint {meta.checkpoint_id} is "
        f"unchanged")


def _summary(store: CheckpointStore, new_meta: CheckpointMetadata, plan: RescalePlan,
             results: list[RescaleTaskResult], choice: EngineChoice,
             options: RescaleOptions) -> dict:
    return {
        "dry_run": False, "job": store.job, "checkpoint_id": new_meta.checkpoint_id,
        "source_checkpoint_id": plan.source_checkpoint_id,
        "from_parallelism": plan.from_parallelism, "to_parallelism": plan.to_parallelism,
        "max_parallelism": plan.max_parallelism,
        "engine": choice.engine, "engine_reason": choice.reason,
        "bytes_downloaded": sum(r.bytes_downloaded for r in results),
        "bytes_uploaded": new_meta.bytes_uploaded,
        "bytes_referenced": new_meta.bytes_referenced,
        "files_reused": sum(r.files_reused for r in results),
        "entries_imported": sum(r.entries_imported for r in results),
        "rows": recorded_total(r.rows for r in results),
        "compacted": options.compact,
        "compacted_subtasks": sum(r.compacted for r in results),
        # the imports exported in worker processes (statebackend.worker_processes)
        "import_processes": any(pid != r.pid for r in results for pid in r.import_pids),
        "subtasks": [{"index": r.index, "base": s.base, "clipped_share": r.clipped_share,
                      "compacted": r.compacted, "scratch": r.scratch, "host": r.host,
                      "pid": r.pid, "import_pids": list(r.import_pids),
                      "restore_modes": list(r.restore_modes),
                      "imports": [i.source for i in s.imports], "rows": r.rows,
                      "bytes_downloaded": r.bytes_downloaded,
                      "bytes_uploaded": r.bytes_uploaded, "files_reused": r.files_reused,
                      "timings": {k: round(v, 4) for k, v in r.timings.items()}}
                     for r, s in zip(results, plan.subtasks, strict=True)],
    }
