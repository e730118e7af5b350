"""The external backend's database: keyed state as versioned rows in PostgreSQL (MVCC).

Tables (``<table>`` is `ExternalStore.table`, ``ckpt_state`` by default):

- ``<table>``: one row per written entry and epoch,
  ``(job, key_group, state, key, user_key, value, epoch)``; ``value`` NULL is a delete.
  ``key`` is the state key's encoded bytes, ``user_key`` a map state's user key (UTF-8,
  empty for other kinds), ``value`` the state codec's bytes.
- ``<table>_versions``: the committed versions of each job, ``(job, version, parent)``:
  a version is the epoch of the run attempt that wrote it (`new_epoch`: unique per
  attempt), its parent the version that run restored. A version's state is, per key,
  the newest row along its parent chain.
- ``<table>_head``: each job's committed version (what readers see).
- ``<table>_committed`` (view): every job's state at its head: the version another
  service reads, consistent with the job's latest checkpoint.

Protocol (statebackend.state.external, statebackend.job.external_commit):

1. before a run (`statebackend.job.external_commit.prepare`): `commit_version` of the
   latest checkpoint's version makes it the head (finishing a commit a crash
   interrupted: the version is recorded in ``_metadata`` first), then
   `discard_uncommitted` deletes rows of epochs no committed version names (a failed or
   discarded attempt: never visible, since no version names them);
2. the run takes a fresh epoch (`new_epoch`); each subtask writes its changed entries
   under it (`write_epoch`, one transaction per subtask, replacing what an earlier try
   of that task wrote). A fenced or zombie attempt writes under an epoch of its own,
   which no version will name;
3. the driver commits ``_metadata`` (recording the version), then `commit_version`
   adds the version and moves the head in one transaction: readers switch atomically;
4. retention keeps the versions its checkpoints name: `vacuum` deletes rows no retained
   version reads and versions outside their chains.

Restore and rescale move no state bytes: a subtask's state is `load_range` (a query of
its key groups at a version). Only this module writes SQL; identifiers are checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from statebackend.errors import StateDatabaseError, UsageError

if TYPE_CHECKING:  # Arrow only where rows are written: DAG files import this module
    import pyarrow as pa

DEFAULT_TABLE = "ckpt_state"
_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")
SCHEMES = ("postgresql", "postgres")
# One key group's rows of one state in one epoch: (key_group, state, keys, user_keys,
# values), the lists aligned (what `load_range` reads).
RowGroup = tuple[int, str, list[bytes], list[bytes], list[bytes | None]]
# (key_group, state, keys, user_keys) -> one hashable name per row (`newest`)
EntryKeys = Callable[[int, str, list[bytes], list[bytes]], Iterable[Hashable]]


@dataclass(frozen=True)
class ExternalStore:
    """Where a job's external state lives: a PostgreSQL URL and a table name.

    ``url`` may carry a password (from an Airflow connection or the option): it is never
    shown (`identity` and the repr leave it out) nor written to ``_metadata``.
    """

    url: str = field(repr=False)
    table: str = DEFAULT_TABLE

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in SCHEMES or not parts.hostname:
            raise UsageError(f"state database {self.identity!r} is not a postgresql://"
                             "user@host:port/database URL")
        if not _TABLE.match(self.table):
            raise UsageError(f"state table {self.table!r} is not a plain lower-case SQL "
                             "name (letters, digits, _)")

    @property
    def identity(self) -> str:
        """The URL without its password, then ``#table``: what records and logs name."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = (f"{parts.username}@" if parts.username else "") + host \
            + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, "", "")) + f"#{self.table}"

    def __repr__(self) -> str:
        return f"ExternalStore({self.identity!r})"

    def connect(self) -> Any:
        """A new connection (psycopg, imported here: only external runs need it)."""
        import psycopg  # the external extra: other backends never import it

        try:
            # autocommit: each `conn.transaction()` is a real transaction (not a
            # savepoint of an implicit one), reads hold no transaction open
            return psycopg.connect(self.url, connect_timeout=10, autocommit=True,
                                   application_name="ckpt-state")
        except psycopg.OperationalError as exc:
            # psycopg's text spans lines: the failure first, then a hint; keep both
            reason = "; ".join(line.strip() for line in str(exc).splitlines()
                               if line.strip()) or "refused"
            raise UsageError(f"state database {self.identity} cannot be reached: "
                             f"{reason}") from None


@dataclass(frozen=True)
class ExternalRead:
    """A job's state in ``store`` at committed ``version`` (what a restore reads)."""

    store: ExternalStore
    job: str
    version: int
    parent: int | None = None  # as its record says (read while its commit is unfinished)
    mode: str = "mvcc"  # "wal": the job's current state, which must be at ``version``


@contextmanager
def database_errors(store: ExternalStore, what: str) -> Iterator[None]:
    """A driver error of the database as one line naming ``what`` and the database."""
    import psycopg  # the external extra, as in `ExternalStore.connect`

    try:
        yield
    except psycopg.Error as exc:
        lines = str(exc).strip().splitlines()
        raise StateDatabaseError(f"{what}: state database {store.identity}: "
                                 f"{lines[0] if lines else type(exc).__name__}") from None


@contextmanager
def connection(store: ExternalStore, what: str) -> Iterator[Any]:
    """A new connection to ``store``, closed after; a driver error is one line naming
    ``what`` (`database_errors`)."""
    with database_errors(store, what):
        conn = store.connect()
        try:
            yield conn
        finally:
            conn.close()


def table_sql(store: ExternalStore, text: str) -> str:
    """``text`` with ``{t}`` as the checked table name (only `ExternalStore.table`)."""
    return text.replace("{t}", store.table)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
  job text NOT NULL, key_group integer NOT NULL, state text NOT NULL, key bytea NOT NULL,
  user_key bytea NOT NULL DEFAULT '', value bytea, epoch bigint NOT NULL,
  PRIMARY KEY (job, state, key, user_key, epoch));
CREATE INDEX IF NOT EXISTS {t}_by_epoch ON {t} (job, epoch, key_group);
DROP INDEX IF EXISTS {t}_by_group;
CREATE TABLE IF NOT EXISTS {t}_versions (
  job text NOT NULL, version bigint NOT NULL, parent bigint,
  committed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (job, version));
CREATE TABLE IF NOT EXISTS {t}_head (job text PRIMARY KEY, version bigint NOT NULL);
CREATE SEQUENCE IF NOT EXISTS {t}_epochs;
CREATE OR REPLACE VIEW {t}_committed AS
WITH RECURSIVE chain(job, version, parent) AS (
  SELECT h.job, v.version, v.parent FROM {t}_head h
    JOIN {t}_versions v ON v.job = h.job AND v.version = h.version
  UNION ALL
  SELECT c.job, v.version, v.parent FROM chain c
    JOIN {t}_versions v ON v.job = c.job AND v.version = c.parent)
SELECT job, key_group, state, key, user_key, value, epoch FROM (
  SELECT DISTINCT ON (s.job, s.state, s.key, s.user_key) s.*
  FROM {t} s JOIN chain c ON c.job = s.job AND c.version = s.epoch
  ORDER BY s.job, s.state, s.key, s.user_key, s.epoch DESC) newest
WHERE value IS NOT NULL;
"""

def ensure_schema(store: ExternalStore, conn: Any) -> None:
    """Create the tables and the view if missing (the driver, once per run)."""
    with conn.transaction():
        # One creator at a time: CREATE ... IF NOT EXISTS races on the catalog otherwise.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (store.table,))
        conn.execute(table_sql(store, _SCHEMA))


def new_epoch(store: ExternalStore, conn: Any) -> int:
    """A fresh epoch for one run attempt: never used before in this table, so a fenced
    or zombie attempt still writing can only add rows no version will ever name."""
    return int(conn.execute(table_sql(store, "SELECT nextval('{t}_epochs')")).fetchone()[0])


def head_version(store: ExternalStore, conn: Any, job: str) -> int | None:
    row = conn.execute(table_sql(store, "SELECT version FROM {t}_head WHERE job = %s"),
                       (job,)).fetchone()
    return None if row is None else int(row[0])


def versions(store: ExternalStore, conn: Any, job: str) -> dict[int, int | None]:
    """Every committed version of ``job`` -> its parent."""
    rows = conn.execute(table_sql(store, "SELECT version, parent FROM {t}_versions "
                                         "WHERE job = %s"), (job,)).fetchall()
    return {int(v): (None if p is None else int(p)) for v, p in rows}


def chain_of(all_versions: dict[int, int | None], version: int) -> list[int]:
    """``version``, its parent, its parent's parent ... (as far as recorded)."""
    out: list[int] = []
    current: int | None = version
    while current is not None and current in all_versions and current not in out:
        out.append(current)
        current = all_versions[current]
    return out


def load_range(conn: Any, read: ExternalRead, key_groups: tuple[int, int]
               ) -> Iterator[RowGroup]:
    """The rows of key groups [start, end] that ``read.version`` is made of, as one
    `RowGroup` per (epoch, key group, state): the chain's epochs oldest first, so a later
    row replaces an earlier one of the same entry and a NULL value deletes it (`newest`
    applies that). The server aggregates each group into arrays (a few Python objects
    per key group, not per row) and streams them from a server-side cursor.

    A version whose commit a crash cut short (its record is the decision,
    `statebackend.job.external_commit`) reads through the parent its record names;
    UsageError when neither says what the version reads."""
    store, job, version = read.store, read.job, read.version
    known = versions(store, conn, job)
    if version not in known and (read.parent is None or read.parent not in known):
        raise UsageError(f"state version {version} of job {job!r} is not committed in "
                         f"{store.identity} (vacuumed, or another database)")
    chain = chain_of({**known, version: known.get(version, read.parent)}, version)
    query = table_sql(store, "SELECT key_group, state, array_agg(key), array_agg(user_key), "
                             "array_agg(value) FROM {t} WHERE job = %s AND key_group BETWEEN %s "
                             "AND %s AND epoch = %s GROUP BY key_group, state")
    with conn.transaction():  # a server-side cursor lives in a transaction
        for epoch in reversed(chain):
            with conn.cursor(name=f"ckpt_load_{epoch}", binary=True) as cur:
                cur.itersize = 64
                cur.execute(query, (job, key_groups[0], key_groups[1], epoch))
                yield from cur


def _pairs(kg: int, state: str, keys: list[bytes], user_keys: list[bytes]
           ) -> Iterable[Hashable]:
    del kg, state
    return zip(keys, user_keys, strict=True)


def newest(groups: Iterable[RowGroup], entry_keys: EntryKeys = _pairs
           ) -> dict[tuple[int, str], dict[Any, bytes]]:
    """`load_range`'s groups resolved, oldest epoch first (a later row replaces an earlier
    one, a NULL deletes it): (key group, state) -> entry -> value. ``entry_keys`` names
    each row's entry (default: its (key, user_key) pair; the backend: its own key)."""
    tables: dict[tuple[int, str], dict[Any, bytes]] = {}
    for kg, state, keys, user_keys, values in groups:
        names = entry_keys(kg, state, keys, user_keys)
        entries = tables.setdefault((kg, state), {})
        if not entries and None not in values:  # the common case: one epoch, no deletes
            entries.update(zip(names, values, strict=True))  # type: ignore[arg-type]
            continue
        for name, value in zip(names, values, strict=True):
            if value is None:
                entries.pop(name, None)
            else:
                entries[name] = value
    return tables


def write_epoch(store: ExternalStore, conn: Any, job: str, epoch: int,
                key_groups: tuple[int, int], rows: pa.Table) -> int:
    """Pre-commit: replace what ``epoch`` holds in key groups [start, end] with ``rows``
    (`ROWS_SCHEMA`; a retried subtask overwrites its earlier attempt), in one
    transaction; returns the rows written. Invisible to readers until `commit_version`
    names the epoch."""
    # Arrow and NumPy only where rows are written (DAG files import this module)
    from statebackend.state.external_rows import copy_rows
    from statebackend.state.pg_copy import Constant

    with conn.transaction():
        conn.execute(table_sql(store, "DELETE FROM {t} WHERE job = %s AND epoch = %s AND "
                                      "key_group BETWEEN %s AND %s"),
                     (job, epoch, key_groups[0], key_groups[1]))
        copy_rows(conn, table_sql(store, "COPY {t} (job, key_group, state, key, user_key, "
                                         "value, epoch) FROM STDIN (FORMAT BINARY)"),
                  rows, before=[Constant(job, "text")], after=[Constant(epoch, "int8")])
    return int(rows.num_rows)


def commit_version(store: ExternalStore, conn: Any, job: str, version: int,
                   parent: int | None) -> bool:
    """Name ``version`` (its rows become a version) and make it the head unless a newer
    version is, in one transaction; idempotent (True: this call added the version)."""
    with conn.transaction():
        added = conn.execute(
            table_sql(store, "INSERT INTO {t}_versions (job, version, parent) VALUES (%s, %s, %s) "
                             "ON CONFLICT DO NOTHING"), (job, version, parent)).rowcount
        # Epochs grow (one sequence): the head only moves forward, so a paused driver
        # finishing its commit late never takes readers back to an older version.
        conn.execute(table_sql(store, "INSERT INTO {t}_head (job, version) VALUES (%s, %s) "
                                      "ON CONFLICT (job) DO UPDATE SET version = "
                                      "EXCLUDED.version WHERE {t}_head.version < "
                                      "EXCLUDED.version"), (job, version))
    return bool(added)


# The distinct epochs of a job's rows, one probe of ``{t}_by_epoch`` each (a loose index
# scan: PostgreSQL has no skip scan), those no committed version names
_UNCOMMITTED_EPOCHS = """
WITH RECURSIVE epochs(epoch) AS (
  SELECT min(epoch) FROM {t} WHERE job = %(job)s
  UNION ALL
  SELECT (SELECT min(s.epoch) FROM {t} s WHERE s.job = %(job)s AND s.epoch > e.epoch)
  FROM epochs e WHERE e.epoch IS NOT NULL)
SELECT e.epoch FROM epochs e WHERE e.epoch IS NOT NULL AND NOT EXISTS (
  SELECT 1 FROM {t}_versions v WHERE v.job = %(job)s AND v.version = e.epoch)"""


def discard_uncommitted(store: ExternalStore, conn: Any, job: str) -> int:
    """Delete the rows of epochs no committed version names; returns the rows deleted.
    Before every run: its cost is the job's epochs and the rows deleted, not the rows
    kept (a scan of every row took 0.15 s a run at 1.2M rows)."""
    with conn.transaction():
        epochs = [int(row[0]) for row in conn.execute(
            table_sql(store, _UNCOMMITTED_EPOCHS), {"job": job}).fetchall()]
        if not epochs:
            return 0
        # (the versions checked again: one committed meanwhile keeps its rows)
        return int(conn.execute(table_sql(store, """
            DELETE FROM {t} s WHERE s.job = %(job)s AND s.epoch = ANY(%(epochs)s)
              AND NOT EXISTS (SELECT 1 FROM {t}_versions v WHERE v.job = %(job)s
                              AND v.version = s.epoch)"""),
            {"job": job, "epochs": epochs}).rowcount)


@dataclass(frozen=True)
class VacuumResult:
    rows_deleted: int
    versions_deleted: tuple[int, ...]


def vacuum(store: ExternalStore, conn: Any, job: str, retained: Mapping[int, int | None]
           ) -> VacuumResult:
    """Keep what the ``retained`` versions (version -> parent, from the records) read:
    each one's newest row per key along its chain; delete every other committed row
    and the versions outside their chains. A retained version whose commit a crash
    left unfinished keeps its chain through the parent its record names."""
    known = versions(store, conn, job)
    chains = {**{v: p for v, p in retained.items() if v not in known}, **known}
    pairs = [(root, v) for root in sorted(retained) for v in chain_of(chains, root)]
    keep = {v for _, v in pairs}
    head = head_version(store, conn, job)
    if head is not None and head not in retained:  # readers' version stays readable
        pairs += [(head, v) for v in chain_of(chains, head)]
        keep |= {v for _, v in pairs}
    with conn.transaction():
        conn.execute("CREATE TEMP TABLE ckpt_keep (root bigint, version bigint) "
                     "ON COMMIT DROP")
        with conn.cursor() as cur, cur.copy("COPY ckpt_keep FROM STDIN") as copy:
            for pair in pairs:
                copy.write_row(pair)
        deleted = int(conn.execute(table_sql(store, """
            DELETE FROM {t} s WHERE s.job = %(job)s
              AND EXISTS (SELECT 1 FROM {t}_versions v WHERE v.job = %(job)s
                          AND v.version = s.epoch)
              AND NOT EXISTS (
                SELECT 1 FROM ckpt_keep k WHERE k.version = s.epoch AND NOT EXISTS (
                  SELECT 1 FROM {t} n JOIN ckpt_keep k2 ON k2.root = k.root
                    AND k2.version = n.epoch
                  WHERE n.job = s.job AND n.state = s.state AND n.key = s.key
                    AND n.user_key = s.user_key AND n.epoch > s.epoch))"""),
            {"job": job}).rowcount)
        dropped = sorted(set(known) - keep)
        conn.execute(table_sql(store, "DELETE FROM {t}_versions WHERE job = %s AND "
                                      "version = ANY(%s)"), (job, dropped))
    return VacuumResult(deleted, tuple(dropped))
