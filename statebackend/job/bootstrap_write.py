"""One subtask of a bootstrap: its entries as sorted SST files, ingested, snapshotted,
uploaded (the bulk load of `statebackend.job.bootstrap`).

`write_subtask` gets subtask i's entries (`statebackend.job.bootstrap_tables.EntryChunk`,
already routed by key group) in this process's threads or in a Spark task, and:

1. per column family, sorts them by RocksDB key (stable: a list key's elements keep
   their row order) and merges them by `merge_rule` (a duplicate key of a value-like or
   map state is refused in one line naming the state and the key);
2. writes one SST file per family with RocksDB's ``SstFileWriter`` (the job's block
   compression) and ingests them into a new instance of the job's states
   (``ingest_external_file`` with move: no put per key, no memtable, no WAL), as
   rescale imports key groups (`statebackend.rescale.task`);
3. takes the snapshot's synchronous part and uploads it (`Destination`): to the
   savepoint's folder, ``savepoints/<name>/<i>/<snapshot>-<file>``, each file read back
   and checked against the checksum taken while sending it; or, for a lineage's first
   checkpoint, as a checkpoint's subtask (`statebackend.checkpoint.snapshot.upload_snapshot`,
   then its attempt record), so the driver's `Attempt` commits or discards it.

A failure removes what this attempt uploaded and goes on as the exception; the driver
commits nothing. The instance lives in a scratch folder removed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rocksdict import DBCompressionType

from statebackend import defaults
from statebackend.checkpoint.attempt import record_uploads
from statebackend.checkpoint.dump import split_body
from statebackend.checkpoint.layout import savepoint_dir
from statebackend.checkpoint.metadata import FileRef, SubtaskHandle
from statebackend.checkpoint.snapshot import UPLOAD_THREADS, stored_ref, upload_snapshot
from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.job.bootstrap_tables import APPEND, UNIQUE, EntryChunk, merge_rule
from statebackend.job.task import tune
from statebackend.lifecycle.savepoint import verify_stored
from statebackend.state.backend import KeyedStateBackend, LocalSnapshot, rocks_options
from statebackend.state.bytes_order import bytewise_order
from statebackend.state.keygroups import key_group_range_for_subtask
from statebackend.state.sst import ingest, write_sst
from statebackend.storage import Storage, StorageOptions, child_storage, open_storage

SCRATCH_ENV = "CKPT_LOCAL_DIR"  # where scratch instances go (default: the temp folder)
_COMPRESSION = {"zstd": DBCompressionType.zstd, "lz4": DBCompressionType.lz4,
                "snappy": DBCompressionType.snappy, "none": DBCompressionType.none}


@dataclass(frozen=True)
class Destination:
    """Where subtasks upload: savepoint ``savepoint`` of the job, or (None) the files of
    checkpoint ``checkpoint_id``, recorded under the driver's ``attempt_token``."""

    savepoint: str | None = None
    checkpoint_id: int = 1
    attempt_token: str = ""


@dataclass(frozen=True)
class BootstrapTask:
    """What every subtask of one bootstrap needs; shipped to Spark tasks with the function
    (the storage options carry credentials; their repr shows no secret)."""

    job: Job
    storage_url: str
    job_dir: str
    parallelism: int
    max_parallelism: int
    destination: Destination
    storage_options: StorageOptions = field(default_factory=StorageOptions, hash=False)
    key_hash: str = defaults.KEY_HASH  # a new lineage's (statebackend.state.keygroups)

    def job_storage(self) -> Storage:
        return child_storage(open_storage(self.storage_url, **self.storage_options),
                             self.job_dir)


@dataclass(frozen=True)
class SubtaskWritten:
    """What one subtask wrote: its handle, its uploads, entries per family, timings."""

    subtask: int
    attempt: int
    handle: SubtaskHandle
    uploaded: tuple[str, ...]
    entries: Mapping[str, int]
    timings: Mapping[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"subtask": self.subtask, "attempt": self.attempt,
                "handle": self.handle.to_json(), "uploaded": list(self.uploaded),
                "entries": dict(self.entries), "timings": dict(self.timings)}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> SubtaskWritten:
        where = f"result of bootstrap subtask {data.get('subtask')}"
        return SubtaskWritten(
            data["subtask"], data["attempt"], SubtaskHandle.from_json(data["handle"], where),
            tuple(data["uploaded"]), dict(data["entries"]), dict(data["timings"]))


def write_subtask(task: BootstrapTask, subtask: int, attempt: int,
                  chunks: Iterable[EntryChunk]) -> SubtaskWritten:
    """Attempt ``attempt`` of subtask ``subtask`` over its entries (module doc)."""
    started, cpu = time.perf_counter(), time.thread_time()
    by_family: dict[str, list[EntryChunk]] = {}
    for chunk in chunks:
        if len(chunk.keys):
            by_family.setdefault(chunk.family, []).append(chunk)
    storage = task.job_storage()
    work = tempfile.mkdtemp(prefix=f"ckpt-bootstrap-{subtask}-",
                            dir=os.environ.get(SCRATCH_ENV) or None)
    backend: KeyedStateBackend | None = None
    uploaded: tuple[str, ...] = ()
    timings: dict[str, float] = {}
    try:
        ssts = _write_ssts(task, by_family, work)
        backend = _ingested(task, subtask, ssts, work)
        timings["write"] = time.perf_counter() - started
        timings["write_cpu"] = time.thread_time() - cpu
        counts = {name: ssts[name][1] if name in ssts else 0
                  for name in backend.column_families}
        local = replace(backend.take_local_snapshot(count_rows=False), row_counts=counts)
        t = time.perf_counter()
        handle, uploaded = _upload(task, storage, local, (subtask, attempt), backend)
        timings["upload"] = time.perf_counter() - t
        return SubtaskWritten(subtask, attempt, handle, uploaded,
                              {k: v for k, v in counts.items() if v}, timings)
    except BaseException:
        if uploaded:
            storage.delete_many(uploaded)
        raise
    finally:
        if backend is not None:
            backend.close()
        shutil.rmtree(work, ignore_errors=True)


def _write_ssts(task: BootstrapTask, by_family: dict[str, list[EntryChunk]], work: str
                ) -> dict[str, tuple[str, int]]:
    """One sorted SST per family: {family: (path, entries)}."""
    kinds = {d.name: d.kind for d in task.job.descriptors}
    options = rocks_options()
    if task.job.compression is not None:
        options.set_compression_type(_COMPRESSION[task.job.compression]())
    out = {}
    for family, chunks in sorted(by_family.items()):
        if family not in kinds:
            raise UsageError(f"bootstrap: entries for {family!r}, which job "
                             f"{task.job.name!r} does not open")
        keys, values = merged(family, kinds[family], chunks)
        path = os.path.join(work, f"{family}.sst")
        write_sst(path, keys.to_pylist(), values.to_pylist(), options)
        out[family] = (path, len(keys))
    return out


def merged(family: str, kind: str, chunks: list[EntryChunk]) -> tuple[pa.Array, pa.Array]:
    """A family's entries sorted by key and merged by `merge_rule` (module doc)."""
    keys = pa.concat_arrays([c.keys for c in chunks])
    values = pa.concat_arrays([c.values for c in chunks])
    rule = merge_rule(kind)
    order = sort_order(keys, np.concatenate([c.rows for c in chunks])
                       if rule == APPEND else None)
    picked = pa.array(order)
    keys, values = keys.take(picked), values.take(picked)
    if len(keys) < 2:
        return keys, values
    same = pc.equal(keys.slice(1), keys.slice(0, len(keys) - 1)).to_numpy(
        zero_copy_only=False)
    if not same.any():
        return keys, values
    if rule == UNIQUE:
        i = int(np.flatnonzero(same)[0])
        raise UsageError(f"bootstrap table of state {family!r}: {_named(kind, keys[i])} "
                         "appears in more than one row; give each key once")
    first = np.concatenate([[True], ~same])
    starts = np.flatnonzero(first)
    if rule == APPEND:  # a run's values are adjacent bytes: one list is their span
        ends = np.frombuffer(values.buffers()[1], np.int32, len(values) + 1,
                             4 * values.offset)
        bounds = np.append(ends[starts], ends[-1]).astype(np.int32)
        values = pa.BinaryArray.from_buffers(
            pa.binary(), len(starts), [None, pa.py_buffer(bounds.tobytes()),
                                       values.buffers()[2]])
    else:
        values = values.take(pa.array(starts))
    return keys.take(pa.array(starts)), values


def sort_order(keys: pa.Array, rows: np.ndarray | None = None) -> np.ndarray:
    """Indices that sort ``keys`` bytewise (RocksDB's order); equal keys by ``rows``
    (None: in their given order)."""
    if rows is None:
        if len(keys) < 2 or not pc.any(pc.less(keys.slice(1), keys.slice(0, len(keys) - 1))
                                       ).as_py():
            return np.arange(len(keys))  # in order already (e.g. a dump of a state)
        return bytewise_order(keys)
    by_row = np.argsort(rows, kind="stable")
    within = bytewise_order(keys.take(pa.array(by_row)))
    out: np.ndarray = by_row[within]
    return out


def _named(kind: str, rocks_key: pa.Scalar) -> str:
    """A stored key as the table named it (``key 'a'``, ``key 'a', user_key 'x'``)."""
    key, user_key = split_body(rocks_key.as_py()[2:], kind)
    return f"key {key!r}" + (f", user_key {user_key!r}" if user_key is not None else "")


def _ingested(task: BootstrapTask, subtask: int, ssts: dict[str, tuple[str, int]],
              work: str) -> KeyedStateBackend:
    """A new instance of the job's states holding the SSTs (moved in, one per family)."""
    kg = key_group_range_for_subtask(task.max_parallelism, task.parallelism, subtask)
    backend = KeyedStateBackend(os.path.join(work, "instance"), task.job.descriptors,
                                task.max_parallelism, kg)
    try:
        tune(backend, task.job.compression)
        ingest(backend, {family: [path] for family, (path, _) in ssts.items()})
    except BaseException:
        backend.close()
        raise
    return backend


def _upload(task: BootstrapTask, storage: Storage, local: LocalSnapshot,
            who: tuple[int, int], backend: KeyedStateBackend
            ) -> tuple[SubtaskHandle, tuple[str, ...]]:
    """(handle, uploaded paths) of ``local`` at the task's destination (module doc)."""
    subtask, attempt = who
    dest = task.destination
    if dest.savepoint is None:
        result = upload_snapshot(storage, local, checkpoint_id=dest.checkpoint_id,
                                 subtask=subtask, backend=backend)
        record_uploads(storage, dest.checkpoint_id, subtask, attempt, result.uploaded_paths,
                       dest.attempt_token)
        return result.handle, result.uploaded_paths
    folder = f"{savepoint_dir(dest.savepoint)}/{subtask}"
    names = [name for name, _ in local.files]
    sent: list[str] = []

    def put(name: str) -> FileRef:
        path = f"{folder}/{local.snapshot_id[:12]}-{name}"
        sent.append(path)  # a broken transfer may leave a partial file: removed too
        size, checksum = storage.put_file(os.path.join(local.path, name), path)
        ref = stored_ref(local, name, path, size, checksum)
        verify_stored(storage, path, ref)  # what landed is what was sent
        return ref

    try:
        refs = list(storage.map_requests(put, names, UPLOAD_THREADS))
    except BaseException:
        storage.delete_many(sent)
        raise
    r = backend.key_group_range
    handle = SubtaskHandle(
        index=subtask, key_group_start=r.start, key_group_end=r.end,
        backend_id=backend.backend_id, snapshot_id=local.snapshot_id,
        shared_files=tuple(f for f in refs if f.local_name.endswith(".sst")),
        private_files=tuple(f for f in refs if not f.local_name.endswith(".sst")),
        row_counts=dict(local.row_counts), bytes_uploaded=sum(f.size for f in refs))
    return handle, tuple(f.path for f in refs)
