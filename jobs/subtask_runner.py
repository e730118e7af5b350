"""Executor side of the keyed aggregation job: one Spark task = one subtask.

Two functions run inside Spark tasks (``mapInArrow``):

- `assign_partition`: adds ``_p``, a shuffle value chosen so that Spark's hash
  partitioning sends every row of subtask i to partition i (see `partition_values`);
- `run_subtask`: partition i restores subtask i's state from the parent handle
  (local recovery when this executor still has it), folds each Arrow batch into
  the ``totals`` value state (pre-aggregated per key, then one multi-get and one
  write batch), writes the touched keys' new totals and the quarantined rows,
  snapshots incrementally and returns one result row with the new handle as JSON.

A subtask that received no accepted row returns no handle (the driver carries the
parent's handle forward) unless the lineage has no parent yet, in which case it
checkpoints an empty instance. Every task sees exactly one synthetic marker row
so that it runs even without data. What an attempt uploaded is recorded in
``chk-<id>/_attempts/`` before the task returns, so the driver can remove it if
the run fails; a task that fails removes its own uploads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import mmh3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rocksdict import WriteBatch

from jobs.quarantine import MARKER
from statebackend.backend import KeyedStateBackend
from statebackend.keygroups import key_group_range_for_subtask
from statebackend.metadata import SubtaskHandle
from statebackend.restore import restore_subtask
from statebackend.snapshot import snapshot
from statebackend.state import StateDescriptor
from statebackend.storage import Storage, child_storage, open_storage

SPARK_HASH_SEED = 42
ATTEMPTS_DIR = "_attempts"
RESULT_DDL = ("subtask int, attempt int, handle string, uploaded string, events long, "
              "rejected long, reasons string, keys_touched long, restore_mode string, "
              "reuploaded string, "
              "bytes_uploaded long, t_restoring double, t_processing double, "
              "t_snapshotting double, t_uploading double")
OUTPUT_SCHEMA = pa.schema([("key", pa.string()), ("count", pa.int64()), ("sum", pa.float64()),
                           ("min_ts", pa.int64()), ("max_ts", pa.int64()),
                           ("run_id", pa.string()), ("checkpoint_id", pa.int64())])
QUARANTINE_SCHEMA = pa.schema([("key", pa.string()), ("ts", pa.string()),
                               ("value", pa.string()), ("reason", pa.string()),
                               ("run_id", pa.string()), ("raw", pa.string())])


def output_part_name(subtask: int) -> str:
    """Name of subtask ``subtask``'s output (and quarantine) part in a run folder."""
    return f"part-{subtask:05d}.parquet"


def spark_partition_of_int(value: int, num_partitions: int) -> int:
    """Spark's HashPartitioning of an IntegerType column: pmod(murmur3(value, 42), n)."""
    return mmh3.hash(struct.pack("<i", value), SPARK_HASH_SEED, signed=True) % num_partitions


def partition_values(parallelism: int) -> list[int]:
    """For each subtask i, the smallest int that Spark's hash partitioner sends to partition i."""
    values: list[int | None] = [None] * parallelism
    missing, v = parallelism, 0
    while missing:
        p = spark_partition_of_int(v, parallelism)
        if values[p] is None:
            values[p] = v
            missing -= 1
        v += 1
    return [int(x) for x in values]  # type: ignore[arg-type]


@dataclass(frozen=True)
class TaskParams:
    """Everything a task needs; shipped to executors with the function (no secrets)."""

    storage_url: str
    job: str
    checkpoint_id: int
    parallelism: int
    max_parallelism: int
    parent_handles: tuple[str, ...]  # JSON per subtask; empty on the first run
    descriptors: tuple[StateDescriptor, ...]
    state_name: str
    output_url: str
    quarantine_url: str
    run_dir: str  # folder name of this run under output and quarantine
    run_id: str
    part_values: tuple[int, ...]
    local_dir: str | None = None
    fail_subtask: int | None = None


def assign_partition(params: TaskParams, batches: Iterator[pa.RecordBatch]
                     ) -> Iterator[pa.RecordBatch]:
    """Add ``_p`` (int32): the shuffle value of each row's subtask; bad rows go to 0."""
    m, p = params.max_parallelism, params.parallelism
    values = np.asarray(params.part_values, dtype=np.int32)
    hash32 = mmh3.hash
    for batch in batches:
        keys = batch.column("key").to_pylist()
        kgs = np.fromiter((hash32(k.encode("utf-8"), 0, False) % m if k else 0 for k in keys),
                          dtype=np.int64, count=len(keys))
        subtasks = kgs * p // m
        yield batch.append_column("_p", pa.array(values[subtasks], pa.int32()))


def local_instance_dir(params: TaskParams, subtask: int) -> str:
    """Per (storage, job, subtask) folder on this executor for local recovery."""
    root = params.local_dir or os.environ.get("CKPT_LOCAL_DIR") or os.path.join(
        tempfile.gettempdir(), "ckpt-local")
    tag = hashlib.sha1(params.storage_url.encode()).hexdigest()[:10]
    return os.path.join(root, f"{params.job}-{tag}", str(subtask))


def run_subtask(params: TaskParams, batches: Iterator[pa.RecordBatch]
                ) -> Iterator[pa.RecordBatch]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    subtask, attempt = ctx.partitionId(), ctx.attemptNumber()
    runner = _SubtaskRun(params, subtask, attempt)
    try:
        result = runner.run(batches)
    except BaseException:
        runner.discard()
        raise
    finally:
        runner.close()
    yield pa.RecordBatch.from_pylist([result], schema=_result_schema())


def _result_schema() -> pa.Schema:
    return pa.schema([("subtask", pa.int32()), ("attempt", pa.int32()),
                      ("handle", pa.string()), ("uploaded", pa.string()),
                      ("events", pa.int64()), ("rejected", pa.int64()),
                      ("reasons", pa.string()), ("keys_touched", pa.int64()),
                      ("restore_mode", pa.string()), ("reuploaded", pa.string()),
                      ("bytes_uploaded", pa.int64()),
                      ("t_restoring", pa.float64()), ("t_processing", pa.float64()),
                      ("t_snapshotting", pa.float64()), ("t_uploading", pa.float64())])


class _SubtaskRun:
    def __init__(self, params: TaskParams, subtask: int, attempt: int) -> None:
        self.params = params
        self.subtask = subtask
        self.attempt = attempt
        self.job_storage: Storage = child_storage(open_storage(params.storage_url), params.job)
        self.parent = (SubtaskHandle.from_json(json.loads(params.parent_handles[subtask]),
                                               f"parent handle {subtask}")
                       if params.parent_handles else None)
        self.backend: KeyedStateBackend | None = None
        self.uploaded: tuple[str, ...] = ()
        self.t = dict.fromkeys(("restoring", "processing", "snapshotting", "uploading"), 0.0)
        self.restore_mode = "none"
        self.reuploaded: tuple[str, ...] = ()

    # -- phases ------------------------------------------------------------
    def open_state(self) -> KeyedStateBackend:
        started = time.perf_counter()
        p = self.params
        local_dir = local_instance_dir(p, self.subtask)
        if self.parent is not None:
            self.backend = restore_subtask(self.job_storage, self.parent, local_dir,
                                           p.descriptors, p.max_parallelism)
            self.restore_mode = self.backend.restore_mode
            # Stored files local recovery found damaged: this checkpoint uploads them anew.
            self.reuploaded = self.backend.reuploaded
        else:
            # First checkpoint of the lineage: whatever is on disk belongs to no checkpoint.
            shutil.rmtree(local_dir, ignore_errors=True)
            kg = key_group_range_for_subtask(p.max_parallelism, p.parallelism, self.subtask)
            self.backend = KeyedStateBackend(local_dir, p.descriptors, p.max_parallelism, kg)
            self.restore_mode = "new"
        _tune(self.backend)
        self.t["restoring"] += time.perf_counter() - started
        return self.backend

    def run(self, batches: Iterator[pa.RecordBatch]) -> dict:
        p = self.params
        expected_p = p.part_values[self.subtask]
        events = rejected = 0
        reasons: dict[str, int] = {}
        bad_parts: list[pa.RecordBatch] = []
        touched: list[tuple[list, dict]] = []
        state = None
        for batch in batches:
            if len(batch) and not pc.all(pc.equal(batch.column("_p"), expected_p)).as_py():
                raise RuntimeError(
                    f"partition {self.subtask} received rows of another subtask: Spark's hash "
                    "partitioning no longer matches jobs.subtask_runner.partition_values")
            reason = batch.column("reason")
            good_mask = pc.is_null(reason)
            bad_mask = pc.and_(pc.invert(good_mask), pc.not_equal(reason, MARKER))
            bad = batch.filter(pc.fill_null(bad_mask, False))
            if len(bad):
                rejected += len(bad)
                for r, n in zip(*_value_counts(bad.column("reason")), strict=True):
                    reasons[r] = reasons.get(r, 0) + n
                bad_parts.append(bad)
            good = batch.filter(good_mask)
            if not len(good):
                continue
            events += len(good)
            if state is None:
                state = self.open_state().value_state(p.state_name)
            started = time.perf_counter()
            touched.append(_fold_batch(state, good))
            self.t["processing"] += time.perf_counter() - started
        if bad_parts:
            self._write_quarantine(bad_parts)
        if self.backend is None and self.parent is not None:
            # No new rows: the parent's handle is carried forward unchanged.
            return self._result(None, events, rejected, reasons, 0)
        if self.backend is None:
            self.open_state()
        return self._checkpoint(touched, events, rejected, reasons)

    def _checkpoint(self, touched, events, rejected, reasons) -> dict:
        p = self.params
        started = time.perf_counter()
        pending = snapshot(self.backend, self.job_storage, checkpoint_id=p.checkpoint_id,
                           subtask=self.subtask)
        self.t["snapshotting"] += time.perf_counter() - started
        started = time.perf_counter()
        # The upload runs in the background while the output is written.
        keys_touched = self._write_output(touched)
        self.t["processing"] += time.perf_counter() - started
        started = time.perf_counter()
        result = pending.result()
        self.uploaded = result.uploaded_paths
        self.t["uploading"] += time.perf_counter() - started
        record = {"subtask": self.subtask, "attempt": self.attempt,
                  "uploaded": list(self.uploaded)}
        self.job_storage.write_bytes(
            f"chk-{p.checkpoint_id}/{ATTEMPTS_DIR}/{self.subtask}-{self.attempt}-"
            f"{uuid.uuid4().hex[:8]}.json", json.dumps(record).encode())
        if p.fail_subtask == self.subtask:
            raise RuntimeError(f"injected failure in subtask {self.subtask} "
                               "(JobConfig.fail_subtask)")
        return self._result(result.handle, events, rejected, reasons, keys_touched)

    def _result(self, handle: SubtaskHandle | None, events: int, rejected: int,
                reasons: dict, keys_touched: int) -> dict:
        return {
            "subtask": self.subtask, "attempt": self.attempt,
            "handle": json.dumps(handle.to_json()) if handle is not None else None,
            "uploaded": json.dumps(list(self.uploaded)), "events": events,
            "rejected": rejected, "reasons": json.dumps(reasons, sort_keys=True),
            "keys_touched": keys_touched, "restore_mode": self.restore_mode,
            "reuploaded": json.dumps(list(self.reuploaded)),
            "bytes_uploaded": handle.bytes_uploaded if handle is not None else 0,
            **{f"t_{k}": v for k, v in self.t.items()},
        }

    # -- outputs -----------------------------------------------------------
    def _write_output(self, touched: list[tuple[list, dict]]) -> int:
        if not touched:
            return 0
        keys = [k for ks, _ in touched for k in ks]
        cols = {name: np.concatenate([c[name] for _, c in touched])
                for name in ("count", "sum", "min_ts", "max_ts")}
        if len(touched) > 1:
            # A key folded in several batches: its last totals are the run's result.
            rev_keys = keys[::-1]
            _, first = np.unique(np.asarray(rev_keys, dtype=object), return_index=True)
            idx = np.sort(len(keys) - 1 - first)
            keys = [keys[i] for i in idx]
            cols = {name: c[idx] for name, c in cols.items()}
        n = len(keys)
        table = pa.table({
            "key": pa.array(keys, pa.string()),
            "count": pa.array(cols["count"], pa.int64()),
            "sum": pa.array(cols["sum"], pa.float64()),
            "min_ts": pa.array(cols["min_ts"], pa.int64()),
            "max_ts": pa.array(cols["max_ts"], pa.int64()),
            "run_id": pa.array([self.params.run_id] * n, pa.string()),
            "checkpoint_id": pa.array([self.params.checkpoint_id] * n, pa.int64()),
        }, schema=OUTPUT_SCHEMA)
        write_parquet(self.params.output_url,
                      f"{self.params.run_dir}/{output_part_name(self.subtask)}", table)
        return n

    def _write_quarantine(self, parts: list[pa.RecordBatch]) -> None:
        t = pa.Table.from_batches(parts)
        n = len(t)
        table = pa.table({
            "key": t.column("key"), "ts": t.column("ts_raw"), "value": t.column("value_raw"),
            "reason": t.column("reason"),
            "run_id": pa.array([self.params.run_id] * n, pa.string()),
            "raw": t.column("raw"),  # the whole input line (JSON input only)
        }, schema=QUARANTINE_SCHEMA)
        write_parquet(self.params.quarantine_url,
                      f"{self.params.run_dir}/{output_part_name(self.subtask)}", table)

    # -- cleanup -----------------------------------------------------------
    def discard(self) -> None:
        if self.uploaded:
            self.job_storage.delete_many(self.uploaded)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None


def _tune(backend: KeyedStateBackend) -> None:
    # Totals are small fixed-width records: ZSTD makes new SSTs (the bytes every
    # checkpoint uploads) about 20% smaller than the default Snappy. A mutable option,
    # so restored instances switch too; RocksDB reads blocks of any compression.
    for name in backend.column_families:
        backend.column_family(name).set_options({"compression": "kZSTD"})


def _fold_batch(state, good: pa.RecordBatch) -> tuple[list, dict]:
    """Pre-aggregate one batch per key, then one multi-get and one write batch.

    The columnar get_columns/put_columns steps, with the RocksDB keys computed once
    for both (key-group hashing is the costliest Python loop of a batch).
    """
    g = pa.Table.from_batches([good]).group_by("key", use_threads=False).aggregate(
        [("ts", "count"), ("value", "sum"), ("ts", "min"), ("ts", "max")])
    keys = g.column("key").to_pylist()
    backend, codec = state.backend, state.codec
    rkeys = backend.rocks_keys(keys)
    found, old = codec.decode_columns(state.cf.get(rkeys))
    cnt = g.column("ts_count").to_numpy()
    total = g.column("value_sum").to_numpy()
    lo = g.column("ts_min").to_numpy()
    hi = g.column("ts_max").to_numpy()
    new = {
        "count": old["count"] + cnt,
        "sum": old["sum"] + total,
        "min_ts": np.where(found, np.minimum(old["min_ts"], lo), lo),
        "max_ts": np.where(found, np.maximum(old["max_ts"], hi), hi),
    }
    wb = WriteBatch(raw_mode=True)
    wb.set_default_column_family(backend.column_family_handle(state.descriptor.name))
    for k, v in zip(rkeys, codec.encode_columns(new), strict=True):
        wb.put(k, v)
    backend.write(wb)
    return keys, new


def _value_counts(arr: pa.Array) -> tuple[list, list]:
    vc = pc.value_counts(arr)
    return vc.field("values").to_pylist(), vc.field("counts").to_pylist()


def write_parquet(root_url: str, rel: str, table: pa.Table) -> None:
    """Write ``table`` to ``<root_url>/<rel>`` (local path, file:// or s3://)."""
    import pyarrow.parquet as pq

    storage = open_storage(root_url)
    path = storage.abspath(rel)
    if storage.protocol == "file":
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with storage.fs.open(path, "wb") as fh:
        pq.write_table(table, fh)
