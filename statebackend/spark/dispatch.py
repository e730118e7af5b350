"""Task dispatch: rows to subtasks, one Spark task per subtask, failures as one line.

Routing (`route`): a row's key group is the lineage's key hash of its UTF-8 key mod M
and its subtask ``kg * P // M`` (Flink's assignment, `statebackend.state.keygroups`).
With the ``spark`` key hash that is Spark SQL's own ``pmod(hash(key), M)``: the JVM
computes it, no Python worker sees the rows before their subtask's task; with
``murmur3`` a ``mapInArrow`` pass computes it. Spark places rows by hashing a column,
so each row gets ``_p``: the smallest int that
Spark's hash partitioner sends to partition i (`partition_values`), and
``repartition(P, _p)`` then puts exactly subtask i's rows in partition i. One
marker row per subtask (`with_markers`) makes every task run, also a subtask
without rows (it carries its handle forward or writes its first checkpoint).

`run_tasks` runs the tasks under a job tag (classic and Spark Connect), sets the
Arrow batch size for the job only, and turns a failure into one line
(`task_failure`: the input file Spark names, else the deepest cause) after
cancelling the job's other tasks (`stop_tasks`; on classic it also waits for
them, so the caller's discard never races a task still uploading).
"""

from __future__ import annotations

import functools
import logging
import re
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mmh3
import numpy as np
import pyarrow as pa

from statebackend.errors import TaskFailedError
from statebackend.spark.session import is_connect
from statebackend.state.keygroups import MURMUR3, SPARK_HASH
from statebackend.state.keygroups_bulk import key_groups

if TYPE_CHECKING:
    from pyspark import TaskContext

SPARK_HASH_SEED = 42
PARTITION_COLUMN = "_p"
ARROW_BATCH_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"
log = logging.getLogger(__name__)


def spark_partition_of_int(value: int, num_partitions: int) -> int:
    """Spark's HashPartitioning of an IntegerType column: pmod(murmur3(value, 42), n)."""
    return mmh3.hash(struct.pack("<i", value), SPARK_HASH_SEED, signed=True) % num_partitions


def partition_values(parallelism: int) -> list[int]:
    """For each subtask i, the smallest int that Spark's hash partitioner sends to partition i."""
    values = [-1] * parallelism  # -1: no value found yet
    missing, v = parallelism, 0
    while missing:
        p = spark_partition_of_int(v, parallelism)
        if values[p] < 0:
            values[p] = v
            missing -= 1
        v += 1
    return values


def task_context() -> TaskContext:
    """The context of the Spark task this code runs in (on an executor)."""
    from pyspark import TaskContext  # on an executor: Spark is there

    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("no Spark task context: this runs only inside a Spark task")
    return ctx


@dataclass(frozen=True)
class Routing:
    """What `assign_partition` needs on the executors (shipped with the function)."""

    key: str
    max_parallelism: int
    parallelism: int
    part_values: tuple[int, ...]
    key_hash: str = MURMUR3


def assign_partition(routing: Routing, batches: Iterator[pa.RecordBatch]
                     ) -> Iterator[pa.RecordBatch]:
    """Add ``_p`` (int32): the shuffle value of each row's subtask; keyless rows go to 0."""
    m, p = routing.max_parallelism, routing.parallelism
    values = np.asarray(routing.part_values, dtype=np.int32)
    for batch in batches:
        kgs = key_groups(batch.column(routing.key), m, routing.key_hash)  # null: group 0
        yield batch.append_column(PARTITION_COLUMN,
                                  pa.array(values[kgs * p // m], pa.int32()))


def route(df, routing: Routing, ddl: str):
    """``df`` (schema ``ddl``) plus ``_p``, computed on the executors: in the JVM for the
    ``spark`` key hash, else by a ``mapInArrow`` pass."""
    if routing.key_hash == SPARK_HASH:
        from pyspark.sql import functions as F

        m, p, key = routing.max_parallelism, routing.parallelism, f"`{routing.key}`"
        key_group = f"if({key} is null, 0, pmod(hash({key}), {m}))"  # a null key: group 0
        values = F.array(*(F.lit(v) for v in routing.part_values))
        # the subtask is kg * P div M (Flink's assignment); element_at counts from 1
        part = F.element_at(values, F.expr(f"cast({key_group} * {p} div {m} as int) + 1"))
        return df.withColumn(PARTITION_COLUMN, part.cast("int"))
    return df.mapInArrow(functools.partial(assign_partition, routing),
                         f"{ddl}, {PARTITION_COLUMN} int")


def with_markers(spark, routed, ddl: str, marker_row: Callable[[int], tuple], parallelism: int,
                 sort_by: tuple[str, ...]):
    """One marker row per subtask, then exactly subtask i's rows in partition i.

    Sorting within the partition fixes the order in which rows reach the logic, so
    the same input gives bit-identical state (float sums) in local and cluster mode.
    """
    from pyspark.sql import functions as F

    values = partition_values(parallelism)
    markers = spark.createDataFrame([(*marker_row(v), v) for v in values],
                                    f"{ddl}, {PARTITION_COLUMN} int")
    out = routed.unionByName(markers).repartition(parallelism, F.col(PARTITION_COLUMN))
    return out.sortWithinPartitions(*sort_by) if sort_by else out


def run_tasks(spark, df, description: str, *, group_prefix: str,
              batch_rows: int | None = None) -> list[dict]:
    """Collect ``df`` (one result row per task) under a job tag; one-line failures.

    Tags (not job groups) work on classic sessions and Spark Connect alike.
    """
    with job_tag(spark, group_prefix, description) as tag, arrow_batch_rows(spark, batch_rows):
        first_job = _next_job_id(spark)
        try:
            return [r.asDict() for r in df.collect()]
        except Exception as exc:  # noqa: BLE001 - Py4J/PythonException: re-raised as one line
            stop_tasks(spark, tag, first_job)
            raise TaskFailedError(task_failure(exc)) from exc


@contextmanager
def job_tag(spark, prefix: str, description: str | None = None) -> Iterator[str]:
    """Tag the jobs started inside (and describe them on classic, where the UI shows it)."""
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{prefix}-{time.time_ns()}")  # no ',' in a tag
    classic = not is_connect(spark)
    if classic and description:
        spark.sparkContext.setJobDescription(description)
    spark.addTag(tag)
    try:
        yield tag
    finally:
        spark.removeTag(tag)
        if classic and description:
            spark.sparkContext.setJobDescription(None)


@contextmanager
def arrow_batch_rows(spark, batch_rows: int | None) -> Iterator[None]:
    """Rows per Arrow batch for the jobs started inside only."""
    if not batch_rows:
        yield
        return
    saved = spark.conf.get(ARROW_BATCH_CONF, None)
    spark.conf.set(ARROW_BATCH_CONF, str(batch_rows))
    try:
        yield
    finally:
        if saved is None:
            spark.conf.unset(ARROW_BATCH_CONF)
        else:
            spark.conf.set(ARROW_BATCH_CONF, saved)


def stop_tasks(spark, tag: str, first_job: int | None) -> None:
    """After a failed job: cancel what still runs under ``tag``; on classic, wait for it.

    Spark Connect has no status tracker: the tasks still running are cancelled and
    the caller's discard removes what the finished ones recorded (attempt records);
    an upload cut short by the cancel is an orphan for ``ckpt gc``.
    """
    try:
        spark.interruptTag(tag)
    except Exception as exc:  # noqa: BLE001 - best effort: the failure is reported anyway
        log.warning("could not cancel the jobs tagged %s: %s", tag, exc)
    if first_job is not None and not is_connect(spark):
        wait_for_tasks(spark, first_job)


def _next_job_id(spark) -> int | None:
    """Classic only: jobs started from here on have ids >= this (ids only grow)."""
    if is_connect(spark):
        return None
    known = spark.sparkContext.statusTracker().getJobIdsForGroup()  # jobs without a group
    return max(known, default=-1) + 1


def wait_for_tasks(spark, first_job: int, timeout_s: float = 60.0) -> None:
    """Classic: let the failed job's other tasks stop before their uploads are removed."""
    tracker = spark.sparkContext.statusTracker()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stages = [st for job in tracker.getJobIdsForGroup() if job >= first_job
                  for info in [tracker.getJobInfo(job)] if info is not None
                  for st in info.stageIds]
        active = 0
        for stage in stages:
            info = tracker.getStageInfo(stage)
            active += info.numActiveTasks if info is not None else 0
        if not active:
            return
        time.sleep(0.2)


_FAILED_FILE = re.compile(r"Encountered error while reading file (\S+?)\.?(?:\s|$)")
_CAUSED_BY = re.compile(r"^Caused by: ([A-Za-z_.$]*(?:Error|Exception)\b.*)")


_NAMED_FAILURE = f"{TaskFailedError.__module__}.{TaskFailedError.__name__}: "


def task_failure(exc: BaseException) -> str:
    """One line: the input file Spark names (if any) and the deepest cause."""
    text = str(exc)
    found = _FAILED_FILE.search(text)
    if found is None:
        return root_cause(exc)
    causes = [m.group(1).strip() for ln in text.splitlines()
              if (m := _CAUSED_BY.match(ln.strip()))]
    cause = causes[-1] if causes else root_cause(exc)
    return (f"cannot read input file {found.group(1)}: {cause[:300]}; replace or remove "
            "that file and re-run")


def root_cause(exc: BaseException) -> str:
    """The deepest ``SomeError: message`` line; never a JVM stack frame."""
    text = str(exc)
    lines = [ln.strip().removeprefix("Caused by: ") for ln in text.splitlines() if ln.strip()]
    # A task that named itself (subtasks.named_failure) is the cause, wherever Spark put
    # its line: a JVM wrapper's line (PythonException ... SQLSTATE: 38000) may follow it.
    for ln in reversed(lines):
        if ln.startswith(_NAMED_FAILURE):
            return ln.removeprefix(_NAMED_FAILURE)[:500]
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_.$]*(Error|Exception)\b.*:", ln) and "Py4J" not in ln:
            return ln[:500]
    # Spark Connect's text of a JVM failure ends in frames ("at ...", "... 12 more").
    messages = [ln for ln in lines if not re.match(r"^(at |\.\.\. \d+ more)", ln)]
    return (messages[-1] if messages else type(exc).__name__)[:500]
