"""The driver's half of the external backend's two-phase commit.

A run on the external backend (statebackend.state.external_store for the MVCC tables,
statebackend.state.external_wal for WAL mode's):

- `prepare`, under the writer lease before any task: create the tables if missing and
  finish the commit of the latest checkpoint if a crash came between its ``_metadata``
  and the database (the record is the decision: MVCC names its version, WAL mode lists
  its WAL files), then (MVCC) delete the rows of epochs no committed version names
  (failed or discarded attempts); check that the parent's state is in this database (WAL
  mode: that the database holds exactly the parent's epoch); take the run's fresh epoch;
- the subtasks pre-commit their changes under that epoch (MVCC: rows in the database;
  WAL mode: WAL files in checkpoint storage);
- `Prepared.version` is what the commit record says (`CheckpointMetadata.external`);
- `commit` (after ``_metadata``): MVCC adds the version and moves the head, WAL mode
  applies every subtask's WAL, each in one transaction and idempotent by epoch. A crash
  before it is finished by the next run's `prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statebackend.checkpoint.external_finish import finish, finish_commit
from statebackend.checkpoint.metadata import CheckpointMetadata, ExternalVersion
from statebackend.errors import UsageError
from statebackend.state.external_store import (
    ExternalRead,
    ExternalStore,
    connection,
    discard_uncommitted,
    ensure_schema,
    new_epoch,
)
from statebackend.state.external_wal import applied_epoch, ensure_wal_schema
from statebackend.storage import Storage


def store_of(state_db: str | None, table: str, what: str) -> ExternalStore:
    """The configured database, or a one-line refusal naming ``what`` needs it."""
    if not state_db:
        raise UsageError(f"{what} runs on the external backend: pass its database with "
                         "--state-db postgresql://user@host:port/db (ckpt_jobs: state_db)")
    return ExternalStore(state_db, table)


@dataclass(frozen=True)
class Prepared:
    """A run prepared by `prepare`: its database, the parent version it restores (None:
    nothing to read, a WAL run's WAL is then full), the epoch its subtasks write (the
    version it commits) and the mode."""

    store: ExternalStore
    parent_version: int | None
    epoch: int
    mode: str = "mvcc"

    def version(self, job: str) -> ExternalVersion:
        """What the run's checkpoint records: the epoch, over the parent's version."""
        return ExternalVersion(self.store.identity, job, self.epoch, self.parent_version,
                               self.mode)

    def restore_read(self, job: str) -> ExternalRead | None:
        """What the subtasks restore: the parent's version (None: nothing to read)."""
        return None if self.parent_version is None \
            else ExternalRead(self.store, job, self.parent_version, mode=self.mode)


def run_mode(requested: str | None, latest: CheckpointMetadata | None, job: str) -> str:
    """The mode a run uses: ``requested``, else the lineage's, else MVCC; a change of
    mode along a lineage is refused in one line."""
    lineage = latest.external.mode if latest is not None and latest.external else None
    if requested is not None and lineage is not None and requested != lineage:
        raise UsageError(f"job {job!r} keeps its state in the database in {lineage} mode, "
                         f"not {requested}: run it with --state-mode {lineage} (a new mode "
                         "starts a new job, e.g. from a savepoint)")
    return requested or lineage or "mvcc"


def prepare(store: ExternalStore, job: str, lineage: tuple[CheckpointMetadata | None,
            CheckpointMetadata | None], mode: str, storage: Storage) -> Prepared:
    """Before a run's tasks (module docstring); ``lineage``: its latest checkpoint and
    the parent the run restores, ``storage``: the job's (WAL files)."""
    latest, parent = lineage
    for meta in (latest, parent):
        if meta is not None and meta.external is not None \
                and meta.external.store != store.identity:
            raise UsageError(f"checkpoint {meta.checkpoint_id} of job {job!r} keeps its "
                             f"state in {meta.external.store}, not {store.identity}: pass "
                             "that database (--state-db, --state-table)")
    parent_ext = parent.external if parent is not None else None
    with connection(store, f"preparing the run of job {job!r}") as conn:
        (ensure_wal_schema if mode == "wal" else ensure_schema)(store, conn)
        if latest is not None and latest.external is not None:
            finish(store, conn, latest, storage)  # its mode is the run's (run_mode)
        if mode == "wal":
            _check_current(store, conn, parent)
        else:
            discard_uncommitted(store, conn, job)
        epoch = new_epoch(store, conn)
    return Prepared(store, parent_ext.version if parent_ext is not None
                    and parent_ext.mode == mode else None, epoch, mode)


class NotCurrentError(UsageError):
    """WAL mode: the database holds another epoch than the run's parent."""


def _check_current(store: ExternalStore, conn: Any, parent: CheckpointMetadata | None
                   ) -> None:
    """UsageError unless the database holds WAL-mode ``parent``'s epoch (a rollback to an
    older checkpoint cannot be restored from the current state)."""
    if parent is None or parent.external is None:
        return
    ext = parent.external
    current = applied_epoch(store, conn, ext.job)
    if current != ext.version:
        raise NotCurrentError(
            f"checkpoint {parent.checkpoint_id} of job {ext.job!r} is epoch {ext.version}, "
            f"but {store.identity} holds epoch {current}: WAL mode restores only the latest "
            "applied checkpoint (start a new job from a savepoint to go back)")


def commit(store: ExternalStore, meta: CheckpointMetadata, storage: Storage) -> None:
    """Second phase: make ``meta``'s version the database's (idempotent)."""
    if meta.external is not None:
        finish_commit(store, meta, storage, (
            f"checkpoint {meta.checkpoint_id} is committed but the commit of its version "
            f"{meta.external.version} failed (the next run of job {meta.external.job!r} "
            "finishes it)"))
