"""The run protocol, written once for every job: `run_job(job, RunConfig(...))`.

One run (driver side; the subtasks: `statebackend.job.task`)::

    committed run id?  -> skipped; finish its output publication (_SUCCESS) if a crash
                          came between its commit and the marker (no lease needed)
    can it continue?   -> the job's states against the lineage's (statebackend.job.plan):
                          an incompatible change is refused before anything is written
    writer lease       -> a concurrent writer is refused (LeaseConflictError); the
                          lineage is checked under it (forks, lost commits)
    plan               -> parent = latest checkpoint (or --start-from on the first run),
                          input files listed and Parquet footers checked (one-line
                          InputError naming a bad file, before any engine work), the
                          engine (statebackend.engines.choose_engine: Spark, or the
                          local engine in this process for small work; an input that
                          provably has no row into a lineage with nothing due always
                          runs locally: `IDLE_REASON`), parallelism, clocks
                          (statebackend.job.clock): a frozen `RunPlan`
    tasks              -> every subtask restores, validates and runs the logic, fires
                          due timers, purges expired TTL entries, writes outputs and
                          quarantine, snapshots and uploads (statebackend.job.task),
                          as Spark tasks (job.spark_engine) or threads (job.local_engine)
    commit             -> check the results, build the record (statebackend.job.commit),
                          commit chk-<id>/_metadata through one `Attempt`, or discard
                          every upload and leave the parent latest
    publish            -> _SUCCESS in every run folder of the outputs (job.publish)

Every outcome (committed, skipped, failed) is recorded in the run history
(``runs/history/``, statebackend.checkpoint.runs) for the Checkpoints page. The
result is `statebackend.job.summary.RunSummary` as JSON.

Progress (``run_job(..., progress=)``, a `statebackend.progress.ProgressSink`), from the
driver: planning, checking the input files, starting Spark, the event-time pass and
reading the input, the subtasks done of P as they finish, committing, publishing.
"""

from __future__ import annotations

import time
from dataclasses import replace

from statebackend import settings
from statebackend.checkpoint.attempt import Attempt, cleanup_committed
from statebackend.checkpoint.metadata import MAX_COUNT, CheckpointMetadata, utc_now_iso
from statebackend.checkpoint.runs import RunOutcome, RunRecord, record_outcome
from statebackend.checkpoint.store import CheckpointStore, WriterSession
from statebackend.engines import (
    EngineChoice,
    Workload,
    choose_engine,
    is_local_master,
    local_master_cores,
    machine_memory_bytes,
    requested_engine,
)
from statebackend.errors import (
    CkptError,
    JobRunError,
    RejectThresholdError,
    TaskFailedError,
    UsageError,
)
from statebackend.job import external_commit
from statebackend.job.api import Job
from statebackend.job.arrow_input import check_parquet
from statebackend.job.bootstrap import check_initial_state, initial_state
from statebackend.job.clock import RunClock, run_clock
from statebackend.job.commit import check_results, commit_record
from statebackend.job.config import RunConfig
from statebackend.job.engine import Engine
from statebackend.job.input import READERS, InputFiles, has_no_rows, input_weight, list_input
from statebackend.job.local_engine import LocalEngine
from statebackend.job.plan import (
    RunPlan,
    base_of,
    check_max_parallelism,
    check_state_mode,
    evolution_plan,
    lineage_shape,
    parent_of,
    run_backend,
    warn,
)
from statebackend.job.publish import (
    delete_run_outputs,
    finish_publication,
    publish_outputs,
    run_dir_name,
)
from statebackend.job.results import RunTotals, TaskResult
from statebackend.job.summary import CommittedRun, RunSummary, RunTimeline
from statebackend.job.task import TaskParams
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.settings import number
from statebackend.spark.connect_sessions import JobSession, kept_session

# Why a run whose input has no row (Parquet footers count none) and whose lineage has no
# timer or expiry due runs on the local engine whatever was chosen: its subtasks carry
# their state forward without opening it, and a Spark job would only schedule empty tasks.
IDLE_REASON = ("the input has no rows and no timer or expiry is due: every subtask "
               "carries its state forward, so no Spark job runs")


def run_job(job: Job, config: RunConfig, spark=None,
            progress: ProgressSink = NO_PROGRESS) -> dict:
    """Run ``job`` once; return its summary (`RunSummary.to_json`). Raises `CkptError`
    subclasses (one line). ``spark``: a session to use when Spark runs the tasks."""
    started, started_at = time.perf_counter(), utc_now_iso()
    options = _check_config(job, config)
    run = _JobRun(job.configured(options), config, options, spark, progress)
    progress.phase(f"run {config.run_id}: planning")
    done = run.store.find_run(config.run_id)
    if done is not None and not run.store.run_still_counts(done):
        done = None  # it names a lost commit: the lineage check under the lease says so
    if done is None:
        # a job that cannot continue its lineage is refused before anything is written
        base = base_of(config, run.store)
        evolution_plan(run.job, base, run.store.job)
        check_max_parallelism(config, base)
    outcome = RunOutcome(config.run_id, "failed", None, started_at, 0.0, None,
                         dict(config.context))
    try:
        result = run.skipped(done, started) if done is not None else run.run(started)
    except CkptError as exc:
        outcome = replace(outcome, error=str(exc))
        raise
    else:
        outcome = replace(outcome, outcome="skipped" if result.skipped else "committed",
                          checkpoint_id=result.checkpoint_id)
        return result.to_json()
    finally:
        record_outcome(run.store.storage, replace(
            outcome, duration_s=round(time.perf_counter() - started, 3)))


def _check_config(job: Job, config: RunConfig) -> dict:
    """The job's resolved options, once every run option is valid (one-line errors)."""
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
    check_initial_state(config)
    if config.input_reader not in READERS:
        raise UsageError(f"input reader {config.input_reader!r} is unknown; use one of "
                         f"{list(READERS)}")
    return dict(job.resolve_options(config.options))


class _JobRun:
    """One call of `run_job`: the configured job, its run options and its store."""

    def __init__(self, job: Job, config: RunConfig, options: dict, spark,
                 progress: ProgressSink) -> None:
        self.job, self.config, self.options = job, config, options
        self.spark, self.progress = spark, progress
        self.store = CheckpointStore(config.open(config.storage), config.job_dir(job))

    def run(self, started: float) -> RunSummary:
        """The run under the writer lease: plan, tasks, commit, publish."""
        # The lineage is checked (forks, lost commits, forgotten runs) under the lease,
        # before anything else: a run id is counted once (checkpoint/lineage.py).
        with self.store.writer(f"{self.job.name} run {self.config.run_id}") as session:
            done = self.store.find_run(self.config.run_id, session.lineage)
            if done is not None:
                return self.skipped(done, started)
            plan, engine = self._plan(session, started)
            return self._attempt(plan, engine, session)

    def _plan(self, session: WriterSession, started: float) -> tuple[RunPlan, Engine]:
        config, store, job = self.config, self.store, self.job
        warnings: list[str] = []
        evolution = evolution_plan(job, session.lineage.latest or base_of(config, store),
                                   store.job)
        parent = initial_state(job, config, store, session.lineage.latest, warnings) \
            if config.initial_state else parent_of(config, store, session.lineage.latest,
                                                   warnings)
        # before the input is read or Spark starts
        check_state_mode(config, run_backend(config, job, parent), store.job)
        files = list_input(config.input, config.storage_options)
        self.progress.phase(f"run {config.run_id}: checking {files.count} input files")
        check_parquet(files, job.input)  # before Spark starts: a bad file costs no session
        choice = choose_engine(config.engine, config.master, Workload(
            # Weighing decompresses gzip input (downloads it from S3): only auto needs it.
            input_bytes=input_weight(files) if requested_engine(config.engine) == "auto"
            else files.total_bytes,
            state_bytes=parent.bytes_referenced if parent else 0,
            new_lineage_without_parallelism=parent is None and config.parallelism is None,
            storage_in_process=config.storage if store.storage.process_local else None))
        rewrites = evolution is not None and bool(evolution.rewrites)
        clock: RunClock | None = None
        engine: Engine | None = None
        if parent is not None and not rewrites and has_no_rows(files):
            # No row to read or route: the local engine sets the clock without a scan, and
            # when nothing is due either every subtask carries its state forward
            # (job/task.py), so the run starts no Spark job (in a new process, no Spark).
            idle = LocalEngine(files, job, cores=local_cores(config.master))
            clock = run_clock(idle, job, config, parent, parent.parallelism, self.progress)
            if choice.engine != "local" and not any(clock.must_run):
                choice = EngineChoice("local", IDLE_REASON)
            engine = idle if choice.engine == "local" else None
        engine = engine or self._engine(choice, files)
        parallelism, max_parallelism = lineage_shape(config, parent, engine, warnings)
        if clock is None:
            clock = run_clock(engine, job, config, parent, parallelism, self.progress)
        if rewrites:
            # every subtask rewrites its entries once (state/migrate.py)
            clock = replace(clock, must_run=(True,) * parallelism)
        return RunPlan(job, config, store.job, parent, parallelism, max_parallelism, files,
                       choice, evolution, clock, tuple(warnings), started,
                       engine.reads_input_itself(parallelism)), engine

    def _engine(self, choice: EngineChoice, files: InputFiles) -> Engine:
        """The engine object of ``choice``: the local engine, or Spark (started if needed)."""
        config = self.config
        if choice.engine == "local":
            return LocalEngine(files, self.job, cores=local_cores(config.master))
        from statebackend.job.spark_engine import SparkEngine  # Spark only when it runs

        spark = self.spark
        if spark is None:
            from statebackend.spark.session import get_spark, quiet_console  # Spark only

            self.progress.phase("starting Spark")
            # A caller that shows progress (even CKPT_PROGRESS=off) wants no console bar.
            quiet = None if self.progress is NO_PROGRESS else quiet_console(config.master)
            spark = get_spark(config.master, app_name=f"{self.job.name}-{self.store.job}",
                              conf=quiet, job_session=self._job_session())
        return SparkEngine(spark, files, config.input_reader)

    def _job_session(self) -> JobSession | None:
        """Where this job's kept Spark Connect session is recorded (``--connect-session
        job``, the default); None: a session of the run's own."""
        config = self.config
        return kept_session(config.master, self.store.root_storage.url, self.store.job,
                            mode=config.connect_session, local_dir=config.local_dir)

    def _attempt(self, plan: RunPlan, engine: Engine, session: WriterSession) -> RunSummary:
        """The tasks, then check, commit and publish; a failure discards every upload.
        ``session``: the writer's lease and lineage (the external backend finishes the
        latest checkpoint's commit first)."""
        job, config, store = self.job, self.config, self.store
        # Leftovers of a crashed attempt of this run id must not mix with this attempt's.
        delete_run_outputs(job, config)
        config.open(config.quarantine_url).delete_tree(_run_dir(config))
        attempt = Attempt(store, plan.checkpoint_id,
                          on_discard=lambda: delete_run_outputs(job, config))
        try:
            planning_s, called = time.perf_counter() - plan.started, time.time()
            external = self._prepare_external(plan, session)
            params = self._task_params(plan, attempt.token)
            if external is not None:
                params = replace(params, external=external)
            results = engine.run_tasks(params, self.progress)
            returned = time.time()
            attempt.add_uploaded(p for r in results for p in r.uploaded)
            self.progress.phase(f"run {config.run_id}: committing checkpoint "
                                f"{plan.checkpoint_id}")
            t_commit = time.perf_counter()
            totals = check_results(plan, results)
            # Discards the attempt if the commit fails; records the run in the commit
            # log and the ledger (checkpoint/lineage.py).
            record = commit_record(plan, results, totals)
            if external is not None:  # _metadata names the version: the commit decision
                record = record.with_changes(external=external.version(store.job))
            meta = attempt.commit(record, winners=[(r.subtask, r.attempt) for r in results])
        except TaskFailedError as exc:
            attempt.discard()
            where = f"checkpoint {plan.parent.checkpoint_id} stays latest" if plan.parent \
                else "no checkpoint was committed"
            raise JobRunError(f"run {config.run_id!r} of job {store.job!r} failed in "
                              f"{engine.task_word}: {exc}; {where}") from exc
        except (JobRunError, RejectThresholdError):
            attempt.discard()
            raise
        if external is not None:  # a crash before this is finished by the next prepare
            external_commit.commit(external.store, meta, store.storage)
        # A crash from here on leaves a committed run without _SUCCESS: its re-run is
        # skipped and finishes the publication (`skipped`).
        publish_outputs(job, config, self.progress)
        return self._committed(plan, meta, results, totals, RunTimeline(
            planning_s, called, returned, time.perf_counter() - t_commit))

    def _prepare_external(self, plan: RunPlan, session: WriterSession
                          ) -> external_commit.Prepared | None:
        """The external backend's database, prepared for this run (None: another backend).
        A database ahead of the plan's parent is first checked against the lease: a
        writer paused while another took over is fenced off (LeaseLostError)."""
        if plan.backend != "external":
            return None
        config = self.config
        ext = external_commit.store_of(config.state_db, config.state_table,
                                       f"job {self.store.job!r}")
        self.progress.phase(f"run {config.run_id}: preparing the state database "
                            f"{ext.identity}")
        latest = session.lineage.latest
        mode = external_commit.run_mode(config.state_mode, latest, self.store.job)
        try:
            return external_commit.prepare(ext, self.store.job, (latest, plan.parent), mode,
                                           self.store.storage)
        except external_commit.NotCurrentError:
            session.lease.ensure_held()
            raise

    def _task_params(self, plan: RunPlan, token: str) -> TaskParams:
        config, store, clock = self.config, self.store, plan.clock
        return TaskParams(
            job=self.job, options=self.options, storage_url=store.root_storage.url,
            job_dir=store.job, checkpoint_id=plan.checkpoint_id,
            parallelism=plan.parallelism, max_parallelism=plan.max_parallelism,
            parent_handles=plan.parent.subtasks if plan.parent else (),
            output_url=config.output, quarantine_url=config.quarantine_url,
            run_dir=_run_dir(config), run_id=config.run_id, local_dir=config.local_dir,
            fail_subtask=config.fail_subtask,
            # What the driver opened the storage with (its AWS_* captured when none were
            # given): executors on other hosts reach the same storage; nothing goes to env.
            storage_options=store.root_storage.options,
            watermark=clock.watermark, new_watermark=clock.new_watermark,
            processing_time=clock.processing_time, must_run=clock.must_run,
            attempt_token=token, migration=plan.migration, key_hash=plan.key_hash,
            backend=plan.backend, memory_limit_mb=config.memory_limit_mb)

    def _committed(self, plan: RunPlan, meta: CheckpointMetadata, results: list[TaskResult],
                   totals: RunTotals, timeline: RunTimeline) -> RunSummary:
        files, clock = plan.files, plan.clock
        warnings = list(plan.warnings)
        if (memory := totals.memory) is not None:
            # the local engine's process holds every subtask's state: its sum against
            # the machine (on Spark each executor's memory bounds its own subtasks)
            machine = machine_memory_bytes() if plan.choice.engine == "local" else 0
            for near_limit in (memory.warning(), memory.machine_warning(machine)):
                if near_limit:
                    warn(warnings, near_limit)
        return self._summary(
            meta.checkpoint_id, plan.parallelism, plan.started, totals=totals,
            bytes_uploaded=meta.bytes_uploaded,
            timings={**totals.phases, "committing": timeline.committing_s},
            time_split=timeline.split(results),
            committed=CommittedRun(
                parent=meta.parent, output=self.config.output,
                restore_modes=tuple(r.restore_mode for r in results),
                input_files=files.count, input_bytes=files.total_bytes,
                skipped_files=files.skipped, input_reader=plan.input_reader,
                engine=plan.choice.engine, engine_reason=plan.choice.reason,
                warnings=tuple(warnings), watermark=clock.new_watermark,
                processing_time=clock.processing_time))

    def skipped(self, done: RunRecord, started: float) -> RunSummary:
        """A committed run id: count nothing again, but finish what a crash after its
        commit left (idempotent: ``_SUCCESS`` only where every recorded part is there)."""
        store = self.store
        if done.checkpoint_id in store.checkpoint_ids():  # retired ones left nothing
            cleanup_committed(store, store.load(done.checkpoint_id))
        published, missing = finish_publication(self.job, self.config, done)
        return self._summary(done.checkpoint_id, done.parallelism, started, skipped=True,
                             published=published, output_parts_missing=tuple(missing))

    def _summary(self, checkpoint_id: int | None, parallelism: int | None, started: float,
                 **detail) -> RunSummary:
        return RunSummary(
            run_id=self.config.run_id, job=self.store.job, job_kind=self.job.name,
            checkpoint_id=checkpoint_id, parallelism=parallelism,
            skipped=detail.pop("skipped", False),
            duration_s=time.perf_counter() - started, **detail)


def local_cores(master: str | None) -> int | None:
    """The local engine's threads: a ``local[N]`` master's N; else this machine's."""
    return local_master_cores(master) if is_local_master(master) else None


def _run_dir(config: RunConfig) -> str:
    return run_dir_name(config.run_id)
