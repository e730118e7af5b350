"""What the run protocol asks of an engine: `SparkEngine` or `LocalEngine`.

The run (`statebackend.job.run`) picks the engine (`statebackend.engines.choose_engine`,
the one policy) and asks it for three things; both engines run the same subtasks
(`statebackend.job.task.run_one_subtask`) over the same rows in the same order, so
their results are the same.
"""

from __future__ import annotations

from typing import Protocol

from statebackend.job.api import Job
from statebackend.job.results import TaskResult
from statebackend.job.task import TaskParams
from statebackend.progress import ProgressSink


class Engine(Protocol):
    """An engine of job runs."""

    name: str
    task_word: str  # "a Spark task" | "a local subtask": where a failure happened

    def default_parallelism(self) -> int:
        """P of a new lineage run without ``--parallelism``."""

    def max_event_time(self, job: Job, watermark: int | None, parallelism: int,
                       progress: ProgressSink, label: str) -> int | None:
        """Max event time of the input rows the ``parallelism`` tasks will accept
        (progress phase ``label``)."""

    def reads_input_itself(self, parallelism: int) -> bool:
        """Whether a run at ``parallelism`` reads its input inside its tasks with the
        Arrow reader (the local engine always; Spark's direct read), so the run's
        ``input_reader`` is ``arrow``."""

    def run_tasks(self, params: TaskParams, progress: ProgressSink) -> list[TaskResult]:
        """Every subtask's result, in subtask order; `TaskFailedError` (one line) when a
        subtask fails (after the others stopped: no upload races the discard)."""


def tasks_label(params: TaskParams) -> str:
    """The progress phase of a run's subtasks (both engines)."""
    return f"run {params.run_id}, checkpoint {params.checkpoint_id}"


def reading_label(params: TaskParams) -> str:
    """The progress phase of reading a run's input (both engines)."""
    return f"run {params.run_id}: reading input"
