"""Restore one subtask without rescale, preferring local recovery.

Three named cases, cheapest first:

1. ``local-instance``: the working instance in ``local_dir`` was closed clean right
   after the snapshot this handle records (instance.json says so) -> open it as is;
2. ``local-snapshot``: ``snapshots/<snapshot_id>`` is still on disk with the handle's
   files and sizes -> hard-link it into a fresh working instance;
3. ``download``: fetch every file of the handle in parallel into a temp folder,
   check size and checksum, then move it into place and open it.

The memory backend's handles (`statebackend.state.memory`) place their key-group files in
``files/``, downloading only those this machine has no copy of (``local-snapshot`` when
none is missing). A handle of another backend than ``RestoreOptions.backend`` is
converted: restored read-only in a temp folder, every entry copied into a new instance.

Downloads land in a temp folder removed in ``finally``; parallel failures are
reported as one error listing the distinct causes. Restore is two-phase
(download everything, then open) so a half-downloaded instance is never opened.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from statebackend.checkpoint.metadata import CheckpointMetadata, FileRef, SubtaskHandle
from statebackend.errors import StorageError, UsageError
from statebackend.state.backend import (
    DB_DIR,
    SNAPSHOTS_DIR,
    KeyedStateBackend,
    StoredInstance,
    read_instance_marker,
)
from statebackend.state.backend_kinds import BACKEND_CLASSES, convert, new_backend
from statebackend.state.external import ExternalStateBackend
from statebackend.state.external_store import ExternalRead, ExternalStore
from statebackend.state.external_wal import require_current
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.kinds import StateDescriptor
from statebackend.state.memory import (
    MemoryStateBackend,
    forget_live_instance,
    has_live_instance,
)
from statebackend.storage import Storage, checksum_algorithm, format_checksum
from statebackend.storage.checksums import crc_local_file

DOWNLOAD_THREADS = 4


def download_files(job_storage: Storage, files: Sequence[FileRef], target_dir: str,
                   verify: bool = True, threads: int = DOWNLOAD_THREADS) -> None:
    """Download ``files`` into ``target_dir`` under their local names; check them."""
    os.makedirs(target_dir, exist_ok=True)

    def fetch(ref: FileRef) -> None:
        size, checksum = job_storage.get_file(ref.path, os.path.join(target_dir, ref.local_name),
                                              checksum_algorithm(ref.checksum))
        if verify:
            require_recorded(ref, size, checksum, "downloaded")

    # a pool of requests on a remote store only (file:// copies in this thread)
    errors = [e for _, e in job_storage.attempt_requests(fetch, files, max(1, threads))
              if e is not None]
    if errors:
        causes = sorted({str(e) for e in errors})
        raise StorageError(f"restore failed for {len(errors)} of {len(files)} files: "
                           + "; ".join(causes[:5]))


@dataclass(frozen=True)
class ReuseCheck:
    """How local recovery checks the stored copies of the shared files it will reference.

    A local restore reads nothing from storage, yet the next checkpoint references the
    handle's shared files again instead of uploading them. So before reuse: one size
    probe per shared file (metadata only, in parallel) and a full checksum read of a
    bounded random sample (``checksum_sample`` files; all with ``checksum_all``).
    """

    sizes: bool = True
    checksum_sample: int = 2
    checksum_all: bool = False
    threads: int = 8


DEFAULT_REUSE_CHECK = ReuseCheck()


@dataclass(frozen=True)
class ReuseReport:
    """What `verify_reused_files` checked and which stored files it refused to reuse."""

    sizes_checked: int = 0
    checksums_checked: int = 0
    damaged: tuple[str, ...] = ()  # "path: reason" per stored file not reused


@dataclass(frozen=True)
class RestoreOptions:
    """How `restore_subtask` opens a stored subtask."""

    read_only: bool = False
    allow_local: bool = True  # reuse this machine's copy (local recovery) when it matches
    label: str | None = None  # names the instance in scan errors
    reuse_check: ReuseCheck | None = DEFAULT_REUSE_CHECK  # None: reused files unchecked
    backend: str | None = None  # convert into this backend kind (None: the handle's)
    # The external backend's database and the version to read (statebackend.state.external)
    external: ExternalRead | None = None
    # Open as a new instance of these key groups (a rescale's new subtask built on the
    # handle, statebackend.rescale.task): a new backend id, and none of the stored
    # snapshot's recorded facts (its counts describe the handle's range, not this one).
    key_groups: KeyGroupRange | None = None
    # An executor's local-recovery instance folder (statebackend.checkpoint.local_copy
    # .instance_dir) whose snapshot of the handle is seeded into the new instance's folder
    # when it holds every file (linked; copied across filesystems when the store is
    # remote: a local copy beats a download), instead of downloading the files
    local_instance: str | None = None


FROM_STORAGE = RestoreOptions(allow_local=False)  # always download


def restore_subtask(job_storage: Storage, handle: SubtaskHandle, local_dir: str,
                    descriptors: Sequence[StateDescriptor], max_parallelism: int,
                    options: RestoreOptions = RestoreOptions()) -> KeyedStateBackend:
    """Open the state of ``handle`` in ``local_dir`` (created or replaced), on the backend
    that wrote it, or converted into ``options.backend``.

    After a local restore (not read-only), the stored shared files are checked with
    ``options.reuse_check`` (None: not checked); see `verify_reused_files`.
    """
    local_dir = os.path.abspath(local_dir)
    if options.key_groups is not None and handle.backend != "rocksdb":
        # the other backends rescale without opening a base (statebackend.rescale.memory;
        # the external backend's range is a query)
        raise UsageError(f"only a RocksDB subtask opens as another key-group range, not "
                         f"subtask {handle.index} on the {handle.backend} backend")
    if options.backend not in (None, handle.backend):
        return _converted(job_storage, handle, local_dir, (descriptors, max_parallelism),
                          options)
    if handle.backend == "external":
        return _restore_external(handle, local_dir, (descriptors, max_parallelism), options)
    if options.local_instance is not None:
        seeded = _seed_local_snapshot(options.local_instance, handle, local_dir,
                                     copy=job_storage.remote)
        options = replace(options, allow_local=options.allow_local and seeded,
                          local_instance=None)
    if handle.backend == "memory":
        mode = _place_memory_files(job_storage, handle, local_dir, options.allow_local)
    else:
        mode = _place_rocksdb_files(job_storage, handle, local_dir, options.allow_local)
    report = ReuseReport()
    if mode != "download" and not options.read_only and options.reuse_check is not None:
        report = verify_reused_files(job_storage, handle, local_dir, options.reuse_check)
    file_paths = {f.local_name: f.path for f in handle.files}
    key_groups, origin = handle.key_group_range, StoredInstance(
        handle.backend_id, options.label, file_paths, handle.snapshot_id, handle.row_counts,
        handle.file_key_groups)
    if options.key_groups is not None:
        key_groups, origin = options.key_groups, StoredInstance(label=options.label,
                                                                file_paths=file_paths)
    backend = BACKEND_CLASSES[handle.backend](local_dir, descriptors, max_parallelism,
                                              key_groups, read_only=options.read_only,
                                              origin=origin)
    _adopt_stored_files(backend, handle, report, mode)
    return backend


def _adopt_stored_files(backend: KeyedStateBackend, handle: SubtaskHandle,
                       report: ReuseReport, mode: str) -> None:
    """Let ``backend``'s next snapshot reference ``handle``'s stored shared files instead
    of uploading them, except those ``report`` found damaged; record how it was restored."""
    bad = {d.split(": ", 1)[0] for d in report.damaged}
    # A damaged stored file is not referenced again: the next snapshot uploads the
    # (verified) local copy under a new shared name.
    backend.uploaded = {f.local_name: f for f in handle.shared_files if f.path not in bad}
    backend.reuploaded = tuple(sorted(bad))
    backend.reuse_report = report
    backend.restore_mode = mode


def _place_rocksdb_files(job_storage: Storage, handle: SubtaskHandle, local_dir: str,
                         allow_local: bool) -> str:
    """Put the handle's RocksDB instance in ``local_dir/db``; returns the restore mode
    (``local-instance``, ``local-snapshot`` from ``local_dir/snapshots``, ``download``)."""
    marker = read_instance_marker(local_dir) if allow_local else None
    db_path = os.path.join(local_dir, DB_DIR)
    if marker and marker.get("clean_snapshot_id") == handle.snapshot_id \
            and os.path.isdir(db_path):
        return "local-instance"
    local_snapshot = os.path.join(local_dir, SNAPSHOTS_DIR, handle.snapshot_id)
    staging = os.path.join(local_dir, f".restore-{uuid.uuid4().hex}")
    try:
        if allow_local and _matches(local_snapshot, handle.files):
            mode = "local-snapshot"
            os.makedirs(staging)
            for ref in handle.files:
                _link_or_copy(os.path.join(local_snapshot, ref.local_name),
                              os.path.join(staging, ref.local_name))
        else:
            mode = "download"
            download_files(job_storage, handle.files, staging)
        shutil.rmtree(db_path, ignore_errors=True)
        os.replace(staging, db_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return mode


def _place_memory_files(job_storage: Storage, handle: SubtaskHandle, local_dir: str,
                        allow_local: bool) -> str:
    """Put the handle's key-group files in ``local_dir/files``, downloading only those
    this machine has no copy of (files are immutable); returns the restore mode."""
    if allow_local and has_live_instance(local_dir, handle.snapshot_id):
        return "local-instance"  # this process still holds the state (statebackend.state.memory)
    forget_live_instance(local_dir)
    files_dir = os.path.join(local_dir, MemoryStateBackend.files_dir)
    # A key-group file has no block checksums of its own: a local copy is used only when
    # its bytes have the recorded checksum (cheap next to decoding it), else downloaded.
    missing = [ref for ref in handle.files
               if not (allow_local and _is_intact(os.path.join(files_dir, ref.local_name),
                                                  ref))]
    if not missing:
        return "local-snapshot"
    staging = os.path.join(local_dir, f".restore-{uuid.uuid4().hex}")
    try:
        download_files(job_storage, missing, staging)
        os.makedirs(files_dir, exist_ok=True)
        for ref in missing:
            os.replace(os.path.join(staging, ref.local_name),
                       os.path.join(files_dir, ref.local_name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return "download"


def external_read(meta: CheckpointMetadata, store: ExternalStore | None
                  ) -> ExternalRead | None:
    """What restoring ``meta``'s subtasks reads from the external backend's database
    ``store`` (None: not an external checkpoint); refused in one line without the
    database or with another one than the record names."""
    ext = meta.external
    if ext is None:
        return None
    if store is None:
        raise UsageError(f"checkpoint {meta.checkpoint_id} keeps its state in {ext.store}: "
                         "pass that database (--state-db)")
    if store.identity != ext.store:
        raise UsageError(f"checkpoint {meta.checkpoint_id} keeps its state in {ext.store}, "
                         f"not {store.identity}")
    return ExternalRead(store, ext.job, ext.version, ext.parent, ext.mode)


def current_external_read(meta: CheckpointMetadata, store: ExternalStore | None
                          ) -> ExternalRead | None:
    """`external_read` for reading ``meta``'s state as data, checked before any work: in
    WAL mode the database must hold its version (`external_wal.require_current`)."""
    read = external_read(meta, store)
    require_current(read, f"reading checkpoint {meta.checkpoint_id}")
    return read


def _restore_external(handle: SubtaskHandle, local_dir: str,
                      states: tuple[Sequence[StateDescriptor], int], options: RestoreOptions
                      ) -> KeyedStateBackend:
    """Open an external-backend subtask: this process's instance at exactly that
    snapshot (``local-instance``), else a query of its key groups at the checkpoint's
    version (``query``); nothing comes from checkpoint storage."""
    read = options.external
    if read is None:
        raise UsageError(f"{options.label or f'subtask {handle.index}'} keeps its state in "
                         "an external database: pass the database (--state-db)")
    live = options.allow_local and not options.read_only \
        and has_live_instance(local_dir, handle.snapshot_id)
    if not live:
        forget_live_instance(local_dir)
    backend = ExternalStateBackend(
        local_dir, states[0], states[1], handle.key_group_range, read_only=options.read_only,
        origin=StoredInstance(handle.backend_id, options.label, {}, handle.snapshot_id))
    if live:
        backend.attach(read.store, read.job, mode=read.mode)
    else:
        backend.load_version(read)
    backend.restore_mode = "local-instance" if live else "query"
    return backend


def _converted(job_storage: Storage, handle: SubtaskHandle, local_dir: str,
               states: tuple[Sequence[StateDescriptor], int], options: RestoreOptions
               ) -> KeyedStateBackend:
    """Restore ``handle`` read-only beside ``local_dir`` and copy every entry into a new
    instance of ``options.backend`` there (a lineage moving to another backend)."""
    descriptors, max_parallelism = states
    assert options.backend is not None
    shutil.rmtree(local_dir, ignore_errors=True)
    target = new_backend(options.backend, local_dir, descriptors, max_parallelism,
                         handle.key_group_range)
    with restored_readonly(job_storage, handle, descriptors, max_parallelism,
                           options=options) as source:
        convert(source, target)
    target.restore_mode = f"converted-from-{handle.backend}"
    return target


def verify_reused_files(job_storage: Storage, handle: SubtaskHandle, local_dir: str,
                        check: ReuseCheck = DEFAULT_REUSE_CHECK) -> ReuseReport:
    """Check the stored shared files of ``handle`` before a local restore reuses them.

    Returns the stored files found missing, truncated or with a wrong checksum. Each of
    them must have a good local copy (the recorded checksum over the local bytes) or no
    local copy at all (compacted away: never referenced again); otherwise raises
    StorageError, since neither copy can be trusted.
    """
    refs = list(handle.shared_files)
    if check.checksum_all:
        sampled = {f.path for f in refs}
    else:
        k = min(len(refs), max(0, check.checksum_sample))
        sampled = {f.path for f in random.sample(refs, k)}

    def probe(ref: FileRef) -> str | None:
        if ref.path in sampled:
            try:
                size, checksum = job_storage.checksum(ref.path, checksum_algorithm(ref.checksum))
            except StorageError as exc:
                if isinstance(exc.__cause__, FileNotFoundError):
                    return "missing"
                raise
            if size != ref.size or checksum != ref.checksum:
                return (f"{size} bytes with {checksum}, recorded {ref.size} bytes with "
                        f"{ref.checksum}")
            return None
        if not check.sizes:
            return None
        info = job_storage.info(ref.path)
        if info is None:
            return "missing"
        return None if info.size == ref.size else f"{info.size} bytes, recorded {ref.size}"

    findings = list(job_storage.map_requests(probe, refs, check.threads))
    damaged = [(ref, why) for ref, why in zip(refs, findings, strict=True) if why]
    for ref, why in damaged:
        _require_good_local_copy(ref, why, local_dir, handle.snapshot_id)
    return ReuseReport(sizes_checked=len(refs) if check.sizes else len(sampled),
                       checksums_checked=len(sampled),
                       damaged=tuple(f"{ref.path}: {why}" for ref, why in damaged))


def _require_good_local_copy(ref: FileRef, why: str, local_dir: str, snapshot_id: str) -> None:
    dirs = [kind.files_dir for kind in BACKEND_CLASSES.values()]
    for path in (*(os.path.join(local_dir, d, ref.local_name) for d in dirs),
                 os.path.join(local_dir, SNAPSHOTS_DIR, snapshot_id, ref.local_name)):
        if not os.path.exists(path):
            continue
        size, checksum = _local_checksum(path, checksum_algorithm(ref.checksum))
        if size == ref.size and checksum == ref.checksum:
            return
        raise StorageError(
            f"{ref.path} is damaged in storage ({why}) and its local copy {path} is damaged "
            f"too ({size} bytes, recorded {ref.size} bytes with {ref.checksum}): neither can "
            f"be trusted; restore from an earlier checkpoint or savepoint (`ckpt list`)")


def _matches(directory: str, files: Sequence[FileRef]) -> bool:
    try:
        return all(os.path.getsize(os.path.join(directory, f.local_name)) == f.size for f in files)
    except OSError:
        return False


def require_recorded(ref: FileRef, size: int, checksum: str, how: str) -> None:
    """StorageError unless ``size`` and ``checksum`` (of the bytes ``how``: downloaded,
    read) are the ones ``ref`` records."""
    if size != ref.size or checksum != ref.checksum:
        raise StorageError(
            f"{ref.path}: {how} {size} bytes with {checksum}, metadata records "
            f"{ref.size} bytes with {ref.checksum} (file corrupted or replaced)")


def _is_intact(path: str, ref: FileRef) -> bool:
    try:
        return _local_checksum(path, checksum_algorithm(ref.checksum)) == (ref.size,
                                                                            ref.checksum)
    except OSError:
        return False


def _link_or_copy(src: str, dst: str) -> None:
    # SSTs are immutable: a hard link is safe; MANIFEST etc. are copied because
    # RocksDB appends to the MANIFEST of an open instance.
    if src.endswith(".sst"):
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)


@contextmanager
def restored_readonly(job_storage: Storage, handle: SubtaskHandle,
                      descriptors: Sequence[StateDescriptor], max_parallelism: int,
                      work_dir: str | None = None, options: RestoreOptions = RestoreOptions()
                      ) -> Iterator[KeyedStateBackend]:
    """``handle`` opened read-only in a folder of its own (in ``work_dir``, else the temp
    folder), removed after: from ``options.local_instance``'s snapshot when it holds the
    handle's files (hard links, in a folder beside that instance), else from storage;
    ``backend.restore_mode`` says which (``local-snapshot`` or ``download``). ``options``
    also give its label and an external backend's database."""
    instance = options.local_instance
    parent = os.path.dirname(instance) if instance else work_dir
    tmp = tempfile.mkdtemp(prefix=f"ckpt-read-{handle.index}-",
                           dir=parent if parent and os.path.isdir(parent) else None)
    backend = None
    try:
        backend = restore_subtask(job_storage, handle, tmp, descriptors, max_parallelism,
                                  replace(options, read_only=True, backend=None))
        yield backend
    finally:
        if backend is not None:
            backend.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _seed_local_snapshot(instance: str, handle: SubtaskHandle, folder: str,
                        copy: bool = False) -> bool:
    """Hard-link the executor's snapshot of ``handle`` (in the local-recovery folder
    ``instance``) into ``folder``'s snapshots folder, where `restore_subtask` finds it;
    with ``copy``, copy what cannot be linked (another filesystem: cheaper than a
    download from a remote store). False (nothing left behind) unless every file is
    there with its recorded size."""
    source = os.path.join(instance, SNAPSHOTS_DIR, handle.snapshot_id)
    target = os.path.join(folder, SNAPSHOTS_DIR, handle.snapshot_id)
    try:
        if not all(os.path.getsize(os.path.join(source, f.local_name)) == f.size
                   for f in handle.files):
            return False
        os.makedirs(target)
        for f in handle.files:
            src, dst = os.path.join(source, f.local_name), os.path.join(target, f.local_name)
            try:
                os.link(src, dst)
            except OSError:
                if not copy:
                    raise
                shutil.copyfile(src, dst)
    except OSError:  # pruned meanwhile, or another filesystem: download instead
        shutil.rmtree(target, ignore_errors=True)
        return False
    return True


def _local_checksum(path: str, algorithm: str) -> tuple[int, str]:
    """(size, checksum) of a local file, read through a memory map (no copy in memory)."""
    size, value = crc_local_file(path, algorithm)
    return size, format_checksum(algorithm, value)
