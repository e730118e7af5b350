"""The Spark engine of a job run: the input read, routed and processed by Spark tasks.

Driver side of the run protocol's Spark work (`statebackend.job.run` decides, the
subtasks are `statebackend.job.task`). Two routes from the input to the subtasks,
chosen per run by `statebackend.job.input.reads_directly`:

- **direct** (a small input): one Spark job of min(P, cores) tasks, each reading the
  whole input with the Arrow reader, keeping its subtasks' rows and running them
  (`statebackend.job.spark_direct`); the watermark's input is read on the driver
  (`max_event_time_read`). No shuffle, no input row in the JVM.
- **shuffle**: `SparkEngine.max_event_time`, the new watermark's input: usually the
  `WATERMARK_CANDIDATES` rows with the latest event times settle it, a top-k the JVM
  computes (no Python worker), validated on the driver
  (`max_accepted_time_of_latest`); otherwise one pass validates every row.
  `SparkEngine.run_tasks`: read (`statebackend.job.spark_input.read_input`), route
  each row to its subtask (`statebackend.spark.dispatch.route`: Spark places rows by
  hashing a column, so each row gets ``_p``, a value Spark's partitioner sends to
  partition i), one marker row per subtask (so every subtask's task runs, also
  without rows), shuffle, sort each partition by `row_order`, then one
  ``mapInArrow`` task per subtask (`run_subtask_task`: it checks ``_p``, drops the
  marker and runs `statebackend.job.task.run_one_subtask`).

Either way each task returns its result row
(`statebackend.job.results.TaskResult.to_row`); a failed task is one
`TaskFailedError` line. Classic sessions and Spark Connect alike: no SparkContext or
RDD call on this path.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from statebackend.job.api import Job
from statebackend.job.arrow_input import REASON, TEXT, raw_table
from statebackend.job.core import event_time_column, event_times, max_accepted_time
from statebackend.job.engine import reading_label, tasks_label
from statebackend.job.input import InputFiles, reads_directly
from statebackend.job.results import RESULT_SCHEMA, TaskResult
from statebackend.job.spark_direct import direct_tasks, max_accepted_of, max_event_time_read
from statebackend.job.spark_input import marker_row, read_ddl, read_input, spark_ddl
from statebackend.job.task import TaskParams, row_order, run_one_subtask
from statebackend.progress import ProgressSink
from statebackend.spark import dispatch
from statebackend.spark.progress import TaskStages, report_tasks
from statebackend.spark.session import default_parallelism
from statebackend.subtasks import named_failure

# Rows with the latest event times the driver validates to find the new watermark.
WATERMARK_CANDIDATES = 1000
MARKER = "__subtask_marker__"  # `_reason` of the one synthetic row each subtask receives
RESULT_DDL = spark_ddl(RESULT_SCHEMA)  # what mapInArrow is told the rows are


class SparkEngine:
    """A run's Spark work in session ``spark`` over ``files`` read by ``reader``."""

    name = "spark"
    task_word = "a Spark task"

    def __init__(self, spark, files: InputFiles, reader: str = "auto") -> None:
        self.spark = spark
        self.files = files
        self.reader = reader
        self._direct: dict[int, bool] = {}

    def default_parallelism(self) -> int:
        return default_parallelism(self.spark)  # classic and Connect

    def reads_input_itself(self, parallelism: int) -> bool:
        """The direct read's rule (`reads_directly`) for its min(P, cores) readers,
        weighed once per run."""
        if parallelism not in self._direct:
            self._direct[parallelism] = reads_directly(
                self.files, self.reader, self.direct_task_count(parallelism))
        return self._direct[parallelism]

    def direct_task_count(self, parallelism: int) -> int:
        """The direct read's task count: one per core Spark schedules on, at most P."""
        return max(1, min(parallelism, self.default_parallelism()))

    def max_event_time(self, job: Job, watermark: int | None, parallelism: int,
                       progress: ProgressSink, label: str) -> int | None:
        if self.reads_input_itself(parallelism):
            progress.phase(label)
            return max_event_time_read(job, self.files, watermark)
        with report_tasks(self.spark, progress, TaskStages("event times", total=None,
                                                           upstream=label)):
            return max_event_time(self.spark, job, self.files, watermark, self.reader)

    def run_tasks(self, params: TaskParams, progress: ProgressSink) -> list[TaskResult]:
        job = params.job
        if self.reads_input_itself(params.parallelism):
            count, stages = self.direct_task_count(params.parallelism), 1
            tasks = direct_tasks(self.spark, params, self.files, RESULT_DDL, count)
        else:  # the subtasks' tasks follow the routing shuffle: their job has 2 stages
            tasks, count, stages = self.shuffled_tasks(params), params.parallelism, 2
        # A direct task may run several subtasks: then the count is of tasks.
        unit = "subtasks" if count == params.parallelism else "tasks"
        with report_tasks(self.spark, progress, TaskStages(
                tasks_label(params), total=count, stages=stages,
                upstream=reading_label(params), unit=unit)):
            rows = dispatch.run_tasks(
                self.spark, tasks, f"{job.name} {params.job_dir} run {params.run_id}",
                group_prefix=f"{job.name}-{params.job_dir}-{params.checkpoint_id}",
                batch_rows=params.batch_rows)
        return sorted((TaskResult.from_row(r) for r in rows), key=lambda r: r.subtask)

    def shuffled_tasks(self, params: TaskParams):
        """The tasks' DataFrame of the shuffle route (module doc)."""
        inp = params.job.input
        ddl = read_ddl(inp)
        values = tuple(dispatch.partition_values(params.parallelism))
        routed = dispatch.route(
            read_input(self.spark, self.files, inp, self.reader),
            dispatch.Routing(inp.key, params.max_parallelism, params.parallelism, values,
                             params.key_hash), ddl)
        return dispatch.with_markers(
            self.spark, routed, ddl, lambda _v: marker_row(inp, MARKER), params.parallelism,
            row_order(params.job)).mapInArrow(
            functools.partial(run_subtask_task, params, values), RESULT_DDL)


def run_subtask_task(params: TaskParams, part_values: tuple[int, ...],
                     batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function: one result row for this partition's subtask."""
    ctx = dispatch.task_context()
    subtask = ctx.partitionId()
    with named_failure("subtask", subtask):
        rows = _subtask_rows(batches, subtask, part_values[subtask])
        result = run_one_subtask(params, subtask, ctx.attemptNumber(), rows)
    yield pa.RecordBatch.from_pylist([result.to_row()], schema=RESULT_SCHEMA)


def _subtask_rows(batches: Iterator[pa.RecordBatch], subtask: int, value: int
                  ) -> Iterator[pa.RecordBatch]:
    """Partition ``subtask``'s batches without ``_p`` and the marker row; a row routed
    elsewhere (Spark's hash partitioning changed under us) fails the task."""
    for batch in batches:
        if not len(batch):
            continue
        part = batch.column(dispatch.PARTITION_COLUMN)
        if not pc.all(pc.equal(part, value)).as_py():
            raise RuntimeError(
                f"partition {subtask} received rows of another subtask: Spark's hash "
                "partitioning no longer matches statebackend.spark.dispatch.partition_values")
        batch = batch.drop_columns([dispatch.PARTITION_COLUMN])
        marker = pc.fill_null(pc.equal(batch.column(REASON), MARKER), False)
        if pc.any(marker).as_py():
            batch = batch.filter(pc.invert(marker))
        if len(batch):
            yield batch


def max_event_time(spark, job: Job, files: InputFiles, watermark: int | None,
                   reader: str = "auto") -> int | None:
    """Max event time of the input rows the tasks will accept (not late, valid), validated
    as the tasks do, so the watermark is exactly theirs (module doc)."""
    if not files.count:
        return None
    from pyspark.sql import functions as F

    inp = job.input
    df = read_input(spark, files, inp, reader)
    latest = df.orderBy(F.col(f"`{TEXT}{inp.event_time}`").isNotNull().desc(),
                        F.col(f"`{inp.event_time}`").desc_nulls_last()
                        ).limit(WATERMARK_CANDIDATES).toArrow()
    settled, best = max_accepted_time_of_latest(job, latest, WATERMARK_CANDIDATES, watermark)
    if settled:
        return best
    fn = functools.partial(_max_times, job, watermark)
    rows = df.mapInArrow(fn, "m bigint").collect()
    found = [r["m"] for r in rows if r["m"] is not None]
    return max(found) if found else None


def max_accepted_time_of_latest(job: Job, latest: pa.Table, limit: int,
                                watermark: int | None) -> tuple[bool, int | None]:
    """(settled, max accepted event time) judged from the input rows with the latest times.

    ``latest``: at most ``limit`` rows of `statebackend.job.spark_input.read_ddl`, those whose
    event time arrived but did not type first, then by typed event time, latest first
    (nulls last). Every row left out has a typed event time no later than the last
    row's, or none (rejected). So the answer is settled when ``latest`` holds every row,
    or its last row is typed and no later than the best accepted time, or late (at or
    before ``watermark``); otherwise (False, None): validate every row instead.
    """
    et = event_time_column(job)
    best = max_accepted_time(job, raw_table(job.input, latest), watermark) \
        if latest.num_rows else None
    if latest.num_rows < limit:
        return True, best
    if latest[TEXT + et][-1].is_valid:
        return False, None  # as many untyped event times as the limit: maybe more
    last = event_times(latest.slice(latest.num_rows - 1), et)[0].as_py()
    if last is None or (best is not None and best >= last) or \
            (watermark is not None and last <= watermark):
        return True, best
    return False, None


def _max_times(job: Job, watermark: int | None, batches):
    best = max_accepted_of(job, batches, watermark)
    yield pa.RecordBatch.from_pylist([{"m": best}], schema=pa.schema([("m", pa.int64())]))
