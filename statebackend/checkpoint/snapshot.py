"""Incremental snapshot, asynchronous part: upload a local snapshot, build its handle.

Order of a checkpoint (upload first, commit last):

1. synchronous part (`KeyedStateBackend.take_local_snapshot`): flush every column
   family, RocksDB native checkpoint into ``snapshots/<snapshot_id>`` (hard links);
   the instance may take new writes as soon as this returns;
2. asynchronous part (here, `start_upload` / `upload_snapshot`): every SST that a
   committed checkpoint of this lineage already holds (``backend.uploaded``, keyed
   by RocksDB's file name, which RocksDB never reuses within an instance) is
   *referenced*; the other SSTs go to ``shared/<uuid>-<name>`` and the small
   files (MANIFEST, CURRENT, OPTIONS ...) to ``chk-<id>/<subtask>/<snapshot_id>/``,
   in parallel, with a CRC32 taken on the bytes sent;
3. the driver writes ``chk-<id>/_metadata`` once every subtask has a handle
   (`statebackend.checkpoint.attempt.Attempt.commit`, the one commit-or-discard of every
   checkpoint writer).

Only files of *committed* checkpoints are ever referenced: a file uploaded by an
attempt that never committed may be deleted at any time by its own cleanup or
by GC, so referencing it would risk data loss (Flink FLINK-8754-style bug).
A failed upload deletes what this attempt uploaded (best effort) and raises
SnapshotError listing the distinct causes; nothing is committed.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

from statebackend.checkpoint.attempt import Attempt
from statebackend.checkpoint.layout import private_dir, shared_path
from statebackend.checkpoint.metadata import CheckpointMetadata, FileRef, SubtaskHandle
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.errors import SnapshotError, UsageError
from statebackend.state.backend import KeyedStateBackend, LocalSnapshot
from statebackend.storage import Storage

UPLOAD_THREADS = 4


@dataclass(frozen=True)
class SnapshotResult:
    """A subtask's handle plus what this attempt uploaded (for cleanup on abort)."""

    handle: SubtaskHandle
    uploaded_paths: tuple[str, ...]
    upload_seconds: float
    files_reused: int


def stored_ref(snapshot: LocalSnapshot, name: str, path: str, size: int,
               checksum: str) -> FileRef:
    """The reference of ``snapshot``'s file ``name`` stored at ``path``."""
    return FileRef(path, name, size, checksum,
                   key_groups=snapshot.file_key_groups.get(name, ()))


def upload_snapshot(job_storage: Storage, snapshot: LocalSnapshot, *, checkpoint_id: int,
                    subtask: int, backend: KeyedStateBackend,
                    threads: int = UPLOAD_THREADS) -> SnapshotResult:
    """Upload the new files of ``snapshot``; return its handle. Commits nothing."""
    started = time.perf_counter()
    reused: list[FileRef] = []
    to_upload: list[tuple[str, str, bool]] = []  # (local name, remote path, shared)
    for name, size in snapshot.files:
        known = backend.uploaded.get(name)
        shared = backend.is_shared_file(name)
        if shared and known is not None and known.size == size:
            # a memory-backend file serves fewer key groups once some were rewritten
            key_groups = snapshot.file_key_groups.get(name, known.key_groups)
            reused.append(known if key_groups == known.key_groups
                          else replace(known, key_groups=key_groups))
        elif shared:
            to_upload.append((name, shared_path(f"{uuid.uuid4().hex}-{name}"), True))
        else:
            prefix = private_dir(checkpoint_id, subtask, snapshot.snapshot_id)
            to_upload.append((name, f"{prefix}/{name}", False))

    def put(item: tuple[str, str, bool]) -> tuple[int, str]:
        name, remote, _ = item
        return job_storage.put_file(os.path.join(snapshot.path, name), remote)

    try:  # a pool of requests on a remote store only (file:// copies in this thread)
        outcomes = job_storage.attempt_requests(put, to_upload, max(1, threads))
        errors = [e for _, e in outcomes if e is not None]
        if errors:
            causes = sorted({f"{type(e).__name__}: {e}" for e in errors})
            raise SnapshotError(
                f"snapshot of subtask {subtask} for checkpoint {checkpoint_id} failed; "
                f"removed {len(to_upload) - len(errors)} uploaded files; causes: "
                f"{'; '.join(causes)}") from errors[0]
    except BaseException:  # a failure or an interrupt
        # Every path this attempt wrote to, not only the finished ones: a transfer
        # that broke half-way can leave a partial object behind.
        job_storage.delete_many(remote for _, remote, _ in to_upload)
        raise
    done = [(stored_ref(snapshot, name, remote, *facts), shared)
            for (name, remote, shared), (facts, _) in zip(to_upload, outcomes, strict=True)
            if facts is not None]
    uploaded_paths = tuple(ref.path for ref, _ in done)
    shared_new = [ref for ref, shared in done if shared]
    private = [ref for ref, shared in done if not shared]
    r = backend.key_group_range
    handle = SubtaskHandle(
        index=subtask,
        key_group_start=r.start,
        key_group_end=r.end,
        backend_id=backend.backend_id,
        snapshot_id=snapshot.snapshot_id,
        shared_files=tuple(sorted(reused + shared_new, key=lambda f: f.local_name)),
        private_files=tuple(sorted(private, key=lambda f: f.local_name)),
        row_counts=dict(snapshot.row_counts),
        bytes_uploaded=sum(ref.size for ref, _ in done),
        backend=backend.kind,
    )
    return SnapshotResult(handle, uploaded_paths, time.perf_counter() - started, len(reused))


class PendingSnapshot:
    """The asynchronous part running in the background; `result()` waits for it."""

    def __init__(self, future: Future[SnapshotResult], executor: ThreadPoolExecutor,
                 local: LocalSnapshot) -> None:
        self._future = future
        self._executor = executor
        self.local = local

    def result(self) -> SnapshotResult:
        try:
            return self._future.result()
        finally:
            self._executor.shutdown(wait=False)

    def done(self) -> bool:
        return self._future.done()


def snapshot(backend: KeyedStateBackend, job_storage: Storage, *, checkpoint_id: int,
             subtask: int, count_rows: bool = True) -> PendingSnapshot:
    """Synchronous part now, upload in the background; writes may continue at once."""
    local = backend.take_local_snapshot(count_rows=count_rows)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
    future = executor.submit(upload_snapshot, job_storage, local, checkpoint_id=checkpoint_id,
                             subtask=subtask, backend=backend)
    return PendingSnapshot(future, executor, local)


def discard_uploads(job_storage: Storage, results: list[SnapshotResult]) -> None:
    """Best-effort removal of what aborted attempts uploaded (never shared reuse)."""
    job_storage.delete_many(p for r in results for p in r.uploaded_paths)


def checkpoint_backends(store: CheckpointStore, backends: Sequence[KeyedStateBackend], *,
                        parent: int | Literal["latest"] | None = "latest",
                        run_id: str | None = None, inputs: Sequence[str] = (),
                        extra: Mapping[str, Any] | None = None
                        ) -> CheckpointMetadata:
    """Checkpoint in-process backends (subtask i = backends[i]) and commit.

    The driver-side loop of a checkpoint for code that holds every backend in
    one process (library users, the demo, tests); the Spark job does the same
    across executors. ``parent``: the latest committed checkpoint by default; the
    new id is the parent's + 1 (checkpoint/lineage.py).
    """
    if not backends:
        raise UsageError("checkpoint_backends needs at least one backend")
    if isinstance(parent, str):
        if parent != "latest":
            raise UsageError(f"parent {parent!r} is not a checkpoint id, None or 'latest'")
        ids = store.checkpoint_ids()
        parent = ids[-1] if ids else None
    cid = (parent or 0) + 1
    pending = [snapshot(b, store.storage, checkpoint_id=cid, subtask=i)
               for i, b in enumerate(backends)]
    results: list[SnapshotResult] = []
    errors: list[Exception] = []
    attempt = Attempt(store, cid)
    for p in pending:
        try:
            results.append(p.result())
            attempt.add_uploaded(results[-1].uploaded_paths)
        except Exception as exc:  # noqa: BLE001 - wait for every subtask, then clean up
            errors.append(exc)
    first = backends[0]
    if errors:
        attempt.discard()
        raise errors[0]
    try:
        meta = build_metadata(MetadataParts(
            job=store.job, checkpoint_id=cid, parent=parent,
            max_parallelism=first.max_parallelism,
            states=[d.to_json() for d in first.descriptors.values()],
            handles=[r.handle for r in results], run_id=run_id, inputs=inputs, extra=extra,
            key_hash=first.key_hash))
    except BaseException:
        attempt.discard()
        raise
    attempt.commit(meta)  # verify, exclusive _metadata; discards the attempt on failure
    for backend, result in zip(backends, results, strict=True):
        backend.notify_checkpoint_complete(result.handle)
    return meta
