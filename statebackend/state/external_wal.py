"""The external backend's WAL mode: one current state per job in the database, changed
only by applying each checkpoint's write-ahead logs after the checkpoint commits.

For databases (or tables) without versions. Tables (``<t>`` is `ExternalStore.table`):

- ``<t>_kv``: each job's state at its last applied checkpoint, one row per live entry
  ``(job, key_group, state, key, user_key, value)``: what other services read;
- ``<t>_applied``: per job, the epoch those rows are at and the checkpoint that wrote it.

Two-phase commit (`statebackend.job.external_commit` drives it):

1. *pre-commit*: each subtask writes the entries its epoch changed (a delete has no
   value) to a WAL file (`write_wal`), uploaded with its snapshot to checkpoint storage as
   a shared file; the database is not touched, so a failed attempt leaves nothing there;
2. *full commit*: after ``_metadata`` (naming the epoch and the epoch it builds on),
   `apply` writes every subtask's WAL in one transaction that also moves ``<t>_applied``:
   readers switch atomically. Idempotent by epoch: an applied (or older) epoch is
   skipped, so a paused driver finishing late never moves the state back; a WAL
   over another epoch than the database holds is refused with nothing applied. A *full*
   WAL (no parent: a first run, a restore from another backend or from a savepoint's
   export) replaces the job's rows;
3. a crash between the two is finished before any new work: the next run applies the
   latest checkpoint's WALs first.

The WAL file is an Arrow IPC file with `WAL_SCHEMA` (parsed, never executed); its
recorded checksum is checked before it is read, so a torn WAL is refused by name.
Restore and rescale read key-group ranges of ``<t>_kv`` (`load_current`): no state bytes
move. Only the current state is kept: older checkpoints cannot be restored from the
database; a savepoint exports the state as memory-backend files instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from statebackend.errors import MetadataError, StateDatabaseError, UsageError
from statebackend.state.external_rows import ROWS_SCHEMA, copy_rows
from statebackend.state.external_store import (
    ExternalRead,
    ExternalStore,
    RowGroup,
    connection,
    table_sql,
)

WAL_PREFIX = "wal-"  # a WAL file's local name (`wal_name`)
WAL_SCHEMA = ROWS_SCHEMA.with_metadata({b"ckpt_wal": b"1"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t}_kv (
  job text NOT NULL, key_group integer NOT NULL, state text NOT NULL, key bytea NOT NULL,
  user_key bytea NOT NULL DEFAULT '', value bytea NOT NULL,
  PRIMARY KEY (job, state, key, user_key));
CREATE INDEX IF NOT EXISTS {t}_kv_by_group ON {t}_kv (job, key_group);
CREATE TABLE IF NOT EXISTS {t}_applied (
  job text PRIMARY KEY, epoch bigint NOT NULL, checkpoint_id bigint NOT NULL,
  applied_at timestamptz NOT NULL DEFAULT now());
CREATE SEQUENCE IF NOT EXISTS {t}_epochs;
"""

# The WAL in ``ckpt_wal`` applied to the job's rows (one statement each: psycopg sends
# parameters with a single command).
# (Measured at 250,000 entries over 2.5M: the upsert 4.9 s; deleting every named entry
# then inserting 5.8 s; sorting the rows or a fillfactor did not help.)
_APPLY = (
    "ANALYZE ckpt_wal",  # a temporary table has no statistics: the join plan needs them
    """DELETE FROM {t}_kv s USING ckpt_wal w WHERE s.job = %(job)s AND w.value IS NULL
         AND s.state = w.state AND s.key = w.key AND s.user_key = w.user_key""",
    """INSERT INTO {t}_kv (job, key_group, state, key, user_key, value)
         SELECT %(job)s, key_group, state, key, user_key, value FROM ckpt_wal
         WHERE value IS NOT NULL
       ON CONFLICT (job, state, key, user_key) DO UPDATE SET value = EXCLUDED.value,
         key_group = EXCLUDED.key_group""",
    """INSERT INTO {t}_applied (job, epoch, checkpoint_id) VALUES
         (%(job)s, %(epoch)s, %(checkpoint)s)
       ON CONFLICT (job) DO UPDATE SET epoch = EXCLUDED.epoch,
         checkpoint_id = EXCLUDED.checkpoint_id, applied_at = now()""")


def wal_name(epoch: int, key_groups: tuple[int, int]) -> str:
    """A subtask's WAL: unique per epoch and key-group range (a rescaled subtask may
    carry several source subtasks' WALs)."""
    return f"{WAL_PREFIX}{epoch}-{key_groups[0]}-{key_groups[1]}.arrow"


def is_wal_file(local_name: str) -> bool:
    return local_name.startswith(WAL_PREFIX)


def write_wal(path: str, rows: pa.Table) -> int:
    """Write ``rows`` (`ROWS_SCHEMA`: a subtask's changes in one epoch) as a WAL file;
    returns the rows."""
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, WAL_SCHEMA) as writer:
        writer.write_table(rows.replace_schema_metadata(WAL_SCHEMA.metadata))
    return int(rows.num_rows)


def read_wal(data: bytes, where: str) -> pa.Table:
    """The rows of a WAL file's bytes; MetadataError naming ``where`` if malformed."""
    try:
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, ValueError) as exc:
        raise MetadataError(f"WAL {where} is not a readable WAL file: {exc}") from None
    if not table.schema.equals(WAL_SCHEMA, check_metadata=False):
        raise MetadataError(f"WAL {where} has columns {table.schema.names}, not "
                            f"{WAL_SCHEMA.names}")
    return table


def ensure_wal_schema(store: ExternalStore, conn: Any) -> None:
    """Create the WAL mode's tables if missing (the driver, once per run)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (store.table,))
        conn.execute(table_sql(store, _SCHEMA))


def applied_epoch(store: ExternalStore, conn: Any, job: str) -> int | None:
    """The epoch ``job``'s rows are at (None: nothing applied yet)."""
    row = _applied(store, conn, job)
    return None if row is None else int(row[0])


def _applied(store: ExternalStore, conn: Any, job: str, lock: str = ""
             ) -> tuple[Any, ...] | None:
    """``job``'s (epoch, checkpoint id) row (None: nothing applied); ``lock``: a locking
    clause (``FOR SHARE``)."""
    row = conn.execute(table_sql(store, "SELECT epoch, checkpoint_id FROM {t}_applied "
                                        f"WHERE job = %s {lock}"), (job,)).fetchone()
    return None if row is None else tuple(row)


@dataclass(frozen=True)
class WalCommit:
    """What one checkpoint's `apply` writes: ``epoch`` over ``parent`` (None: full)."""

    job: str
    checkpoint_id: int
    epoch: int
    parent: int | None


def apply(store: ExternalStore, conn: Any, commit: WalCommit, wals: Sequence[pa.Table]
          ) -> bool:
    """Apply ``wals`` (every subtask's WAL of ``commit.epoch``) in one transaction (module
    docstring); True: applied now, False: that epoch was applied before."""
    job = commit.job
    with conn.transaction():
        conn.execute(table_sql(store, "SELECT pg_advisory_xact_lock(hashtext('{t}' || %s))"),
                     (job,))
        current = applied_epoch(store, conn, job)
        # Epochs grow (one sequence): a newer one applied means this checkpoint's commit
        # is done or superseded (a paused driver finishing late must not go back).
        if current is not None and current >= commit.epoch:
            return False
        if commit.parent is None:
            conn.execute(table_sql(store, "DELETE FROM {t}_kv WHERE job = %s"), (job,))
        elif current != commit.parent:
            raise StateDatabaseError(
                f"checkpoint {commit.checkpoint_id} of job {job!r} applies epoch "
                f"{commit.epoch} over {commit.parent}, but {store.identity} holds epoch "
                f"{current}: nothing applied (restore from a savepoint to go back)")
        conn.execute("CREATE TEMP TABLE ckpt_wal (key_group integer, state text, key bytea, "
                     "user_key bytea, value bytea) ON COMMIT DROP")
        for wal in wals:
            copy_rows(conn, "COPY ckpt_wal FROM STDIN (FORMAT BINARY)", wal)
        params = {"job": job, "epoch": commit.epoch, "checkpoint": commit.checkpoint_id}
        for statement in _APPLY:
            conn.execute(table_sql(store, statement), params if "%(" in statement else None)
    return True


def load_current(conn: Any, read: ExternalRead, key_groups: tuple[int, int]
                 ) -> Iterator[RowGroup]:
    """Key groups [start, end] of ``read.job``'s current state, one `RowGroup` per (key
    group, state); UsageError unless the database is at ``read.version`` (checked in the
    same transaction, which holds the apply of a newer epoch off until the read ends)."""
    store, job = read.store, read.job
    with conn.transaction():
        row = _applied(store, conn, job, "FOR SHARE")
        if row is None or int(row[0]) != read.version:
            raise _not_current(read, row)
        with conn.cursor(name="ckpt_current", binary=True) as cur:
            cur.itersize = 64
            cur.execute(table_sql(store, "SELECT key_group, state, array_agg(key), "
                                         "array_agg(user_key), array_agg(value) FROM {t}_kv "
                                         "WHERE job = %s AND key_group BETWEEN %s AND %s "
                                         "GROUP BY key_group, state"),
                        (job, key_groups[0], key_groups[1]))
            yield from cur


def require_current(read: ExternalRead | None, what: str) -> None:
    """Before a read plans any work: UsageError unless a WAL-mode ``read``'s database
    holds its version (MVCC reads any committed version; None: not external)."""
    if read is None or read.mode != "wal":
        return
    with connection(read.store, what) as conn:
        row = _applied(read.store, conn, read.job)
    if row is None or int(row[0]) != read.version:
        raise _not_current(read, row)


def _not_current(read: ExternalRead, row: tuple[Any, ...] | None) -> UsageError:
    at = "nothing" if row is None else f"epoch {row[0]} (checkpoint {row[1]})"
    head = (f"state epoch {read.version} of job {read.job!r} is not the current state of "
            f"{read.store.identity} (it holds {at})")
    if row is None or int(row[0]) < read.version:
        return UsageError(f"{head}: its commit was cut short; `ckpt doctor --repair "
                          "--state-db URL` (or the job's next run) finishes it")
    return UsageError(f"{head}: WAL mode keeps only the latest applied checkpoint; restore "
                      "older state from a savepoint")
