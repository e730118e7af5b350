"""The Spark engine of a job run: the input read, routed and processed by Spark tasks.

Driver side of the run protocol's Spark work (`statebackend.job.run` decides, the
tasks are `statebackend.job.task`):

- `SparkEngine.max_event_time`: the new watermark's input. Usually the
  `WATERMARK_CANDIDATES` rows with the latest event times settle it: a top-k the JVM
  computes (no Python worker), validated on the driver; otherwise one pass validates
  every row.
- `SparkEngine.run_tasks`: read (`statebackend.job.input.read_input`), route each row
  to its subtask (`statebackend.spark.dispatch.route`), one marker row per subtask,
  shuffle, sort each partition by key, event time and the other columns, then one
  ``mapInArrow`` task per subtask (`statebackend.job.task.run_subtask`) returning its
  result row. A failed task is one `TaskFailedError` line.

Classic sessions and Spark Connect alike: no SparkContext or RDD call on this path.
"""

from __future__ import annotations

import functools

from statebackend.job.api import Job
from statebackend.job.core import max_accepted_time, max_accepted_time_of_latest
from statebackend.job.input import TEXT, InputFiles, marker_row, raw_table, read_ddl, read_input
from statebackend.job.task import MARKER, RESULT_DDL, TaskParams, row_order, run_subtask
from statebackend.progress import ProgressSink

# Rows with the latest event times the driver validates to find the new watermark.
WATERMARK_CANDIDATES = 1000


class SparkEngine:
    """A run's Spark work in session ``spark`` over ``files`` read by ``reader``."""

    name = "spark"
    task_word = "a Spark task"

    def __init__(self, spark, files: InputFiles, reader: str = "auto") -> None:
        self.spark = spark
        self.files = files
        self.reader = reader

    def default_parallelism(self) -> int:
        from statebackend.spark.session import default_parallelism  # classic and Connect

        return default_parallelism(self.spark)

    def max_event_time(self, job: Job, watermark: int | None, progress: ProgressSink,
                       label: str) -> int | None:
        from statebackend.spark.progress import report_tasks

        with report_tasks(self.spark, progress, "event times", total=None, upstream=label):
            return max_event_time(self.spark, job, self.files, watermark, self.reader)

    def run_tasks(self, params: TaskParams, progress: ProgressSink, *, label: str,
                  upstream: str, description: str, group_prefix: str,
                  batch_rows: int) -> list[dict]:
        """One result row per subtask; `TaskFailedError` (one line) when a task fails."""
        from statebackend.spark import dispatch
        from statebackend.spark.progress import report_tasks

        job, inp = params.job, params.job.input
        ddl = read_ddl(inp)
        routed = dispatch.route(
            read_input(self.spark, self.files, inp, self.reader),
            dispatch.Routing(inp.key, params.max_parallelism, params.parallelism,
                             params.part_values), ddl)
        tasks = dispatch.with_markers(self.spark, routed, ddl, lambda _v: marker_row(inp, MARKER),
                                      params.parallelism, row_order(job)).mapInArrow(
            functools.partial(run_subtask, params), RESULT_DDL)
        # The subtasks' tasks follow the routing shuffle: their job has 2 stages.
        with report_tasks(self.spark, progress, label, total=params.parallelism, stages=2,
                          upstream=upstream):
            return dispatch.run_tasks(self.spark, tasks, description,
                                      group_prefix=group_prefix, batch_rows=batch_rows)


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


def _max_times(job: Job, watermark: int | None, batches):
    import pyarrow as pa

    best = None
    for batch in batches:
        if len(batch):
            m = max_accepted_time(job, raw_table(job.input, batch), watermark)
            if m is not None:
                best = m if best is None else max(best, m)
    yield pa.RecordBatch.from_pylist([{"m": best}], schema=pa.schema([("m", pa.int64())]))
