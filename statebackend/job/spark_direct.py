"""The Spark engine's direct read: the tasks read the input themselves.

Spark's own route to a subtask (`statebackend.job.spark_engine`'s shuffle) moves every
input row into the JVM, through a sort-based shuffle and back out to a Python worker
as Arrow: on a 2-core machine 0.7 s for 250,000 rows before any of the job's work (a
task that only counts its rows), plus 0.15 s of DataFrame planning on the driver.
When the input is small next to the run's parallelism it is cheaper for each task to
read all of it: one Spark job over ``spark.range(T)`` (partition j holds the one value
j: no shuffle, no input row in the JVM), T = min(P, the cores Spark schedules on).
Task j reads every input file once with the Arrow reader
(`statebackend.job.arrow_input.read_file`), keeps the rows of its subtasks j, j + T,
j + 2T ... (`statebackend.job.local_engine.row_subtasks`) and runs those subtasks one
after the other, each over its rows sorted like the local engine's
(`subtask_batches`), as the local engine runs min(P, cores) threads. A subtask's rows,
and their order, are the local engine's; results are bit-identical across the three
routes.

`statebackend.job.input.reads_directly` is the rule: the Arrow reader allowed
(``RunConfig.input_reader`` ``auto`` or ``arrow``) and the bytes the tasks decode
together, the input's decompressed bytes (as the engine choice weighs them) times T,
at most ``CKPT_SPARK_DIRECT_READ_MAX_BYTES`` (`statebackend.defaults`). Under the same
rule the driver finds the watermark by reading the input once itself
(`max_event_time_read`) instead of a Spark job over it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from statebackend.job.api import Job
from statebackend.job.arrow_input import raw_table, read_file, read_schema
from statebackend.job.core import max_accepted_time
from statebackend.job.input import InputFiles, input_paths
from statebackend.job.local_engine import row_subtasks, subtask_batches
from statebackend.job.results import RESULT_SCHEMA
from statebackend.job.task import TaskParams, run_one_subtask
from statebackend.spark import dispatch
from statebackend.subtasks import named_failure


def direct_tasks(spark, params: TaskParams, files: InputFiles, result_ddl: str,
                 tasks: int):
    """The run's one Spark job of ``tasks`` tasks (at most P), task j running subtasks
    j, j + T, j + 2T ... over the rows it reads itself, once."""
    return spark.range(0, tasks, 1, tasks).mapInArrow(
        functools.partial(run_direct_task, params, tasks, input_paths(files), files.options),
        result_ddl)


def run_direct_task(params: TaskParams, tasks: int, paths: tuple[str, ...],
                    options: Mapping[str, Any], batches: Iterator[pa.RecordBatch]
                    ) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function: a result row for each subtask of the task this
    partition names, run one after the other (the task holds one core)."""
    ctx = dispatch.task_context()
    ids = [i for batch in batches for i in batch.column(0).to_pylist()]
    if ids != [ctx.partitionId()]:
        raise RuntimeError(f"partition {ctx.partitionId()} of range(T) holds {ids}, not its "
                           "own index: Spark's range partitioning changed")
    subtasks = range(ids[0], params.parallelism, tasks)
    with named_failure("subtask", subtasks[0]):  # a read failure: the first subtask's task
        tables = own_rows(params, paths, options, subtasks)
    for subtask in subtasks:
        with named_failure("subtask", subtask):
            table = tables.pop(subtask)
            rows = subtask_batches(table, np.arange(table.num_rows), params)
            result = run_one_subtask(params, subtask, ctx.attemptNumber(), rows)
        yield pa.RecordBatch.from_pylist([result.to_row()], schema=RESULT_SCHEMA)


def own_rows(params: TaskParams, paths: Iterable[str], options: Mapping[str, Any],
             subtasks: Sequence[int]) -> dict[int, pa.Table]:
    """Per subtask of ``subtasks``, the rows of ``paths`` that belong to it, in input
    order; one file's batches are held at a time besides them."""
    inp = params.job.input
    schema = read_schema(inp)
    kept: dict[int, list[pa.RecordBatch]] = {s: [] for s in subtasks}
    for path in paths:
        for batch in read_file(inp, options, path, schema):
            of_row = row_subtasks(batch.column(inp.key), params)
            for subtask, parts in kept.items():
                parts.append(batch.filter(pa.array(of_row == subtask)))
    return {s: pa.Table.from_batches(parts, schema) for s, parts in kept.items()}


def max_event_time_read(job: Job, files: InputFiles, watermark: int | None) -> int | None:
    """Max accepted event time over every input row, read here file by file."""
    inp = job.input
    schema = read_schema(inp)
    return max_accepted_of(job, (batch for path in input_paths(files)
                                 for batch in read_file(inp, files.options, path, schema)),
                           watermark)


def max_accepted_of(job: Job, batches: Iterable[pa.RecordBatch],
                    watermark: int | None) -> int | None:
    """Max accepted event time over `read_schema` ``batches`` (None: none accepted)."""
    best = None
    for batch in batches:
        if len(batch):
            m = max_accepted_time(job, raw_table(job.input, batch), watermark)
            if m is not None:
                best = m if best is None else max(best, m)
    return best
