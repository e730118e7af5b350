"""The second phase of an external checkpoint's commit, from its record (the decision):
MVCC names the version to commit (`commit_version`), WAL mode lists the WAL files to
apply (`finish_wal`, statebackend.state.external_wal).

The driver calls `finish_commit` right after ``_metadata``; the next run's prepare and a
WAL savepoint's export call `finish` first, so a crash between the two phases is
finished before any new work reads the database; `ckpt doctor --state-db` reports such a
checkpoint (`commit_state`) and its ``--repair`` finishes it. Idempotent by epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.errors import MetadataError, StorageError
from statebackend.state.external_store import (
    ExternalStore,
    commit_version,
    connection,
    head_version,
)
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


def finish(store: ExternalStore, conn: Any, meta: CheckpointMetadata, storage: Storage
           ) -> None:
    """Make external checkpoint ``meta``'s version the database's (module docstring)."""
    ext = meta.external
    assert ext is not None
    if ext.mode == "wal":
        finish_wal(store, conn, meta, storage)
    else:
        commit_version(store, conn, ext.job, ext.version, ext.parent)


def finish_commit(store: ExternalStore, meta: CheckpointMetadata, storage: Storage,
                  what: str) -> None:
    """`finish` on a connection of its own; a database error is one line naming ``what``."""
    with connection(store, what) as conn:
        finish(store, conn, meta, storage)


@dataclass(frozen=True)
class CommitState:
    """Where database ``store`` (its identity) stands against external checkpoint
    ``checkpoint_id``'s ``version``: ``held`` is the job's MVCC head version or WAL
    applied epoch (None: nothing committed yet)."""

    checkpoint_id: int
    store: str
    mode: str
    version: int
    held: int | None

    @property
    def pending(self) -> bool:
        """The record is committed but readers of the database do not see it yet."""
        return self.held is None or self.held < self.version

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint_id, "store": self.store, "mode": self.mode,
                "version": self.version, "held": self.held, "pending": self.pending}


def commit_state(store: ExternalStore, meta: CheckpointMetadata, what: str) -> CommitState:
    """Read where ``store`` stands against external checkpoint ``meta`` (`CommitState`)."""
    ext = meta.external
    assert ext is not None
    with connection(store, what) as conn:
        held = applied_epoch(store, conn, ext.job) if ext.mode == "wal" \
            else head_version(store, conn, ext.job)
    return CommitState(meta.checkpoint_id, store.identity, ext.mode, ext.version, held)
