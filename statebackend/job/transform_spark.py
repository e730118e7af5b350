"""A transform on Spark: one Spark task per source subtask runs the function, the rows
are shuffled by the new key's subtask, one Spark task per new subtask writes it.

``spark.range(S, numPartitions=S)`` gives source subtask i its own task
(`statebackend.spark.state_reader` reads the same way), which runs
`statebackend.job.transform_apply.transformed_spans` and encodes each result table
against the new job (`statebackend.job.bootstrap_tables`: a bad table fails its task
in one line) into entry rows with their subtask's shuffle value; the bootstrap's Spark
writer (`statebackend.job.bootstrap_spark.write_entries`) shuffles them into P
partitions and writes each new subtask. The driver collects P small result rows,
never the data. Classic sessions and Spark Connect alike.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from statebackend.job.bootstrap_spark import (
    ENTRY_DDL,
    as_task_failure,
    entry_rows,
    write_entries,
)
from statebackend.job.bootstrap_tables import SPARK_ROW_BITS, plan_table
from statebackend.job.bootstrap_write import BootstrapTask, SubtaskWritten
from statebackend.job.transform_apply import SourceRead, transformed_spans
from statebackend.spark import dispatch
from statebackend.subtasks import named_failure


def transform_with_spark(spark: Any, read: SourceRead, task: BootstrapTask
                         ) -> list[SubtaskWritten]:
    """Every new subtask written by its own Spark task (module doc)."""
    n = len(read.handles)
    values = tuple(dispatch.partition_values(task.parallelism))
    entries = spark.range(0, n, 1, n).mapInArrow(
        functools.partial(transform_partition, read, task, values),
        f"{ENTRY_DDL}, {dispatch.PARTITION_COLUMN} int")
    return write_entries(task, spark, entries)


def transform_partition(read: SourceRead, task: BootstrapTask, part_values: tuple[int, ...],
                        ids: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: each source subtask whose index arrives, transformed and
    encoded for the new lineage (``task``) as entry rows; row numbers carry the subtask in
    their upper bits (list elements keep the order the function gave them)."""
    for batch in ids:
        for subtask in batch.column(0).to_pylist():
            row = subtask << SPARK_ROW_BITS
            with named_failure("source subtask", subtask):
                for tables in transformed_spans(read, subtask):
                    for state, table in sorted(tables.items()):
                        with as_task_failure():
                            plan = plan_table(read.target, state, table.schema)
                        yield from entry_rows(task, plan, table,
                                              np.arange(row, row + table.num_rows), part_values)
                        row += table.num_rows
