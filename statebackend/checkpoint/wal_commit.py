"""The full commit of a WAL-mode external checkpoint: its WAL files applied to the
database (statebackend.state.external_wal), from its record.

The driver calls `finish_wal` right after ``_metadata``; the next run, and a savepoint's
export, call it first, so a crash between the two phases is finished before any new
work reads the database. Idempotent by epoch.
"""

from __future__ import annotations

from typing import Any

from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.errors import MetadataError, StorageError
from statebackend.state.external_store import ExternalStore
from statebackend.state.external_wal import WalCommit, applied_epoch, apply, is_wal_file, read_wal
from statebackend.storage import Storage
from statebackend.storage.checksums import checksum_algorithm, checksum_of_bytes


def finish_wal(store: ExternalStore, conn: Any, meta: CheckpointMetadata, storage: Storage
               ) -> bool:
    """Apply WAL-mode checkpoint ``meta``'s WAL files unless the database already holds
    its epoch (True: applied now). Every file is checked against its recorded size and
    checksum before anything is applied: a torn or missing WAL is refused by name."""
    ext = meta.external
    assert ext is not None and ext.mode == "wal"
    if applied_epoch(store, conn, ext.job) == ext.version:
        return False
    refs = {f.path: f for s in meta.subtasks for f in s.files if is_wal_file(f.local_name)}
    wals = []
    for ref in sorted(refs.values(), key=lambda f: f.path):
        where = f"{storage.url}/{ref.path} of checkpoint {meta.checkpoint_id}"
        try:
            data = storage.read_bytes(ref.path)
        except StorageError as exc:
            raise StorageError(f"WAL {where} cannot be read ({exc}): nothing applied"
                               ) from None
        if len(data) != ref.size or checksum_of_bytes(
                data, checksum_algorithm(ref.checksum)) != ref.checksum:
            raise MetadataError(f"WAL {where} is torn or damaged ({len(data)} bytes, "
                                f"recorded {ref.size} with checksum {ref.checksum}): "
                                "nothing applied")
        wals.append(read_wal(data, where))
    return apply(store, conn, WalCommit(ext.job, meta.checkpoint_id, ext.version,
                                        ext.parent), wals)
