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

`attach` gives the instance its database and the epoch it writes (the run's checkpoint
id); an instance without one (a read-only restore) cannot snapshot.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from statebackend.errors import UsageError
from statebackend.state.backend import LocalSnapshot
from statebackend.state.codecs import map_key_suffix, split_map_key
from statebackend.state.external_store import (
    ExternalRead,
    ExternalStore,
    Row,
    RowGroup,
    database_errors,
    load_range,
    write_epoch,
)
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.memory import MemoryStateBackend
from statebackend.state.memory_table import MemoryTable


class ExternalTable(MemoryTable):
    """A `MemoryTable` that remembers the keys written since the last snapshot."""

    def __init__(self, name: str, account: Any) -> None:
        super().__init__(name, account)
        self.written: set[bytes] = set()

    def write_many(self, puts: Iterable[tuple[bytes, bytes]], deletes: Iterable[bytes] = ()
                   ) -> None:
        puts = puts if isinstance(puts, list) else list(puts)
        self.written.update(k for k, _ in puts)
        super().write_many(puts, deletes)

    def delete(self, key: bytes) -> None:
        self.written.add(key)
        super().delete(key)

    def drop_part(self, prefix: bytes) -> None:
        self.written.update(self.parts.get(prefix, ()))
        super().drop_part(prefix)


class ExternalStateBackend(MemoryStateBackend):
    """Keyed state of one subtask, kept in an external database (module docstring)."""

    kind = "external"
    table_class = ExternalTable

    def _open_instance(self, read_only: bool) -> None:
        self.store: ExternalStore | None = None
        self.job_key = ""
        self.epoch: int | None = None
        self.version: int | None = None  # the committed version this state is
        self._conn: Any = None
        self._dropped: list[ExternalTable] = []  # dropped families: their keys are deleted
        super()._open_instance(read_only)

    def load_files(self, names: Iterable[str]) -> None:
        if list(names):
            raise UsageError(f"{self.label}: the external backend keeps no state files")

    # -- database ------------------------------------------------------------------
    def attach(self, store: ExternalStore, job_key: str, epoch: int | None = None
               ) -> ExternalStateBackend:
        """Use ``store`` for ``job_key``'s rows; snapshots write under ``epoch``."""
        if self.store is not None and self.store.identity != store.identity:
            raise UsageError(f"{self.label} is kept in {self.store.identity}, not "
                             f"{store.identity}")
        self.store, self.job_key, self.epoch = store, job_key, epoch
        return self

    def _connection(self) -> Any:
        if self.store is None:
            raise UsageError(f"{self.label} is not attached to its state database")
        if self._conn is None or self._conn.closed:
            self._conn = self.store.connect()
        return self._conn

    def load_version(self, read: ExternalRead) -> int:
        """Fill the tables with this subtask's key groups at ``read.version`` (a restore,
        not a change); returns the entries read. Local state is replaced."""
        self.attach(read.store, read.job)
        for table in self._cfs.values():
            for prefix in list(table.parts):
                table.load(prefix, (), ())
        kgr = self.key_group_range
        entries = 0
        with database_errors(read.store, f"restoring {self.label}"):
            rows = load_range(self._connection(), read, (kgr.start, kgr.end))
            for (state, prefix), keys, values in _grouped(rows, self._is_map):
                self._table(state).load(prefix, keys, values)
                entries += len(keys)
        for table in self._cfs.values():
            table.written.clear()
        self.account.changed.clear()
        self.version = read.version
        return entries

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
        """Pre-commit: write the entries changed since the last snapshot under the epoch."""
        if self.read_only or self.epoch is None:
            raise UsageError(f"{self.label} is read-only or has no epoch: it cannot snapshot")
        kgr = self.key_group_range
        with database_errors(self._store(), f"pre-commit of {self.label}"):
            write_epoch(self._store(), self._connection(), self.job_key, self.epoch,
                        (kgr.start, kgr.end), self._changed_rows())
        for table in self._cfs.values():
            table.written.clear()
        self._dropped.clear()
        self.account.changed.clear()
        snapshot_id = uuid.uuid4().hex
        rows = self.count_rows() if count_rows else {}
        self._dirty = False
        self._last_snapshot_id = snapshot_id
        self.version = self.epoch
        return LocalSnapshot(snapshot_id, self.files_path, (), rows)

    def _store(self) -> ExternalStore:
        assert self.store is not None
        return self.store

    def _changed_rows(self) -> Iterator[Row]:
        tables = [*self._dropped, *(self._cfs[n] for n in self._cf_names)]
        for table in tables:
            name = table.name
            is_map = self._is_map(name)
            for raw in sorted(table.written):
                key, user_key = _split(raw, is_map)
                yield int.from_bytes(raw[:2], "big"), name, key, user_key, table.get(raw)

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


def _joined(prefix: bytes, key: bytes, user_key: bytes, is_map: bool) -> bytes:
    return prefix + (map_key_suffix(key, user_key.decode("utf-8")) if is_map else key)


def _grouped(groups: Iterable[RowGroup], is_map: Any
             ) -> Iterator[tuple[tuple[str, bytes], list[bytes], list[bytes]]]:
    """`load_range`'s groups (oldest epoch first: a later row replaces, a NULL deletes)
    as sorted (keys, values) per (state, key-group prefix)."""
    tables: dict[tuple[str, bytes], dict[bytes, bytes]] = {}
    for kg, state, keys, user_keys, values in groups:
        prefix = key_group_prefix(kg)
        raws = [_joined(prefix, k, u, True) for k, u in zip(keys, user_keys, strict=True)] \
            if is_map(state) else [prefix + k for k in keys]
        entries = tables.setdefault((state, prefix), {})
        if not entries and None not in values:  # the common case: one epoch, no deletes
            entries.update(zip(raws, values, strict=True))  # type: ignore[arg-type]
            continue
        for raw, value in zip(raws, values, strict=True):
            if value is None:
                entries.pop(raw, None)
            else:
                entries[raw] = value
    for table_key, entries in tables.items():
        ordered = sorted(entries)
        yield table_key, ordered, [entries[k] for k in ordered]
