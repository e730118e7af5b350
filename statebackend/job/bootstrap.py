"""Bootstrap a job's state from tables: a savepoint a new lineage starts from.

``bootstrap_state(job, storage, name, tables, parallelism=P)`` writes savepoint
``name`` of the job (``<job>/savepoints/<name>``, the layout and record `ckpt savepoint`
writes, `statebackend.lifecycle.savepoint`) from one table per state (Flink's State
Processor API bootstrap; Spark's ``initialState``), then a run ``--start-from``s it.
``ckpt run --initial-state STATE=PATH,...`` does the same on a lineage's first run,
straight into its first checkpoint (`initial_state`); ``ckpt bootstrap`` is the command.

A table is an Arrow table, a Parquet folder (a path or URL, read with pyarrow over
fsspec with the storage's options) or a Spark DataFrame; ``_timers`` names the timers'
table. The contract of each table and its checks: `statebackend.job.bootstrap_tables`.

1. check every table's schema against the job (one-line UsageError naming the state
   and the column) before anything is read or written;
2. route: a row's key group is the new lineage's key hash (`defaults.KEY_HASH`) of its
   UTF-8 key mod M, its subtask ``kg * P // M``, the rule of every later run
   (`statebackend.state.keygroups`);
3. Arrow and Parquet tables are encoded here, in threads, and checked row by row (a
   null key, a value its field cannot hold) before the savepoint's name is claimed;
   then every subtask writes sorted SSTs, ingests them into a new instance, snapshots
   and uploads (`statebackend.job.bootstrap_write`), in this process's threads
   (`statebackend.subtasks.run_in_threads`). Spark DataFrames are encoded by Spark
   tasks (``mapInArrow``), shuffled by subtask and written by one Spark task per
   subtask (`statebackend.job.bootstrap_spark`): the driver collects P result rows,
   never the data;
4. commit: every file checked (size; each upload was read back against its checksum),
   then ``_metadata`` written last and exclusively; on any failure the savepoint's
   folder is removed and nothing is listed.

The record holds the job's states at schema version 1 (what a new lineage's first run
records), the job's key column (``extra.key``: a later job with another key is refused),
and ``source.bootstrap``: the entries written per column family.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa

from statebackend.checkpoint.attempt import Attempt
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.defaults import MAX_PARALLELISM as DEFAULT_MAX_PARALLELISM
from statebackend.errors import TaskFailedError, UsageError
from statebackend.job.api import Job
from statebackend.job.arrow_input import open_input_file
from statebackend.job.bootstrap_tables import EntryChunk, TablePlan, encode_batch, plan_table
from statebackend.job.bootstrap_write import (
    BootstrapTask,
    Destination,
    SubtaskWritten,
    write_subtask,
)
from statebackend.job.config import RunConfig
from statebackend.job.input import list_input
from statebackend.job.plan import new_lineage_plan, warn
from statebackend.lifecycle.registry import check_savepoint_name
from statebackend.lifecycle.savepoint import claimed_savepoint, commit_savepoint
from statebackend.state.keygroups import check_parallelism
from statebackend.storage import Storage, open_storage
from statebackend.subtasks import run_in_threads

ENCODE_ROWS = 250_000  # rows encoded at a time (one thread each)


@dataclass(frozen=True)
class Origin:
    """What a savepoint's record says of where its state came from besides the tables:
    ``source`` (kept under the record's ``source``, e.g. ``{"transform": {...}}``) and
    the clocks the new lineage continues from (watermark, processing time)."""

    source: Mapping[str, Any] = field(default_factory=dict)
    watermark: int | None = None
    processing_time: int | None = None


@dataclass(frozen=True)
class _Table:
    """One table to bootstrap: its plan and its rows (an Arrow table, Parquet files or
    a Spark DataFrame)."""

    plan: TablePlan
    rows: Any
    source: str  # "arrow", "parquet" or "spark"


def bootstrap_state(job: Job, storage: str | Storage | CheckpointStore, name: str,
                    tables: Mapping[str, Any], *, parallelism: int,
                    max_parallelism: int = DEFAULT_MAX_PARALLELISM) -> dict[str, Any]:
    """Write savepoint ``name`` of ``job`` from ``tables`` (state name -> table; module
    doc) with ``parallelism`` subtasks; returns its summary (`ckpt savepoint --json`'s
    fields plus ``entries`` per column family and ``timings``).

    ``storage``: a storage root (URL or `Storage`; the job's folder is ``job.name``) or
    a `CheckpointStore` (a job folder of its own choice).
    """
    check_savepoint_name(name)
    store = job_store(job, storage)
    task = bootstrap_task(job, store, parallelism, max_parallelism,
                          Destination(savepoint=name))
    return write_tables(task, store, tables, {"bootstrap": sorted(tables)}, Origin())


def write_tables(task: BootstrapTask, store: CheckpointStore, tables: Mapping[str, Any],
                 claim: Mapping[str, Any], origin: Origin) -> dict[str, Any]:
    """The savepoint of ``task``'s destination written from ``tables`` (module doc);
    its summary with ``timings``."""
    started = time.perf_counter()
    name = task.destination.savepoint
    assert name is not None, "a bootstrap from tables writes a savepoint"
    inputs, timings = _inputs(task.job, store, tables)
    chunks = _encode_local(task, inputs, timings)
    summary, results = write_savepoint(task, store, name, lambda: _write(task, inputs, chunks),
                                       claim, origin)
    return dict(summary, timings=_timings(timings, results, started))


def job_store(job: Job, storage: str | Storage | CheckpointStore) -> CheckpointStore:
    """``storage`` as the job's store: a root (URL or `Storage`: the folder ``job.name``)
    or a `CheckpointStore` as it is."""
    if isinstance(storage, CheckpointStore):
        return storage
    return CheckpointStore(open_storage(storage) if isinstance(storage, str) else storage,
                           job.name)


def write_savepoint(task: BootstrapTask, store: CheckpointStore, name: str,
                    write: Callable[[], Sequence[SubtaskWritten]], claim: Mapping[str, Any],
                    origin: Origin = Origin()
                    ) -> tuple[dict[str, Any], Sequence[SubtaskWritten]]:
    """Savepoint ``name`` written by ``write`` (every subtask's files) under a claim of
    its name, checked and committed (module doc, step 4); (its summary, the results)."""
    with claimed_savepoint(store, name, claim) as base:
        results = write()
        meta = _record(task, store, results, name, origin)
        store.verify_files(meta)  # sizes; each upload was read back against its checksum
        commit_savepoint(store, name, meta)
    kept = {f.path for f in meta.files}
    store.storage.delete_many(  # files of losing task attempts
        f.path for f in store.storage.walk_files(base)
        if f.path not in kept and "/" in f.path[len(base) + 1:])
    path = f"{store.job}/{base}"
    return dict(meta.summary(), savepoint=name, path=path, start_from=path,
                url=f"{store.root_storage.url}/{path}",
                entries=meta.source["bootstrap"]["entries"] if meta.source else {}), results


def initial_state(job: Job, config: RunConfig, store: CheckpointStore,
                  latest: CheckpointMetadata | None, warnings: list[str]
                  ) -> CheckpointMetadata | None:
    """A run's parent under ``--initial-state``: on a lineage's first run, its first
    checkpoint bootstrapped from the tables (committed through an `Attempt` under the
    run's writer lease); later runs keep their lineage (a warning says so)."""
    check_initial_state(config)
    if latest is not None:
        warn(warnings, f"--initial-state ignored: job {store.job!r} already has checkpoint "
                       f"{latest.checkpoint_id}")
        return latest
    if config.parallelism is None:
        raise UsageError("--initial-state needs --parallelism: the new lineage's subtasks")
    tables = parse_tables(config.initial_state or "")
    attempt = Attempt(store, 1)
    task = bootstrap_task(job, store, config.parallelism, config.max_parallelism,
                          Destination(checkpoint_id=1, attempt_token=attempt.token))
    inputs, timings = _inputs(job, store, tables)
    chunks = _encode_local(task, inputs, timings)
    try:
        results = _write(task, inputs, chunks)
        attempt.add_uploaded(p for r in results for p in r.uploaded)
        meta = _record(task, store, results, None, Origin())
    except BaseException:
        attempt.discard()
        raise
    return attempt.commit(meta, winners=[(r.subtask, r.attempt) for r in results])


def check_initial_state(config: RunConfig) -> None:
    """A run's ``--initial-state``, checked before any work: its syntax, and not with
    ``--start-from``."""
    if config.initial_state is None:
        return
    if config.start_from:
        raise UsageError("--initial-state and --start-from both seed a new lineage; give "
                         "one of them")
    parse_tables(config.initial_state)


def parse_tables(spec: str) -> dict[str, str]:
    """``STATE=PATH[,STATE=PATH...]`` as {state: path}; UsageError naming a bad part."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        state, sep, path = part.partition("=")
        if not sep or not state.strip() or not path.strip():
            raise UsageError(f"--initial-state part {part!r} is not STATE=PATH (a Parquet "
                             "folder per state, e.g. totals=s3://bucket/totals/; for a "
                             "savepoint use --start-from)")
        if state.strip() in out:
            raise UsageError(f"--initial-state names state {state.strip()!r} twice")
        out[state.strip()] = path.strip()
    return out


# -- steps -----------------------------------------------------------------------------

def bootstrap_task(job: Job, store: CheckpointStore, parallelism: int, max_parallelism: int,
                   destination: Destination) -> BootstrapTask:
    """What every subtask of a write of ``job``'s state into ``store`` needs."""
    check_parallelism(parallelism, max_parallelism)
    root = store.root_storage
    return BootstrapTask(job, root.url, store.job, parallelism, max_parallelism, destination,
                         root.options)


def _inputs(job: Job, store: CheckpointStore, tables: Mapping[str, Any]
            ) -> tuple[list[_Table], dict[str, float]]:
    """Every table checked against the job (schemas only), Parquet folders read."""
    if not tables:
        raise UsageError(f"bootstrap of job {job.name!r}: give at least one table (state "
                         "name -> table)")
    t = time.perf_counter()
    out = [_table(job, state, rows, store.root_storage) for state, rows in
           sorted(tables.items())]
    if len({x.source == "spark" for x in out}) > 1:
        raise UsageError("bootstrap: give every table as a Spark DataFrame, or none (Arrow "
                         "tables and Parquet folders go together)")
    return out, {"read": time.perf_counter() - t}


def _table(job: Job, state: str, rows: Any, root: Storage) -> _Table:
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    if isinstance(rows, pa.Table):
        return _Table(plan_table(job, state, rows.schema), rows, "arrow")
    if isinstance(rows, str | os.PathLike):
        return _parquet_table(job, state, os.fspath(rows), root)
    if hasattr(rows, "mapInArrow") and type(rows).__module__.startswith("pyspark."):
        from statebackend.job.bootstrap_spark import arrow_schema  # Spark only with a DataFrame

        return _Table(plan_table(job, state, arrow_schema(rows)), rows, "spark")
    raise UsageError(f"bootstrap table of state {state!r} is a {type(rows).__name__}; give "
                     "a pyarrow Table, a Parquet folder (path or URL) or a Spark DataFrame")


def _parquet_table(job: Job, state: str, folder: str, root: Storage) -> _Table:
    """A Parquet folder's files, each file's schema checked, then read (its plan's
    columns only)."""
    import pyarrow.parquet as pq

    try:
        files = list_input(folder, root.options)
    except UsageError as exc:  # e.g. no such folder
        raise UsageError(f"bootstrap table of state {state!r}: {exc}") from None
    if files.json or not files.parquet:
        raise UsageError(f"bootstrap table of state {state!r}: {folder} holds "
                         f"{'JSON-lines files' if files.json else 'no Parquet file'}; give a "
                         "folder of Parquet files")
    plan: TablePlan | None = None
    for path in files.parquet:
        with open_input_file(path, files.options) as fh:
            schema = pq.read_schema(fh)
        try:
            plan = plan_table(job, state, schema)
        except UsageError as exc:
            raise UsageError(f"{exc} (file {path})") from None
    if plan is None:
        raise UsageError(f"bootstrap table of state {state!r}: {folder} has no file")
    parts = []
    for path in files.parquet:
        with open_input_file(path, files.options) as fh:
            parts.append(pq.ParquetFile(fh).read(columns=list(plan.columns)))
    return _Table(plan, pa.concat_tables(parts, promote_options="permissive"), "parquet")


def _encode_local(task: BootstrapTask, inputs: Sequence[_Table], timings: dict[str, float]
                  ) -> list[list[EntryChunk]] | None:
    """Arrow and Parquet tables as entries per subtask, encoded in threads (every row
    checked before anything is written); None for Spark DataFrames (their tasks encode)."""
    if any(x.source == "spark" for x in inputs):
        return None
    started, cpu = time.perf_counter(), []
    p, m = task.parallelism, task.max_parallelism
    slices = [(x.plan, x.rows.slice(s, ENCODE_ROWS), s) for x in inputs
              for s in range(0, x.rows.num_rows, ENCODE_ROWS)]

    def encode(item: tuple[TablePlan, pa.Table, int]) -> list[list[EntryChunk]]:
        t = time.thread_time()
        plan, part, start = item
        routed: list[list[EntryChunk]] = [[] for _ in range(p)]
        for chunk in encode_batch(plan, part, m, np.arange(start, start + part.num_rows),
                                  task.key_hash):
            subtask = chunk.key_groups * p // m
            order = np.argsort(subtask.astype(np.uint16), kind="stable")  # a radix sort
            bounds = np.searchsorted(subtask[order], np.arange(p + 1))
            for i in range(p):
                if bounds[i + 1] > bounds[i]:
                    routed[i].append(chunk.take(order[bounds[i]:bounds[i + 1]]))
        cpu.append(time.thread_time() - t)
        return routed

    with ThreadPoolExecutor(max_workers=_workers(len(slices))) as pool:
        parts = list(pool.map(encode, slices))
    timings["encode"] = time.perf_counter() - started
    timings["encode_cpu"] = sum(cpu)
    return [[c for part in parts for c in part[i]] for i in range(p)]


def _write(task: BootstrapTask, inputs: Sequence[_Table],
           chunks: list[list[EntryChunk]] | None) -> list[SubtaskWritten]:
    """Every subtask's entries written and uploaded (module doc, step 3)."""
    if chunks is not None:
        try:
            return run_in_threads(task.parallelism,
                                  lambda i: write_subtask(task, i, 0, chunks[i]),
                                  workers=_workers(task.parallelism))
        except TaskFailedError as exc:
            if isinstance(exc.__cause__, UsageError):  # a bad table (a duplicate key)
                raise UsageError(str(exc.__cause__)) from exc
            raise
    from statebackend.job.bootstrap_spark import write_with_spark  # Spark only for DataFrames

    return write_with_spark(task, [(x.plan, x.rows) for x in inputs])


def _workers(count: int) -> int:
    return max(1, min(count, os.cpu_count() or 1))


def _record(task: BootstrapTask, store: CheckpointStore, results: Sequence[SubtaskWritten],
            savepoint: str | None, origin: Origin) -> CheckpointMetadata:
    """The record of the bootstrapped state: a savepoint's, or a lineage's first
    checkpoint's (module doc)."""
    entries: dict[str, int] = {}
    for r in results:
        for family, n in r.entries.items():
            entries[family] = entries.get(family, 0) + n
    extra: dict[str, Any] = {"key": task.job.key}
    if savepoint is not None:
        extra["savepoint"] = savepoint
    meta = build_metadata(MetadataParts(
        job=store.job, checkpoint_id=1, parent=None, max_parallelism=task.max_parallelism,
        states=new_lineage_plan(task.job).states, handles=[r.handle for r in results],
        kind="checkpoint" if savepoint is None else "savepoint",
        source={"job": None, "checkpoint": None, "savepoint": None, **origin.source,
                "bootstrap": {"entries": dict(sorted(entries.items()))}},
        extra=extra, key_hash=task.key_hash))
    return replace(meta, watermark=origin.watermark, processing_time=origin.processing_time)


def _timings(timings: dict[str, float], results: Sequence[SubtaskWritten],
             started: float) -> dict[str, float]:
    out = dict(timings)
    for key in ("write", "write_cpu", "upload"):
        out[key] = sum(r.timings.get(key, 0.0) for r in results)
    out["total"] = time.perf_counter() - started
    return {k: round(v, 4) for k, v in out.items()}
