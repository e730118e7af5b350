"""The external backend: a subtask's state kept in a database, written per epoch (MVCC).

`ExternalStateBackend` is a `MemoryStateBackend` (statebackend.state.memory) whose
tables remember every key written since the last snapshot (`ExternalTable`): the state
kinds, timers, TTL and migrations run unchanged on it, reads are dictionary lookups.

- **Restore** is a query: `load_version` reads the subtask's key groups at the parent
  checkpoint's version (`statebackend.state.external_store.load_range`). Nothing is
  downloaded from checkpoint storage; an instance this process closed at exactly that
  version is adopted instead (the memory backend's ``local-instance``).
- **Snapshot** is the pre-commit: the entries written since the last snapshot (deleted
  ones as NULL rows) go to the database under the run's epoch (`write_epoch`, one
  transaction). The snapshot has no files; its handle names only the key groups.
  The epoch becomes visible when the driver commits it (`external_store.commit_version`)
  after ``_metadata``: a failed attempt's rows are never read and are deleted.
- **WAL mode** (statebackend.state.external_wal): a restore reads the job's current
  state (`load_current`); the snapshot writes those entries to a WAL file instead, which
  the driver applies to the database after ``_metadata``.

`attach` gives the instance its database, the epoch it writes (the run attempt's,
`statebackend.job.external_commit`) and the mode; an instance without an epoch (a
read-only restore) cannot snapshot.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import UsageError
from statebackend.state.backend import LocalSnapshot
from statebackend.state.codecs import map_key_suffix, split_map_key
from statebackend.state.external_rows import ROWS_SCHEMA
from statebackend.state.external_store import (
    ExternalRead,
    ExternalStore,
    database_errors,
    load_range,
    newest,
    write_epoch,
)
from statebackend.state.external_wal import is_wal_file, load_current, wal_name, write_wal
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.memory import MemoryStateBackend
from statebackend.state.memory_table import MemoryTable, key_group_prefix_of


class ExternalTable(MemoryTable):
    """A `MemoryTable` that remembers the keys written since the last snapshot."""

    def __init__(self, name: str, account: Any) -> None:
        super().__init__(name, account)
        self.written: set[bytes] = set()

    def write_columns(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        self.written.update(keys)
        super().write_columns(keys, values)

    def put_one(self, key: bytes, value: bytes) -> None:
        self.written.add(key)
        super().put_one(key, value)

    def delete_many(self, keys: Sequence[bytes]) -> None:  # `delete` too
        self.written.update(keys)
        super().delete_many(keys)

    def drop_part(self, prefix: bytes) -> None:
        self.written.update(self.sorted_keys(prefix))
        super().drop_part(prefix)


class ExternalStateBackend(MemoryStateBackend):
    """Keyed state of one subtask, kept in an external database (module docstring)."""

    kind = "external"
    table_class = ExternalTable
    record_tables = False  # every table remembers its written keys (ExternalTable)
    timer_keys_index = False  # and so does ``_timer_keys``: its rows are the database's

    def _open_instance(self, read_only: bool) -> None:
        self.store: ExternalStore | None = None
        self.job_key = ""
        self.epoch: int | None = None
        self.mode = "mvcc"
        self._conn: Any = None
        self._dropped: list[ExternalTable] = []  # dropped families: their keys are deleted
        super()._open_instance(read_only)

    def load_files(self, names: Iterable[str]) -> None:
        if list(names):
            raise UsageError(f"{self.label}: the external backend keeps no state files")

    # -- database ------------------------------------------------------------------
    def attach(self, store: ExternalStore, job_key: str, epoch: int | None = None,
               mode: str = "mvcc") -> ExternalStateBackend:
        """Use ``store`` for ``job_key``'s rows; snapshots write under ``epoch`` (in WAL
        ``mode``: to a WAL file)."""
        if self.store is not None and self.store.identity != store.identity:
            raise UsageError(f"{self.label} is kept in {self.store.identity}, not "
                             f"{store.identity}")
        self.store, self.job_key, self.epoch, self.mode = store, job_key, epoch, mode
        return self

    def is_shared_file(self, name: str) -> bool:
        return is_wal_file(name) or super().is_shared_file(name)

    def _database(self) -> tuple[ExternalStore, Any]:
        """The attached database and this instance's connection to it (opened once)."""
        if self.store is None:
            raise UsageError(f"{self.label} is not attached to its state database")
        if self._conn is None or self._conn.closed:
            self._conn = self.store.connect()
        return self.store, self._conn

    def load_version(self, read: ExternalRead) -> int:
        """Fill the tables with this subtask's key groups at ``read.version`` (a restore,
        not a change); returns the entries read. Local state is replaced."""
        self.attach(read.store, read.job, mode=read.mode)
        for table in self._cfs.values():
            for prefix in table.key_group_prefixes():
                table.load(prefix, (), ())
        kgr = self.key_group_range
        entries = 0
        store, conn = self._database()
        with database_errors(store, f"restoring {self.label}"):
            groups = (load_current if read.mode == "wal" else load_range)(
                conn, read, (kgr.start, kgr.end))
            for (kg, state), table in newest(groups, self._backend_keys).items():
                ordered = sorted(table)
                self._table(state).load(key_group_prefix(kg), ordered,
                                        [table[k] for k in ordered])
                entries += len(ordered)
        self._mark_clean()
        return entries

    def _backend_keys(self, kg: int, state: str, keys: list[bytes], user_keys: list[bytes]
                      ) -> list[bytes]:
        """The backend keys of one `RowGroup`'s rows (key-group prefix first)."""
        prefix = key_group_prefix(kg)
        if not self._is_map(state):
            return [prefix + k for k in keys]
        return [prefix + map_key_suffix(k, u.decode("utf-8"))
                for k, u in zip(keys, user_keys, strict=True)]

    def _mark_clean(self) -> None:
        """What the tables hold is in the database: nothing written since."""
        for table in self._cfs.values():
            table.written.clear()
        self._dropped.clear()
        self.account.changed.clear()

    def drop_column_family(self, name: str) -> None:
        table = self._cfs.get(name)
        super().drop_column_family(name)
        if isinstance(table, ExternalTable) and name not in self._cfs:
            self._dropped.append(table)

    def _is_map(self, state: str) -> bool:
        descriptor = self.descriptors.get(state)
        return descriptor is not None and descriptor.kind == "map"

    # -- snapshot ------------------------------------------------------------------------
    def take_local_snapshot(self, count_rows: bool = True) -> LocalSnapshot:
        """Pre-commit: write the entries changed since the last snapshot under the epoch
        (WAL mode: to the snapshot's WAL file)."""
        if self.read_only or self.epoch is None:
            raise UsageError(f"{self.label} is read-only or has no epoch: it cannot snapshot")
        files: tuple[tuple[str, int], ...] = ()
        if self.mode == "wal":
            files = (self._write_wal(),)
        else:
            kgr = self.key_group_range
            store, conn = self._database()
            with database_errors(store, f"pre-commit of {self.label}"):
                write_epoch(store, conn, self.job_key, self.epoch, (kgr.start, kgr.end),
                            self._changed_rows())
        self._mark_clean()
        snapshot_id = uuid.uuid4().hex
        rows = self.count_rows() if count_rows else {}
        self._dirty = False
        self._last_snapshot_id = snapshot_id
        return LocalSnapshot(snapshot_id, self.files_path, files, rows)

    def _write_wal(self) -> tuple[str, int]:
        """This epoch's changes as a WAL file in ``files_path``, the only file there."""
        os.makedirs(self.files_path, exist_ok=True)
        for entry in os.scandir(self.files_path):
            os.unlink(entry.path)
        kgr = self.key_group_range
        name = wal_name(self.epoch or 0, (kgr.start, kgr.end))
        path = os.path.join(self.files_path, name)
        write_wal(path, self._changed_rows())
        return name, os.path.getsize(path)

    def _changed_rows(self) -> pa.Table:
        """The entries written since the last snapshot (`ROWS_SCHEMA`; value null: deleted),
        per table in key order: column-wise, but for a map state's keys (split one by one)."""
        parts = []
        for table in (*self._dropped, *(self._cfs[n] for n in self._cf_names)):
            if not table.written:
                continue
            raw = sorted(table.written)
            groups = np.frombuffer(b"".join(map(key_group_prefix_of, raw)), ">u2").astype(np.int32)
            if self._is_map(table.name):
                keys, user_keys = (pa.array(c, pa.binary()) for c in
                                   zip(*(_split(k, True) for k in raw), strict=True))
            else:
                # (an explicit stop: without one pyarrow 26 fails, "negative buffer resize")
                keys = pc.binary_slice(pa.array(raw, pa.binary()), 2, max(map(len, raw)))
                user_keys = pa.array([b""] * len(raw), pa.binary())
            parts.append(pa.Table.from_arrays(
                [pa.array(groups), pa.array([table.name] * len(raw), pa.string()), keys,
                 user_keys, pa.array(list(map(table.data.get, raw)), pa.binary())],
                schema=ROWS_SCHEMA))
        return pa.concat_tables(parts) if parts else ROWS_SCHEMA.empty_table()

    def close(self) -> None:
        super().close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _split(raw: bytes, is_map: bool) -> tuple[bytes, bytes]:
    """A backend key (key-group prefix first) as the table's (key, user_key)."""
    if not is_map:
        return raw[2:], b""
    key, user_key = split_map_key(raw[2:])
    return key, user_key.encode("utf-8")
