"""The local engine: a run's subtasks in this process, without Spark.

A small scheduled run should cost what its data costs: no JVM, no Spark session, no
Python workers (`statebackend.job.engine` decides when). The results are those of
the Spark engine (`statebackend.job.spark_engine`), because every step is the same
code or the same rule:

- read: every input file with the executors' Arrow reader
  (`statebackend.job.arrow_input.read_file`), in threads, once per run, after the
  same key-column check as the Spark engine's (`statebackend.job.input.check_key_columns`).
  The run holds its whole input in memory, so the decompressed bytes read are
  bounded by ``CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES`` (default 1 GiB; JSON text as
  decompressed, Parquet as decoded batches): past it the reading stops and the run
  fails, nothing committed, with one `InputError` line naming the input, the bound
  and the ways out (``--engine spark``, whose tasks stream the input, or a larger
  setting). The process peaks at about 4.5x the bound for JSON lines (each row keeps
  its line; docs/performance.md, "Input memory and its bound");
- watermark: the max accepted event time over every row (`max_accepted_time`, which
  the Spark engine's top-k settles to the same value);
- route: key group ``hash(key) mod M`` with the lineage's key hash (`key_groups`, as
  Spark's routing),
  subtask ``kg * P // M``; each subtask's rows sorted like Spark's
  ``sortWithinPartitions`` (`row_order`, nulls first; in the subtask's thread: the
  order columns are sorted, then the rows taken from the input table whole batches at
  a time, never a copy of the whole table) and handed to `SubtaskRun` in batches of
  ``batch_rows`` rows, as Arrow batches reach a Spark task;
- tasks: `statebackend.job.task.run_one_subtask` (restore, logic, snapshot, upload,
  outputs) in min(P, cores) threads (`statebackend.subtasks.run_in_threads`, the
  runner rescale uses too). The local recovery folder is the one a ``local[...]``
  Spark executor on this machine uses, so the engines can alternate without downloads.

A failed subtask removes its own uploads (as a failed Spark task does); the run waits
for the others before raising one `TaskFailedError` line, so the driver's discard never
races an upload.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from statebackend import settings
from statebackend.engines import MAX_MEMORY_ENV, mib
from statebackend.errors import InputError
from statebackend.job.api import Job
from statebackend.job.arrow_input import (
    BudgetExceeded,
    ByteBudget,
    check_key_columns,
    raw_table,
    read_file,
    read_schema,
)
from statebackend.job.core import max_accepted_time
from statebackend.job.engine import reading_label, tasks_label
from statebackend.job.input import InputFiles, input_paths
from statebackend.job.results import TaskResult
from statebackend.job.task import TaskParams, nulls_first_order, row_order, run_one_subtask
from statebackend.progress import ProgressSink
from statebackend.state.keygroups_bulk import key_groups
from statebackend.subtasks import run_in_threads

READ_THREADS = 8  # input files read at once (I/O bound: fsspec, gzip, Arrow's parsers)
TAKE_ROWS = 1_000_000  # a subtask takes its sorted rows this many at a time (fewer is slower)
TAKE_BYTES = 256 * 2**20  # ... and about this many bytes (a string column stays < 2 GiB)


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
        """Every input row in `read_schema` columns, files in listing order."""
        if self._table is None:
            inp, options = self.job.input, self.files.options
            check_key_columns(self.files, inp)
            schema = read_schema(inp)
            paths = input_paths(self.files)
            limit = settings.byte_count(MAX_MEMORY_ENV)
            budget = ByteBudget(limit)
            try:
                with ThreadPoolExecutor(max(1, min(READ_THREADS, len(paths)))) as pool:
                    parts = list(pool.map(
                        lambda p: list(read_file(inp, options, p, schema, budget)), paths))
            except BudgetExceeded as exc:
                raise InputError(
                    f"input {self.files.url}: the local engine holds a run's whole input in "
                    f"memory and stopped reading at {exc.path} after {mib(exc.total)} "
                    f"decompressed, over {MAX_MEMORY_ENV}={limit} ({mib(limit)}); run it "
                    f"with --engine spark (its tasks stream the input) or raise "
                    f"{MAX_MEMORY_ENV}; nothing was committed") from None
            self._table = pa.Table.from_batches([b for part in parts for b in part], schema)
        return self._table

    def reads_input_itself(self, parallelism: int) -> bool:
        return True

    def max_event_time(self, job: Job, watermark: int | None, parallelism: int,
                       progress: ProgressSink, label: str) -> int | None:
        progress.phase(label)
        table = self.table()
        if not table.num_rows:
            return None
        return max_accepted_time(job, raw_table(job.input, table), watermark)

    # -- tasks --------------------------------------------------------------------------
    def run_tasks(self, params: TaskParams, progress: ProgressSink) -> list[TaskResult]:
        progress.phase(reading_label(params))
        table = self.table()
        self._table = None  # held by the subtasks until the last one ends
        rows = subtask_rows(table, params)
        progress.phase(tasks_label(params), total=params.parallelism, unit="subtasks")

        def run_one(i: int) -> TaskResult:
            # sorted here, in the subtask's thread: Arrow's sort and take release the GIL
            return run_one_subtask(params, i, 0, subtask_batches(table, rows[i], params))

        return run_in_threads(params.parallelism, run_one,
                              workers=min(params.parallelism, self.cores), progress=progress)


def subtask_rows(table: pa.Table, params: TaskParams) -> list[np.ndarray]:
    """Per subtask, the indices of its rows in ``table``, in input order."""
    p = params.parallelism
    if not table.num_rows:
        return [np.empty(0, np.int64)] * p
    subtask = row_subtasks(table.column(params.job.input.key), params)
    # P <= max parallelism <= 32768: as uint16, NumPy's stable sort is a radix sort
    order = np.argsort(subtask.astype(np.uint16), kind="stable")
    return np.split(order, np.cumsum(np.bincount(subtask, minlength=p))[:-1])


def row_subtasks(keys: pa.Array | pa.ChunkedArray, params: TaskParams) -> np.ndarray:
    """Each row's subtask: key group ``hash(key) mod M`` (the lineage's hash; a null key:
    group 0), subtask ``kg * P // M``."""
    m = params.max_parallelism
    return key_groups(keys, m, params.key_hash) * params.parallelism // m


def subtask_batches(table: pa.Table, rows: np.ndarray, params: TaskParams
                    ) -> Iterator[pa.RecordBatch]:
    """A subtask's rows (``rows`` of ``table``) in Spark's order (``sortWithinPartitions``
    by `row_order`, nulls first; a stable sort of the rows in input order), in batches of
    ``params.batch_rows`` as Arrow batches reach a Spark task.
    The sort reads only the order columns; the rows are taken as the batches are asked
    for, whole batches at a time (up to `TAKE_ROWS` rows, about `TAKE_BYTES`), so the
    input is never held twice."""
    if not len(rows):
        return
    names = row_order(params.job)
    indices = pa.array(rows)
    order = indices.take(nulls_first_order(table.select(list(names)).take(indices), names))
    batch_rows = params.batch_rows
    row_bytes = max(1, table.nbytes // max(1, table.num_rows))
    step = batch_rows * max(1, min(TAKE_ROWS, TAKE_BYTES // row_bytes) // batch_rows)
    for start in range(0, len(order), step):
        rows_taken = table.take(order.slice(start, step)).combine_chunks()
        yield from rows_taken.to_batches(max_chunksize=batch_rows)
