"""Restore one subtask without rescale, preferring local recovery.

Three named cases, cheapest first:

1. ``local-instance``: the working instance in ``local_dir`` was closed clean right
   after the snapshot this handle records (instance.json says so) -> open it as is;
2. ``local-snapshot``: ``snapshots/<snapshot_id>`` is still on disk with the handle's
   files and sizes -> hard-link it into a fresh working instance;
3. ``download``: fetch every file of the handle in parallel into a temp folder,
   check size and checksum, then move it into place and open it.

Downloads land in a temp folder removed in ``finally``; parallel failures are
reported as one error listing the distinct causes. Restore is two-phase
(download everything, then open) so a half-downloaded instance is never opened.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from .backend import DB_DIR, SNAPSHOTS_DIR, KeyedStateBackend, read_instance_marker
from .errors import StorageError
from .keygroups import KeyGroupRange
from .metadata import FileRef, SubtaskHandle
from .state import StateDescriptor
from .storage import Storage, checksum_algorithm

DOWNLOAD_THREADS = 4


def download_files(job_storage: Storage, files: Sequence[FileRef], target_dir: str,
                   verify: bool = True, threads: int = DOWNLOAD_THREADS) -> None:
    """Download ``files`` into ``target_dir`` under their local names; check them."""
    os.makedirs(target_dir, exist_ok=True)

    def fetch(ref: FileRef) -> None:
        size, checksum = job_storage.get_file(ref.path, os.path.join(target_dir, ref.local_name),
                                              checksum_algorithm(ref.checksum))
        if verify and (size != ref.size or checksum != ref.checksum):
            raise StorageError(
                f"{ref.path}: downloaded {size} bytes with {checksum}, metadata records "
                f"{ref.size} bytes with {ref.checksum} (file corrupted or replaced)")

    errors = []
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for fut in [pool.submit(fetch, f) for f in files]:
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - collected below
                errors.append(exc)
    if errors:
        causes = sorted({str(e) for e in errors})
        raise StorageError(f"restore failed for {len(errors)} of {len(files)} files: "
                           + "; ".join(causes[:5]))


def restore_subtask(job_storage: Storage, handle: SubtaskHandle, local_dir: str,
                    descriptors: Sequence[StateDescriptor], max_parallelism: int,
                    read_only: bool = False, allow_local: bool = True) -> KeyedStateBackend:
    """Open the state of ``handle`` in ``local_dir`` (created or replaced)."""
    local_dir = os.path.abspath(local_dir)
    kg_range = KeyGroupRange(handle.key_group_start, handle.key_group_end)
    marker = read_instance_marker(local_dir) if allow_local else None
    db_path = os.path.join(local_dir, DB_DIR)
    if marker and marker.get("clean_snapshot_id") == handle.snapshot_id \
            and os.path.isdir(db_path):
        mode = "local-instance"
    else:
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
    backend = KeyedStateBackend(local_dir, descriptors, max_parallelism, kg_range,
                                backend_id=handle.backend_id, read_only=read_only)
    backend.uploaded = {f.local_name: f for f in handle.shared_files}
    backend.restore_mode = mode
    backend._last_snapshot_id = handle.snapshot_id
    return backend


def _matches(directory: str, files: Sequence[FileRef]) -> bool:
    try:
        return all(os.path.getsize(os.path.join(directory, f.local_name)) == f.size for f in files)
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
                      work_dir: str | None = None) -> Iterator[KeyedStateBackend]:
    """Download one subtask into a temp folder and open it read-only (removed after)."""
    tmp = tempfile.mkdtemp(prefix=f"ckpt-read-{handle.index}-", dir=work_dir)
    backend = None
    try:
        backend = restore_subtask(job_storage, handle, tmp, descriptors, max_parallelism,
                                  read_only=True, allow_local=False)
        yield backend
    finally:
        if backend is not None:
            backend.close()
        shutil.rmtree(tmp, ignore_errors=True)
