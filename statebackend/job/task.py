"""One subtask of a job run, on either engine: restore, process, write, snapshot.

`run_one_subtask` runs subtask i over its rows (Arrow batches of the read columns,
`statebackend.job.arrow_input.read_schema`, already in `row_order`: one key's rows
are consecutive), in a Spark task (`statebackend.job.spark_engine`) or a thread of
the local engine (`statebackend.job.local_engine`):

1. restore subtask i's state from the parent handle (local recovery when this
   executor still has the instance), lazily: a subtask without rows never opens it;
2. feed every batch to a `SubtaskProcessor` (validation, late rows against the
   watermark at the start of the run, the job's logic), then fire the due timers
   (event: up to the driver's new watermark; processing: up to the logical time)
   and purge expired TTL entries;
3. snapshot (synchronous part), then write the outputs and the quarantined rows
   while the upload runs in the background;
4. record what this task attempt uploaded (`statebackend.checkpoint.attempt.record_uploads`)
   and return its `TaskResult`: the new handle, counts, timings.

A subtask that accepted no row returns no handle (the driver carries the parent's
handle forward) unless the lineage has no parent yet (then it checkpoints an
empty instance) or a timer fired or an entry expired in it (``must_run``: the
driver saw one due in the parent's record). A task that fails removes its own
uploads before re-raising.

Outputs: ``<output>/run=<id>/part-<subtask>.parquet`` for a job with one output,
``<output>/<name>/run=<id>/...`` with several; quarantine
``<quarantine>/run=<id>/part-<subtask>.parquet`` with the input columns as text,
``reason``, ``run_id`` and ``raw`` (the input line, JSON input only).
"""

from __future__ import annotations

import shutil
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pyarrow as pa
import pyarrow.compute as pc

from statebackend.checkpoint.attempt import record_uploads
from statebackend.checkpoint.local_copy import instance_dir
from statebackend.checkpoint.metadata import SubtaskHandle
from statebackend.checkpoint.restore import RestoreOptions, restore_subtask
from statebackend.checkpoint.snapshot import snapshot
from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.job.arrow_input import LINE, raw_table
from statebackend.job.core import REASON, ProcessResult, SubtaskProcessor
from statebackend.job.external_commit import Prepared
from statebackend.job.results import PHASES, TaskResult
from statebackend.python_gc import fewer_collections
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.backend_kinds import new_backend
from statebackend.state.external import ExternalStateBackend
from statebackend.state.keygroups import MURMUR3, key_group_range_for_subtask
from statebackend.state.memory import MemoryStateBackend
from statebackend.state.migrate import migrate_backend
from statebackend.state.schema import EvolutionPlan
from statebackend.storage import Storage, StorageOptions, child_storage, open_storage

RAW = "raw"
BATCH_ROWS = 100_000  # rows per Arrow batch handed to the logic
DICTIONARY_SAMPLE = 4096  # leading rows whose distinct values choose a column's encoding
COMPRESSION = {"zstd": "kZSTD", "lz4": "kLZ4Compression", "snappy": "kSnappyCompression",
               "none": "kNoCompression"}


def part_name(subtask: int) -> str:
    """Name of subtask ``subtask``'s output (and quarantine) part in a run folder."""
    return f"part-{subtask:05d}.parquet"


def row_order(job: Job) -> tuple[str, ...]:
    """The order of a subtask's rows: key, then event time (one key's rows reach the logic
    in time order also across Arrow batches), then the rest (fixes float sums' order)."""
    inp = job.input
    leading = (inp.key, *([inp.event_time] if inp.event_time else []))
    return (*leading, *[n for n in inp.schema.names if n not in leading])


def nulls_first_order(table: pa.Table, names: tuple[str, ...]) -> pa.Array:
    """Indices sorting ``table`` by ``names`` (`row_order`) ascending, nulls first, as
    Spark's ``sortWithinPartitions`` does: the local engine's and `JobTester`'s order."""
    try:
        return pc.sort_indices(table, sort_keys=[(n, "ascending", "at_start") for n in names])
    except (TypeError, ValueError, pa.ArrowInvalid):  # pyarrow < 22: one placement for all
        return pc.sort_indices(table, sort_keys=[(n, "ascending") for n in names],
                               null_placement="at_start")


def output_folder(job: Job, output: str) -> str:
    """Folder of ``output`` under the output root: "" for a job with one output."""
    return "" if len(job.outputs) == 1 else output


@dataclass(frozen=True)
class TaskParams:
    """Everything a task needs; shipped to executors with the function (pickled, not logged).

    ``storage_options`` carry the storage credentials (never the environment); their
    repr, and so this object's, shows no secret value.
    """

    job: Job
    options: dict = field(hash=False)
    storage_url: str
    job_dir: str  # the job's folder under the storage root
    checkpoint_id: int
    parallelism: int
    max_parallelism: int
    parent_handles: tuple[SubtaskHandle, ...]  # per subtask; empty on the first run
    output_url: str | None
    quarantine_url: str
    run_dir: str  # folder name of this run under output and quarantine
    run_id: str
    local_dir: str | None = None
    batch_rows: int = BATCH_ROWS  # rows per Arrow batch a subtask receives
    fail_subtask: int | None = None
    storage_options: StorageOptions = field(default_factory=StorageOptions, hash=False)
    # Time (issue 12): the watermark at the start of the run and the one the driver
    # computed for its end, the run's logical time, and which subtasks must run even
    # without rows (a timer or an expiry of theirs is due).
    watermark: int | None = None
    new_watermark: int | None = None
    processing_time: int | None = None
    must_run: tuple[bool, ...] = ()
    # The driver's `Attempt.token`: this task's upload record names it, so a discard
    # takes only its own attempt's uploads (statebackend.checkpoint.attempt).
    attempt_token: str = ""
    # A state schema evolution to apply right after the restore (state/migrate.py).
    migration: EvolutionPlan | None = None
    key_hash: str = MURMUR3  # the lineage's (statebackend.state.keygroups)
    backend: str = "rocksdb"  # the run's state backend (statebackend.state.backend_kinds)
    memory_limit_mb: int | None = None  # the memory backend's limit per subtask
    # The external backend's run: its database (its repr names no credentials), the
    # version the subtasks restore and the epoch they write (job.external_commit).
    external: Prepared | None = None

    def open(self, url: str) -> Storage:
        return open_storage(url, **self.storage_options)


def local_instance_dir(params: TaskParams, subtask: int) -> str:
    """Per (storage, job, subtask) folder on this executor for local recovery."""
    return instance_dir(params.storage_url, params.job_dir, subtask, params.local_dir)


def run_one_subtask(params: TaskParams, subtask: int, attempt: int,
                    batches: Iterator[pa.RecordBatch]) -> TaskResult:
    """Attempt ``attempt`` of ``subtask`` over its rows (`read_schema` batches in
    `row_order`); on failure its uploads are removed and its instance closed before the
    exception goes on."""
    runner = SubtaskRun(params, subtask, attempt)
    started = time.time()  # wall clock: the driver places the task in the run's timeline
    try:
        with fewer_collections():
            result = runner.run(batches)
        return replace(result, window=(started, time.time()))
    except BaseException as exc:
        runner.discard()
        # The failed frames hold state handles, and RocksDB keeps the instance open (its
        # LOCK too) while any handle lives: the next attempt in this process (a reused
        # Python worker, the local engine's next run) could not open it.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        runner.close()


class SubtaskRun:
    """One attempt of one subtask: restore, process, write, snapshot."""

    def __init__(self, params: TaskParams, subtask: int, attempt: int) -> None:
        self.params = params
        self.job = params.job
        self.subtask = subtask
        self.attempt = attempt
        self.job_storage = child_storage(params.open(params.storage_url), params.job_dir)
        self.parent = params.parent_handles[subtask] if params.parent_handles else None
        self.backend: KeyedStateBackend | None = None
        self.processor: SubtaskProcessor | None = None
        self.uploaded: tuple[str, ...] = ()
        self.t = dict.fromkeys(PHASES, 0.0)
        self.restore_mode = "none"
        self.reuploaded: tuple[str, ...] = ()
        self.migrated: dict | None = None

    # -- phases ------------------------------------------------------------------------
    def open_state(self) -> SubtaskProcessor:
        started = time.perf_counter()
        p = self.params
        local_dir = local_instance_dir(p, self.subtask)
        if self.parent is not None:
            self.backend = restore_subtask(
                self.job_storage, self.parent, local_dir, self.job.descriptors,
                p.max_parallelism, RestoreOptions(backend=p.backend, external=(
                    p.external.restore_read(p.job_dir) if p.external else None)))
            self.restore_mode = self.backend.restore_mode
            # Stored files local recovery found damaged: this checkpoint uploads them anew.
            self.reuploaded = self.backend.reuploaded
        else:
            # First checkpoint of the lineage: whatever is on disk belongs to no checkpoint.
            shutil.rmtree(local_dir, ignore_errors=True)
            kg = key_group_range_for_subtask(p.max_parallelism, p.parallelism, self.subtask)
            self.backend = new_backend(p.backend, local_dir, self.job.descriptors,
                                       p.max_parallelism, kg)
            self.restore_mode = "new"
        self.backend.place_keys_by(p.key_hash)
        tune(self.backend, self.job.compression)
        if isinstance(self.backend, MemoryStateBackend):
            self.backend.set_memory_limit(p.memory_limit_mb)
        if isinstance(self.backend, ExternalStateBackend):
            if p.external is None:
                raise UsageError(f"subtask {self.subtask}: the external backend has no "
                                 "database (--state-db)")
            self.backend.attach(p.external.store, p.job_dir, epoch=p.external.epoch,
                                mode=p.external.mode)
        if p.migration is not None and self.parent is not None:
            clock = p.new_watermark if p.new_watermark is not None else p.watermark
            self.migrated = migrate_backend(
                self.backend, p.migration.migrations, p.migration.dropped,
                {"event": clock, "processing": p.processing_time}).to_json()
        self.processor = SubtaskProcessor(
            self.job, self.backend, p.options, run_id=p.run_id, checkpoint_id=p.checkpoint_id,
            subtask=self.subtask, watermark=p.watermark, new_watermark=p.new_watermark,
            processing_time=p.processing_time)
        self.t["restoring"] += time.perf_counter() - started
        return self.processor

    def run(self, batches: Iterator[pa.RecordBatch]) -> TaskResult:
        for batch in batches:
            if not len(batch):
                continue
            processor = self.processor or self.open_state()
            started = time.perf_counter()
            processor.process(raw_table(self.job.input, batch))
            self.t["processing"] += time.perf_counter() - started
        must_run = bool(self.params.must_run) and self.params.must_run[self.subtask]
        if self.processor is None and self.parent is not None and not must_run:
            # No rows and nothing due: the parent's handle is carried forward unchanged.
            return self._result(None, None, {})
        processor = self.processor or self.open_state()
        started = time.perf_counter()
        result = processor.finish()
        self.t["processing"] += time.perf_counter() - started
        started = time.perf_counter()
        self._write_quarantine(result.rejected)
        self.t["processing"] += time.perf_counter() - started
        if result.events == 0 and self.parent is not None and not result.timers_fired \
                and not result.ttl_index_read and self.migrated is None:
            return self._result(None, result, {})  # nothing changed the state: carry forward
        return self._checkpoint(result)

    def _checkpoint(self, result: ProcessResult) -> TaskResult:
        p = self.params
        if self.backend is None:
            raise RuntimeError(f"subtask {self.subtask}: checkpoint before its state opened")
        started = time.perf_counter()
        pending = snapshot(self.backend, self.job_storage, checkpoint_id=p.checkpoint_id,
                           subtask=self.subtask)
        self.t["snapshotting"] += time.perf_counter() - started
        started = time.perf_counter()
        written = self._write_outputs(result)  # while the upload runs in the background
        self.t["processing"] += time.perf_counter() - started
        started = time.perf_counter()
        done = pending.result()
        self.uploaded = done.uploaded_paths
        self.t["uploading"] += time.perf_counter() - started
        record_uploads(self.job_storage, p.checkpoint_id, self.subtask, self.attempt,
                       self.uploaded, p.attempt_token)
        if p.fail_subtask == self.subtask:
            raise RuntimeError(f"injected failure in subtask {self.subtask} "
                               "(RunConfig.fail_subtask)")
        return self._result(done.handle, result, written)

    def _result(self, handle: SubtaskHandle | None, result: ProcessResult | None,
                written: dict[str, int]) -> TaskResult:
        report = TaskResult(
            subtask=self.subtask, attempt=self.attempt, handle=handle,
            restore_mode=self.restore_mode, uploaded=self.uploaded,
            reuploaded=self.reuploaded, outputs=written, phases=dict(self.t))
        if result is None:
            return report
        return replace(
            report, events=result.events, rejected=result.rejected_count,
            reasons=result.reasons, keys_touched=result.keys_touched,
            logic_timings={k: round(v, 4) for k, v in result.timings.items()},
            timers_fired=result.timers_fired, ttl_purged=result.ttl_purged,
            counters=result.counters,
            # None: the state was not opened (the driver keeps the parent's record)
            next_times=result.next_times or None,
            memory_bytes=self.backend.memory_bytes
            if isinstance(self.backend, MemoryStateBackend) else None)

    # -- outputs -----------------------------------------------------------------------
    def _write_outputs(self, result: ProcessResult) -> dict[str, int]:
        """Write each non-empty output part; returns {output: rows written}."""
        p = self.params
        written: dict[str, int] = {}
        for name, table in result.outputs.items():
            if not table.num_rows:
                continue
            if p.output_url is None:  # the run refuses a job with outputs but no --output
                raise UsageError(f"job {self.job.name!r} wrote output {name!r} but the run "
                                 "has no --output")
            folder = output_folder(self.job, name)
            rel = "/".join(x for x in (folder, p.run_dir, part_name(self.subtask)) if x)
            write_parquet(p.open(p.output_url), rel, table)
            written[name] = table.num_rows
        return written

    def _write_quarantine(self, rejected: pa.Table) -> None:
        if not rejected.num_rows:
            return
        p = self.params
        names = [*self.job.input.schema.names, REASON]
        cols = {n: rejected[n] for n in names}
        cols["run_id"] = pa.array([p.run_id] * rejected.num_rows, pa.string())
        cols[RAW] = rejected[LINE] if LINE in rejected.column_names else \
            pa.nulls(rejected.num_rows, pa.string())
        table = pa.table(cols, schema=quarantine_schema(self.job))
        write_parquet(p.open(p.quarantine_url), f"{p.run_dir}/{part_name(self.subtask)}",
                      table)

    # -- cleanup -----------------------------------------------------------------------
    def discard(self) -> None:
        if self.uploaded:
            self.job_storage.delete_many(self.uploaded)

    def close(self) -> None:
        self.processor = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None


def quarantine_schema(job: Job) -> pa.Schema:
    """Input columns as text, ``reason``, ``run_id``, ``raw`` (the whole input line)."""
    names = [*job.input.schema.names, REASON, "run_id", RAW]
    return pa.schema([(n, pa.string()) for n in names])


def tune(backend: KeyedStateBackend, compression: str | None) -> None:
    """Apply the job's compression to every column family (a mutable option: restored
    instances switch too; RocksDB reads blocks of any compression)."""
    if compression is None:
        return
    if isinstance(backend, MemoryStateBackend):  # its key-group files' compression
        backend.compression = compression
        return
    for name in backend.column_families:
        backend.column_family(name).set_options({"compression": COMPRESSION[compression]})


def write_parquet(storage: Storage | str, rel: str, table: pa.Table) -> None:
    """Write ``table`` to ``<root>/<rel>``: a `Storage`, or a URL opened without options."""
    import pyarrow.parquet as pq

    if isinstance(storage, str):
        storage = open_storage(storage)
    with storage.open_write(rel) as fh:
        pq.write_table(table, fh, use_dictionary=dictionary_columns(table))


def dictionary_columns(table: pa.Table) -> list[str]:
    """The columns worth Parquet's dictionary encoding: at most half the values of their
    first `DICTIONARY_SAMPLE` rows distinct (a column whose type has no distinct count
    keeps it). Dictionary-encoding a column of unique values (keys, sums, timestamps)
    costs the writer 2-3x its time and makes the file larger (measured on a subtask's
    62,500 output rows: 17 ms against 5 ms)."""
    n = min(DICTIONARY_SAMPLE, table.num_rows)
    chosen = []
    for name in table.column_names:
        try:
            distinct = pc.count_distinct(table[name].slice(0, n)).as_py()
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
            distinct = 0
        if distinct * 2 <= n:
            chosen.append(name)
    return chosen
