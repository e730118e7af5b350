"""Driver-side progress of the Spark tasks that run subtasks: done/total as tasks finish.

``with report_tasks(spark, progress, TaskStages("subtasks", total=P, stages=2)):
df.collect()``
reports to a `statebackend.progress.ProgressSink` while the action runs:

- the *final stage*: the last stage of the newest job started inside, once it runs,
  when it has ``total`` tasks and its job has at least ``stages`` stages (a job
  run's tasks follow a shuffle, so 2; rescale's tasks read nothing, so 1). Its
  finished tasks are the finished subtasks: phase ``label``, ``done/total unit``.
  Adaptive execution runs a shuffle's map side as a job of its own, with one stage:
  ``stages`` keeps that job from passing for the final one when its task count
  happens to equal ``total``.
- before it, with ``upstream`` set: the running stage's tasks (e.g. reading input).

Classic sessions: a daemon thread polls the SparkContext's status tracker every
``interval`` seconds. Spark Connect: the client's progress handler, called as the
server streams progress. Reporting is best effort: a failure to read the status
never fails the work. When the action returns, the final phase shows every task
done. Nothing is polled for a sink that shows nothing (`progress.reports`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from statebackend.progress import ProgressSink, reports
from statebackend.spark.session import is_connect

log = logging.getLogger(__name__)
POLL_SECONDS = 0.5


class _StageReporter:
    """Turns (stage id, tasks, done) observations into phase/advance calls."""

    def __init__(self, progress: ProgressSink, watched: TaskStages) -> None:
        self.progress, self.label, self.total = progress, watched.label, watched.total
        self.unit, self.upstream = watched.unit, watched.upstream
        self.stage: object = None  # stage id shown, or "final"
        self.done = 0
        self.lock = threading.Lock()

    def final(self, completed: int) -> None:
        if self.total is None:
            return
        with self.lock:
            if self.stage != "final":
                self.stage, self.done = "final", 0
                self.progress.phase(self.label, total=self.total, unit=self.unit)
            self._advance_to(min(completed, self.total))

    def other(self, stage_id: int, tasks: int, completed: int) -> None:
        with self.lock:
            if self.upstream is None or self.stage == "final":
                return  # never back to an earlier stage once the subtasks run
            if self.stage != stage_id:
                self.stage, self.done = stage_id, 0
                self.progress.phase(self.upstream, total=tasks or None, unit="tasks")
            self._advance_to(completed)

    def _advance_to(self, completed: int) -> None:
        if completed > self.done:
            self.progress.advance(completed - self.done)
            self.done = completed


@dataclass(frozen=True)
class TaskStages:
    """What `report_tasks` shows: the final stage's ``label`` and its ``total`` tasks
    (None: no final stage is known; only ``upstream`` stages are shown), the stages its
    job has at least, the phase of the stages before it."""

    label: str
    total: int | None
    stages: int = 1
    upstream: str | None = None
    unit: str = "subtasks"


@contextmanager
def report_tasks(spark, progress: ProgressSink, watched: TaskStages,
                 interval: float = POLL_SECONDS) -> Iterator[None]:
    """Report the Spark tasks of the action run inside (see the module docstring)."""
    if not reports(progress):
        yield
        return
    reporter = _StageReporter(progress, watched)
    watch = _watch_connect if is_connect(spark) else _watch_classic
    with watch(spark, reporter, watched.total, watched.stages, interval):
        yield
    if watched.total is not None:
        reporter.final(watched.total)  # the action returned: every task finished


@contextmanager
def _watch_classic(spark, reporter: _StageReporter, total: int | None, stages: int,
                   interval: float) -> Iterator[None]:
    tracker = spark.sparkContext.statusTracker()
    before = set(tracker.getActiveJobsIds())
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval):
            try:
                _poll_classic(tracker, before, reporter, total, stages)
            except Exception as exc:  # noqa: BLE001 - progress must never fail the work
                log.debug("progress: status tracker unreadable: %s", exc)

    thread = threading.Thread(target=poll, name="ckpt-spark-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def _poll_classic(tracker, before: set[int], reporter: _StageReporter, total: int | None,
                  stages: int) -> None:
    active = set(tracker.getActiveStageIds())
    for job_id in sorted(set(tracker.getActiveJobsIds()) - before, reverse=True):
        info = tracker.getJobInfo(job_id)
        if info is None:
            continue
        ids = sorted(info.stageIds)
        last = tracker.getStageInfo(ids[-1]) if ids else None
        if last is not None and last.stageId in active and len(ids) >= stages \
                and last.numTasks == total:
            reporter.final(last.numCompletedTasks)
            return
        running = [s for s in ids if s in active]
        if running:
            stage = tracker.getStageInfo(running[0])
            if stage is not None:
                reporter.other(stage.stageId, stage.numTasks, stage.numCompletedTasks)
            return


@contextmanager
def _watch_connect(spark, reporter: _StageReporter, total: int | None, stages: int,
                   _interval: float) -> Iterator[None]:
    seen: set[int] = set()

    # pyspark's ProgressHandler: called with keywords (stages, inflight_tasks, operation_id,
    # done); extra ones from newer clients are ignored.
    def handler(stages=None, inflight_tasks=0, operation_id=None, done=False, **_more) -> None:
        try:
            infos = sorted(stages or (), key=lambda s: s.stage_id)
            seen.update(s.stage_id for s in infos)
            if not infos:
                return
            last = infos[-1]
            if len(seen) >= stages and last.num_tasks == total:
                reporter.final(last.num_completed_tasks)
                return
            running = [s for s in infos if not s.done] or infos
            reporter.other(running[-1].stage_id, running[-1].num_tasks,
                           running[-1].num_completed_tasks)
        except Exception as exc:  # noqa: BLE001 - progress must never fail the work
            log.debug("progress: Spark Connect progress unreadable: %s", exc)

    try:
        spark.registerProgressHandler(handler)
    except Exception as exc:  # noqa: BLE001 - progress must never fail the work
        log.debug("progress: no Spark Connect progress handler: %s", exc)
        yield
        return
    try:
        yield
    finally:
        spark.removeProgressHandler(handler)
