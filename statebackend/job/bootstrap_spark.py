"""A bootstrap from Spark DataFrames: encoded by Spark tasks, one Spark task per subtask.

Driver side (`write_with_spark`): each state's DataFrame gets a row number
(``monotonically_increasing_id``: a list key's elements keep their order in the
DataFrame) and is encoded on the executors (``mapInArrow``,
`statebackend.job.bootstrap_tables.encode_batch`) into entry rows ``(family, k, v, o)``
plus ``_p``, the shuffle value of the entry's subtask (`statebackend.spark.dispatch`:
Spark's hash partitioner sends it to partition i). The entry rows of every state and
one marker row per subtask (so a subtask without entries still writes its instance)
are shuffled into P partitions, and each partition's task writes its subtask
(`statebackend.job.bootstrap_write.write_subtask`) and returns one JSON result row: the
driver collects P small rows, never the data. Classic sessions and Spark Connect
alike (DataFrame calls only). A bad row fails its task; the error is the one line the
Arrow path gives (`statebackend.spark.dispatch.root_cause`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import CkptError, TaskFailedError
from statebackend.job.bootstrap_tables import EntryChunk, TablePlan, encode_batch
from statebackend.job.bootstrap_write import BootstrapTask, SubtaskWritten, write_subtask
from statebackend.spark import dispatch
from statebackend.subtasks import named_failure

ROW = "_row"
ENTRY_SCHEMA = pa.schema([("family", pa.string()), ("k", pa.binary()), ("v", pa.binary()),
                          ("o", pa.int64()), (dispatch.PARTITION_COLUMN, pa.int32())])
ENTRY_DDL = "family string, k binary, v binary, o bigint"
RESULT_SCHEMA = pa.schema([("result", pa.string())])
MARKER = ""  # the family of the one marker row each subtask receives


def arrow_schema(df: Any) -> pa.Schema:
    """A Spark DataFrame's schema as Arrow's (what the table checks read)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    schema: pa.Schema = to_arrow_schema(df.schema)
    return schema


def write_with_spark(task: BootstrapTask, tables: Sequence[tuple[TablePlan, Any]]
                     ) -> list[SubtaskWritten]:
    """Every subtask written by its own Spark task (module doc); results in subtask order."""
    from pyspark.sql import functions as F

    values = tuple(dispatch.partition_values(task.parallelism))
    spark = tables[0][1].sparkSession
    frames = []
    for plan, df in tables:
        rows = df.select(*(F.col(f"`{c}`") for c in plan.columns),
                         F.monotonically_increasing_id().alias(ROW))
        frames.append(rows.mapInArrow(
            functools.partial(encode_rows, task, plan, values),
            f"{ENTRY_DDL}, {dispatch.PARTITION_COLUMN} int"))
    return write_entries(task, spark, functools.reduce(lambda a, b: a.unionByName(b), frames))


def write_entries(task: BootstrapTask, spark: Any, entries: Any) -> list[SubtaskWritten]:
    """Entry rows (`ENTRY_SCHEMA`: each with its subtask's ``_p``) shuffled into one
    partition per subtask, each written by its task; results in subtask order."""
    values = tuple(dispatch.partition_values(task.parallelism))
    tasks = dispatch.with_markers(spark, entries, ENTRY_DDL,
                                  lambda _v: (MARKER, None, None, None), task.parallelism, ())
    written = tasks.mapInArrow(functools.partial(write_partition, task, values),
                               "result string")
    rows = dispatch.run_tasks(spark, written, f"ckpt bootstrap {task.job_dir}",
                              group_prefix=f"ckpt-bootstrap-{task.job_dir}")
    return sorted((SubtaskWritten.from_json(json.loads(r["result"])) for r in rows),
                  key=lambda r: r.subtask)


@contextmanager
def as_task_failure() -> Iterator[None]:
    """A refused row fails its task with the refusal's own line (no class name)."""
    try:
        yield
    except CkptError as exc:
        raise TaskFailedError(str(exc)) from exc


def encode_rows(task: BootstrapTask, plan: TablePlan, part_values: tuple[int, ...],
                batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: a state's rows as entry rows with their subtask's ``_p``."""
    for batch in batches:
        if len(batch):
            yield from entry_rows(task, plan, pa.Table.from_batches([batch.drop_columns([ROW])]),
                                  batch.column(ROW).to_numpy(zero_copy_only=False),
                                  part_values)


def entry_rows(task: BootstrapTask, plan: TablePlan, table: pa.Table, rows: np.ndarray,
               part_values: tuple[int, ...]) -> Iterator[pa.RecordBatch]:
    """``table``'s rows (numbered ``rows``) encoded by ``plan`` for ``task``'s lineage
    (its max parallelism and key hash) as entry rows (`ENTRY_SCHEMA`), each with its
    subtask's ``_p``; a refused row fails the task in one line."""
    with as_task_failure():
        chunks = encode_batch(plan, table, task.max_parallelism, rows, task.key_hash)
    p, m = len(part_values), task.max_parallelism
    shuffle = np.asarray(part_values, dtype=np.int32)
    for c in chunks:
        yield pa.RecordBatch.from_arrays(
            [pa.array([c.family] * len(c.keys), pa.string()), c.keys, c.values,
             pa.array(c.rows, pa.int64()), pa.array(shuffle[c.key_groups * p // m], pa.int32())],
            schema=ENTRY_SCHEMA)


def write_partition(task: BootstrapTask, part_values: tuple[int, ...],
                    batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: this partition's subtask, written; one JSON result row."""
    ctx = dispatch.task_context()
    subtask = ctx.partitionId()
    with named_failure("subtask", subtask):
        chunks = _chunks(batches, subtask, part_values[subtask])
        result = write_subtask(task, subtask, ctx.attemptNumber(), chunks)
    yield pa.RecordBatch.from_pydict({"result": [json.dumps(result.to_json())]},
                                     schema=RESULT_SCHEMA)


def _chunks(batches: Iterator[pa.RecordBatch], subtask: int, value: int
            ) -> Iterator[EntryChunk]:
    """A partition's entry rows as chunks per family (the marker dropped); a row of
    another subtask (Spark's partitioner changed under us) fails the task."""
    for batch in batches:
        if not len(batch):
            continue
        if not pc.all(pc.equal(batch.column(dispatch.PARTITION_COLUMN), value)).as_py():
            raise RuntimeError(f"partition {subtask} received entries of another subtask: "
                               "Spark's hash partitioning no longer matches "
                               "statebackend.spark.dispatch.partition_values")
        families = batch.column("family")
        for family in pc.unique(families).to_pylist():
            if family == MARKER:
                continue
            part = batch.filter(pc.equal(families, family))
            n = len(part)
            yield EntryChunk(family, part.column("k"), part.column("v"),
                             np.zeros(n, np.int64), part.column("o").to_numpy())
