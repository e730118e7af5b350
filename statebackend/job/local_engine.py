"""The local engine: a run's subtasks in this process, without Spark.

A small scheduled run should cost what its data costs: no JVM, no Spark session, no
Python workers (`statebackend.job.engine` decides when). The results are those of
the Spark engine (`statebackend.job.spark_engine`), because every step is the same
code or the same rule:

- read: every input file with the executors' Arrow reader
  (`statebackend.job.arrow_input.read_file`), in threads, once per run;
- watermark: the max accepted event time over every row (`max_accepted_time`, which
  the Spark engine's top-k settles to the same value);
- route: key group ``murmur3_32(key) mod M`` (`key_groups`, as Spark's routing pass),
  subtask ``kg * P // M``; each subtask's rows sorted like Spark's
  ``sortWithinPartitions`` (`row_order`, nulls first; in the subtask's thread) and
  handed to `SubtaskRun` in batches of ``batch_rows`` rows, as Arrow batches reach a
  Spark task;
- tasks: `SubtaskRun` (restore, logic, snapshot, upload, outputs), in a pool of
  min(P, cores) threads. The local recovery folder is the one a ``local[...]`` Spark
  executor on this machine uses, so the engines can alternate without downloads.

A failed subtask removes its own uploads (as a failed Spark task does); the run waits
for the others before raising one `TaskFailedError` line, so the driver's discard never
races an upload.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import CkptError, TaskFailedError
from statebackend.job.api import Job
from statebackend.job.arrow_input import output_schema, read_file
from statebackend.job.core import max_accepted_time
from statebackend.job.input import InputFiles, raw_table
from statebackend.job.task import PARTITION_COLUMN, TaskParams, row_order, run_one_subtask
from statebackend.progress import ProgressSink
from statebackend.state.keygroups_bulk import key_groups

READ_THREADS = 8  # input files read at once (I/O bound: fsspec, gzip, Arrow's parsers)


class LocalEngine:
    """A run's tasks in this process over ``files`` (read once, on first use)."""

    name = "local"
    task_word = "a local subtask"

    def __init__(self, files: InputFiles, job: Job, cores: int | None = None) -> None:
        self.files = files
        self.job = job
        self.cores = max(1, cores or os.cpu_count() or 1)
        self._table: pa.Table | None = None

    def default_parallelism(self) -> int:
        return self.cores

    # -- input --------------------------------------------------------------------------
    def table(self) -> pa.Table:
        """Every input row in `output_schema` columns, files in listing order."""
        if self._table is None:
            inp, options = self.job.input, self.files.options
            schema = output_schema(inp)
            paths = (*self.files.parquet, *self.files.json)
            with ThreadPoolExecutor(max(1, min(READ_THREADS, len(paths)))) as pool:
                parts = list(pool.map(lambda p: list(read_file(inp, options, p, schema)), paths))
            self._table = pa.Table.from_batches([b for part in parts for b in part], schema)
        return self._table

    def max_event_time(self, job: Job, watermark: int | None, progress: ProgressSink,
                       label: str) -> int | None:
        progress.phase(label)
        table = self.table()
        if not table.num_rows:
            return None
        return max_accepted_time(job, raw_table(job.input, table), watermark)

    # -- tasks --------------------------------------------------------------------------
    def run_tasks(self, params: TaskParams, progress: ProgressSink, *, label: str,
                  upstream: str, description: str, group_prefix: str,
                  batch_rows: int) -> list[dict]:
        """One result row per subtask; `TaskFailedError` (one line) when a subtask fails."""
        progress.phase(upstream)
        shares = subtask_shares(self.table(), params)
        progress.phase(label, total=params.parallelism, unit="subtasks")
        with ThreadPoolExecutor(min(params.parallelism, self.cores),
                                thread_name_prefix="ckpt-subtask") as pool:
            futures = {pool.submit(_run_one, params, i, shares[i], batch_rows): i
                       for i in range(params.parallelism)}
            results, failed = [], None
            pending: set[Future] = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for f in done:
                    if f.cancelled():
                        continue
                    if f.exception() is None:
                        results.append(f.result())
                        progress.advance()
                    elif failed is None or futures[f] < futures[failed]:
                        failed = f
                if failed is not None:
                    # not started: nothing to undo; the started ones finish first
                    pending = {f for f in pending if not f.cancel()}
        if failed is not None:
            raise TaskFailedError(f"subtask {futures[failed]}: "
                                  f"{_one_line(failed.exception())}") from failed.exception()
        return results


def subtask_shares(table: pa.Table, params: TaskParams) -> list[pa.Table]:
    """Per subtask, its rows with ``_p``, in input order (`subtask_batches` sorts them)."""
    m, p = params.max_parallelism, params.parallelism
    if not table.num_rows:
        return [table.append_column(PARTITION_COLUMN, pa.array([], pa.int32()))] * p
    subtask = key_groups(table.column(params.job.input.key), m) * p // m
    order = np.argsort(subtask, kind="stable")
    values = np.asarray(params.part_values, dtype=np.int32)[subtask[order]]
    routed = table.take(pa.array(order)).append_column(PARTITION_COLUMN, pa.array(values))
    counts = np.bincount(subtask, minlength=p)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return [routed.slice(int(start), int(n)) for start, n in zip(starts, counts, strict=True)]


def subtask_batches(share: pa.Table, job: Job, batch_rows: int) -> list[pa.RecordBatch]:
    """A subtask's rows in Spark's order (``sortWithinPartitions`` by `row_order`, nulls
    first), in batches of ``batch_rows`` as Arrow batches reach a Spark task."""
    if not share.num_rows:
        return []
    return share.take(_nulls_first_order(share, row_order(job))).to_batches(
        max_chunksize=batch_rows)


def _nulls_first_order(table: pa.Table, names: tuple[str, ...]) -> pa.Array:
    """Indices sorting ``table`` by ``names`` ascending, nulls first (Spark's default)."""
    try:
        return pc.sort_indices(table, sort_keys=[(n, "ascending", "at_start") for n in names])
    except (TypeError, ValueError, pa.ArrowInvalid):  # pyarrow < 22: one placement for all
        return pc.sort_indices(table, sort_keys=[(n, "ascending") for n in names],
                               null_placement="at_start")


def _run_one(params: TaskParams, subtask: int, share: pa.Table, batch_rows: int) -> dict:
    # sorted here, in the subtask's thread: Arrow's sort releases the GIL
    return run_one_subtask(params, subtask, 0,
                           iter(subtask_batches(share, params.job, batch_rows)))


def _one_line(exc: BaseException | None) -> str:
    if isinstance(exc, CkptError):
        return str(exc)
    text = " ".join(str(exc).split()) if exc is not None else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

