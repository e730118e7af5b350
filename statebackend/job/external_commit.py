"""The driver's half of the external backend's two-phase commit (MVCC in PostgreSQL).

A run on the external backend (statebackend.state.external_store for the tables):

- `prepare`, under the writer lease before any task: create the tables if missing,
  finish the commit of the latest checkpoint if a crash came between its ``_metadata``
  and the database (the record names the version: that is the decision), then delete
  the rows of epochs no committed version names (failed or discarded attempts);
  returns the version the run restores (the parent checkpoint's) and checks that the
  lineage's state is in this database; and takes the run's fresh epoch;
- the subtasks pre-commit their changes under that epoch;
- `Prepared.version` is what the commit record says (`CheckpointMetadata.external`);
- `commit` (after ``_metadata``) adds the version and moves the head in one
  transaction. A crash before it is finished by the next run's `prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass

from statebackend.checkpoint.metadata import CheckpointMetadata, ExternalVersion
from statebackend.errors import UsageError
from statebackend.state.external_store import (
    ExternalRead,
    ExternalStore,
    commit_version,
    database_errors,
    discard_uncommitted,
    ensure_schema,
    new_epoch,
)


def store_of(state_db: str | None, table: str, what: str) -> ExternalStore:
    """The configured database, or a one-line refusal naming ``what`` needs it."""
    if not state_db:
        raise UsageError(f"{what} runs on the external backend: pass its database with "
                         "--state-db postgresql://user@host:port/db (ckpt_jobs: state_db)")
    return ExternalStore(state_db, table)


@dataclass(frozen=True)
class Prepared:
    """A run prepared by `prepare`: its database, the parent version it restores (None:
    the first external run) and the epoch its subtasks write (the version it commits)."""

    store: ExternalStore
    parent_version: int | None
    epoch: int

    def version(self, job: str) -> ExternalVersion:
        """What the run's checkpoint records: the epoch, over the parent's version."""
        return ExternalVersion(self.store.identity, job, self.epoch, self.parent_version)

    def restore_read(self, job: str) -> ExternalRead | None:
        """What the subtasks restore: the parent's version (None: nothing to read)."""
        return None if self.parent_version is None \
            else ExternalRead(self.store, job, self.parent_version)


def prepare(store: ExternalStore, job: str, latest: CheckpointMetadata | None,
            parent: CheckpointMetadata | None) -> Prepared:
    """Before a run's tasks (module docstring)."""
    for meta in (latest, parent):
        if meta is not None and meta.external is not None \
                and meta.external.store != store.identity:
            raise UsageError(f"checkpoint {meta.checkpoint_id} of job {job!r} keeps its "
                             f"state in {meta.external.store}, not {store.identity}: pass "
                             "that database (--state-db, --state-table)")
    with database_errors(store, f"preparing the run of job {job!r}"):
        conn = store.connect()
        try:
            ensure_schema(store, conn)
            if latest is not None and latest.external is not None:
                commit_version(store, conn, job, latest.external.version,
                               latest.external.parent)
            discard_uncommitted(store, conn, job)
            epoch = new_epoch(store, conn)
        finally:
            conn.close()
    return Prepared(store, parent.external.version if parent is not None
                    and parent.external is not None else None, epoch)


def commit(store: ExternalStore, meta: CheckpointMetadata) -> None:
    """Second phase: make ``meta``'s version committed and the head (idempotent)."""
    if meta.external is None:
        return
    ext = meta.external
    what = (f"checkpoint {meta.checkpoint_id} is committed but the commit of its version "
            f"{ext.version} failed (the next run of job {ext.job!r} finishes it)")
    with database_errors(store, what):
        conn = store.connect()
        try:
            commit_version(store, conn, ext.job, ext.version, ext.parent)
        finally:
            conn.close()
