"""`statebackend.spark.dispatch`: rows reach the partition of their subtask (Flink's key
group assignment, recomputed here from `statebackend.state.keygroups`), every subtask
gets a task, per-job settings are undone, and a task failure is one line."""

from __future__ import annotations

import pyarrow as pa
import pytest

from statebackend.spark.dispatch import (
    ARROW_BATCH_CONF,
    PARTITION_COLUMN,
    Routing,
    arrow_batch_rows,
    assign_partition,
    partition_values,
    root_cause,
    route,
    spark_partition_of_int,
    task_failure,
    with_markers,
)
from statebackend.state.keygroups import key_group_for_bytes

M = 128


def subtask_of(key: str | None, parallelism: int) -> int:
    """The reference: key group murmur3(UTF-8 key) mod M, subtask kg * P // M; keyless: 0."""
    return key_group_for_bytes(key.encode(), M) * parallelism // M if key else 0


@pytest.mark.parametrize("parallelism", [1, 2, 5, 16])
def test_partition_values_cover_every_partition_once(parallelism):
    values = partition_values(parallelism)
    assert [spark_partition_of_int(v, parallelism) for v in values] == list(range(parallelism))
    for i, value in enumerate(values):  # the smallest such int
        assert all(spark_partition_of_int(v, parallelism) != i for v in range(value))


def test_assign_partition_follows_the_key_group_assignment():
    p = 5
    routing = Routing("key", M, p, tuple(partition_values(p)))
    keys = [f"user-{i}" for i in range(300)] + ["", None, "ключ", "🙂"]
    batches = [pa.RecordBatch.from_pylist([{"key": k, "n": i} for i, k in enumerate(part)])
               for part in (keys[:100], keys[100:])]
    out = pa.Table.from_batches(list(assign_partition(routing, iter(batches))))
    assert out.column_names == ["key", "n", PARTITION_COLUMN]
    assert out.column(PARTITION_COLUMN).type == pa.int32()
    got = out.column(PARTITION_COLUMN).to_pylist()
    assert got == [routing.part_values[subtask_of(k, p)] for k in keys]


def test_each_partition_holds_exactly_its_subtasks_rows_and_one_marker(spark):
    p = 4
    keys = [f"k{i}" for i in range(200)]
    df = spark.createDataFrame([(k, i) for i, k in enumerate(keys)], "key string, n int")
    routed = route(df, Routing("key", M, p, tuple(partition_values(p))), "key string, n int")
    out = with_markers(spark, routed, "key string, n int", lambda v: (None, -1), p, ("n",))
    parts = out.rdd.glom().collect()
    assert len(parts) == p
    for i, rows in enumerate(parts):
        assert [r.n for r in rows if r.key is None] == [-1]  # its marker: the task runs
        data = [r for r in rows if r.key is not None]
        assert {r.key for r in data} == {k for k in keys if subtask_of(k, p) == i}
        assert [r.n for r in data] == sorted(r.n for r in data)  # sorted within the partition


def test_arrow_batch_rows_is_set_for_the_block_only(spark):
    before = spark.conf.get(ARROW_BATCH_CONF, None)
    with arrow_batch_rows(spark, 123):
        assert spark.conf.get(ARROW_BATCH_CONF) == "123"
    assert spark.conf.get(ARROW_BATCH_CONF, None) == before
    with arrow_batch_rows(spark, None):
        assert spark.conf.get(ARROW_BATCH_CONF, None) == before


PY4J = """An error occurred while calling o123.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 3.0 failed
\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:2898)
Caused by: org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/job.py", line 12, in process
statebackend.errors.CorruptStateError: subtask 1: block checksum mismatch in 000012.sst
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException
"""
READ_FAILURE = """Job aborted due to stage failure: Encountered error while reading file \
file:///data/day=1/part-3.parquet. Details:
Caused by: org.apache.parquet.io.ParquetDecodingException: Can not read value at 0 in block -1
Caused by: java.io.EOFException: reached end of stream after reading 12 bytes
"""


def test_task_failure_is_the_deepest_cause_in_one_line():
    line = task_failure(RuntimeError(PY4J))
    assert line == "statebackend.errors.CorruptStateError: subtask 1: block checksum " \
                   "mismatch in 000012.sst"
    assert "\n" not in line


def test_task_failure_names_the_input_file_spark_could_not_read():
    assert task_failure(RuntimeError(READ_FAILURE)) == (
        "cannot read input file file:///data/day=1/part-3.parquet: java.io.EOFException: "
        "reached end of stream after reading 12 bytes; replace or remove that file and re-run")


NAMED = """An error occurred while calling o88.collectToPython.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 2 in stage 5.0 failed
Caused by: org.apache.spark.api.python.PythonException: Traceback (most recent call last):
  File "/statebackend/subtasks.py", line 64, in named_failure
statebackend.errors.TaskFailedError: new subtask 2: SnapshotError: injected fault
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException
Caused by: org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception \
was thrown from the Python worker. Please see the stack trace below. SQLSTATE: 38000
"""


def test_a_task_that_named_itself_is_the_cause_wherever_its_line_is():
    """The failure `subtasks.named_failure` raised in the task, even when a JVM wrapper's
    error line (SQLSTATE 38000) comes after it."""
    assert root_cause(RuntimeError(NAMED)) == "new subtask 2: SnapshotError: injected fault"


def test_root_cause_without_an_error_line():
    assert root_cause(RuntimeError("something odd\n\tat a.b.C(C.java:1)\n... 12 more")) == \
        "something odd"
    assert root_cause(KeyError()) == "KeyError"
