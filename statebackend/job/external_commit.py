"""The driver's half of the external backend's two-phase commit (MVCC in PostgreSQL).

A run on the external backend (statebackend.state.external_store for the tables):

- `prepare`, under the writer lease before any task: create the tables if missing,
  finish the commit of the latest checkpoint if a crash came between its ``_metadata``
  and the database (the record names the version: that is the decision), then delete
  the rows of epochs no committed version names (failed or discarded attempts);
  returns the version the run restores (the parent checkpoint's) and checks that the
  lineage's state is in this database; and takes the run's fresh epoch;
- the subtasks pre-commit their changes under that epoch;
- `version_of` is what the commit record says (`CheckpointMetadata.external`);
- `commit` (after ``_metadata``) adds the version and moves the head in one
  transaction. A crash before it is finished by the next run's `prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    """What `prepare` found: the run's parent version (None: first external run) and
    the epoch its subtasks write (the version it commits)."""

    parent_version: int | None
    epoch: int
    finished_commit: int | None  # the version a crash left uncommitted, now committed
    rows_discarded: int


def prepare(store: ExternalStore, job: str, latest: CheckpointMetadata | None,
            parent: CheckpointMetadata | None) -> Prepared:
    """Before a run's tasks (module docstring)."""
    for meta in (latest, parent):
        if meta is not None and meta.external is not None \
                and meta.external.store != store.identity:
            raise UsageError(f"checkpoint {meta.checkpoint_id} of job {job!r} keeps its "
                             f"state in {meta.external.store}, not {store.identity}: pass "
                             "that database (--state-db, --state-table)")
    conn = store.connect()
    try:
        with database_errors(store, f"preparing the run of job {job!r}"):
            finished, discarded, epoch = _prepare_database(store, conn, job, latest)
    finally:
        conn.close()
    parent_version = parent.external.version if parent is not None \
        and parent.external is not None else None
    return Prepared(parent_version, epoch, finished, discarded)


def _prepare_database(store: ExternalStore, conn: Any, job: str,
                      latest: CheckpointMetadata | None) -> tuple[int | None, int, int]:
    """(the version whose commit was finished, rows discarded, the new epoch)."""
    ensure_schema(store, conn)
    finished = None
    if latest is not None and latest.external is not None:
        ext = latest.external
        if commit_version(store, conn, job, ext.version, ext.parent):
            finished = ext.version
    discarded = discard_uncommitted(store, conn, job)
    return finished, discarded, new_epoch(store, conn)


def version_of(store: ExternalStore, job: str, prepared: Prepared) -> ExternalVersion:
    """The version a run's checkpoint records: the run's epoch, over its parent's."""
    return ExternalVersion(store.identity, job, prepared.epoch, prepared.parent_version)


def restore_read(store: ExternalStore | None, job: str, parent_version: int | None
                 ) -> ExternalRead | None:
    """What a subtask restores: the parent's version (None: nothing to read)."""
    if store is None or parent_version is None:
        return None
    return ExternalRead(store, job, parent_version)


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
