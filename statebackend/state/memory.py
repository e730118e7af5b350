"""The memory backend: keyed state in hash tables, snapshots of the changed key groups.

`MemoryStateBackend` is a `KeyedStateBackend` whose column families are `MemoryTable`s
(statebackend.state.memory_table): the state kinds, timers, TTL, migrations and scans run
unchanged on it, without RocksDB calls on the hot path.

Snapshots are incremental by key group. Every write marks its key group changed; a
snapshot writes the *changed* key groups' entries of every column family into one new
immutable file, a *segment*, and names again the segments that still serve the other
key groups. Each reference says which key groups this subtask reads from the segment
and their entries per state (`FileRef.key_groups`): a key group is served by exactly
one segment of a handle, the newest that wrote it. So a checkpoint uploads one file per
subtask holding only the key groups written since the last one, every file is a shared
file (GC, retention, savepoints and the manifest treat it like an SST), and:

- restore reads each segment and takes the key groups the handle says it serves;
- rescale moves whole segments: a new subtask's handle names the segments serving its
  key groups, with those key groups only; nothing is clipped or rewritten (a segment
  may then serve two subtasks, each its own key groups);
- compaction: a segment whose served entries fall under half of what it holds (its
  other key groups were written again since) has its served key groups written again
  into the next segment, so it is no longer referenced and stored bytes stay within
  about twice the state's.

One file per snapshot rather than one per key group: a file's fixed costs (create,
upload, four facts in the commit record) were most of a warm run's snapshot.

Files named ``kg-<key group:05d>-<id>.kgs`` (written before segments, one key group
each) are read the same way: such a file serves the key group of its name.

File format (``seg-<id>.kgs``): `statebackend.state.memory_files`, entries in key order
(so by key group), ZSTD compressed (none with the job's ``compression="none"``).
Reading it parses lengths and bytes and never runs code from storage.

An instance opened from stored files (``origin.file_paths``: the handle's files, already
in ``files/``) loads them at construction. The local folder keeps the files of the
current and the previous snapshot (``files/``): a restore on the same machine reads
those instead of downloading them. Better still, an instance closed exactly at its last
snapshot stays in this process (up to `LIVE_BYTES` in all): a restore of that snapshot
here (the local engine's next run, a reused Spark Python worker) adopts it and reads
nothing (``local-instance``).

Memory is bounded (`set_memory_limit`): a write that takes the state past the limit
fails at once with `StateMemoryLimitError` naming the limit; nothing swaps or spills.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from statebackend.errors import CorruptStateError, UsageError
from statebackend.state import memory_files
from statebackend.state.backend import KeyedStateBackend, LocalSnapshot
from statebackend.state.codecs import RecordCodec
from statebackend.state.families import INTERNAL_STATES, TIMER_KEYS, TIMERS
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.kinds import internal_descriptor
from statebackend.state.memory_records import RecordTable
from statebackend.state.memory_table import MemoryAccount, MemoryTable, MemoryWriteBatch
from statebackend.state.memory_timer_keys import TimerKeysIndex

FILES_DIR = "files"
SUFFIX = ".kgs"
# kg-<key group>-<id>.kgs: one key group (written before segments); seg-<id>.kgs: a segment
_NAME = re.compile(r"^(?:kg-(\d{5})-[0-9a-f]{12}|seg-[0-9a-f]{16})\.kgs$")
# The file codec per job compression (Job.compression): ZSTD but for "none".
_CODEC = {None: "zstd", "lz4": "zstd", "snappy": "zstd", "zstd": "zstd", "none": None}
# A segment whose key groups still read from it hold under this share of its entries is
# compacted: those key groups are written again into the next segment (module docstring).
COMPACT_BELOW = 0.5

Rows = tuple[tuple[str, int], ...]  # (state, entries), by state name


def served_key_groups(name: str, key_groups: Sequence[int] = ()) -> tuple[int, ...]:
    """The key groups read from memory-backend file ``name``: ``key_groups`` (a
    segment's, from its FileRef), or the one a key-group file's name says."""
    m = _NAME.match(name)
    if m is None:
        raise CorruptStateError(f"{name!r} is not a memory-backend file "
                                "(seg-<id>.kgs or kg-<key group>-<id>.kgs)")
    if m.group(1) is not None:
        return (int(m.group(1)),)
    if not key_groups:
        raise CorruptStateError(f"segment {name!r} is referenced without its key groups")
    return tuple(key_groups)


def key_group_sections(name: str, data: bytes, key_groups: Sequence[int], where: str,
                       label: str) -> tuple[list[tuple[str, int, pa.Array, pa.Array]], int]:
    """(state, key group, keys, values) of each of ``key_groups`` (each at least once,
    by state) in file ``name`` (bytes ``data``; ``where`` and ``label`` name it in
    errors), with the file's entries in all; CorruptStateError unless it decodes,
    its entries are in key order and it holds every key group asked for (a
    key-group file: only its own key group)."""
    try:
        families = memory_files.decode_arrays(data)
    except ValueError as exc:
        raise CorruptStateError(f"{where}: not a readable key-group file of {label}: "
                                f"{exc}") from exc
    wanted = sorted(set(key_groups))
    whole = name.startswith("kg-")  # a key-group file holds its own key group only
    sections = []
    total = 0
    for family, keys, values in families:
        total += len(keys)
        groups = _key_groups_of(keys, where, label)
        if len(groups) and (groups[1:] < groups[:-1]).any():
            raise CorruptStateError(f"{where}: entries out of key order ({label})")
        if whole and len(groups) and (groups[0] != wanted[0] or groups[-1] != wanted[0]):
            raise CorruptStateError(f"{where}: holds keys outside key group {wanted[0]} "
                                    f"({label})")
        starts = groups.searchsorted(wanted, "left")
        ends = groups.searchsorted(wanted, "right")
        for kg, lo, hi in zip(wanted, starts.tolist(), ends.tolist(), strict=True):
            if hi > lo:
                sections.append((family, kg, keys.slice(lo, hi - lo),
                                 values.slice(lo, hi - lo)))
    missing = set(wanted) - {kg for _, kg, _, _ in sections}
    if missing:
        raise CorruptStateError(f"{where}: holds no entry of key group {min(missing)}, "
                                f"which {label} reads from it")
    return sections, total


def _key_groups_of(keys: pa.Array, where: str, label: str) -> Any:
    """Each key's key group (its 2-byte prefix) as a NumPy array."""
    import numpy as np

    n = len(keys)
    if not n:
        return np.zeros(0, np.int64)
    _, offsets_buf, data_buf = keys.buffers()
    offsets = np.frombuffer(offsets_buf, np.int32, n + 1, keys.offset * 4)
    if data_buf is None or (offsets[1:] - offsets[:-1] < 2).any():
        raise CorruptStateError(f"{where}: a key without its key-group prefix ({label})")
    data = np.frombuffer(data_buf, np.uint8)
    starts = offsets[:-1]
    return data[starts].astype(np.int64) * 256 + data[starts + 1]


class MemoryStateBackend(KeyedStateBackend):
    """Keyed state of one subtask in memory (module docstring)."""

    kind = "memory"
    files_dir = FILES_DIR
    table_class: type[MemoryTable] = MemoryTable  # one per column family
    record_tables = True  # a record value state without TTL: a RecordTable (its rows)
    timer_keys_index = True  # ``_timer_keys`` derived from ``_timers`` until read

    def _open_instance(self, read_only: bool) -> None:
        del read_only  # nothing on disk is opened: a read-only instance just never snapshots
        self.account = MemoryAccount(None, self.label)
        self._cfs = self._new_tables(self.descriptors, {})
        self._cf_names = sorted(self._cfs)
        self._handles = self._cfs
        self.compression: str | None = None
        self._db = None
        self._open = True
        self._files = _Files()
        self._previous_files: set[str] = set()  # the previous snapshot's
        os.makedirs(self.files_path, exist_ok=True)
        live = None if self.read_only else _take_live(self.local_dir, self._last_snapshot_id)
        if live is not None:  # this process closed that very snapshot's state: adopt it
            self.account, self._files = live.account, live.files
            self.account.label = self.label
            self._cfs = self._handles = self._adopted(live.tables)
            self._cf_names = sorted(self._cfs)
            for name in set(self._cfs) & set(INTERNAL_STATES):
                self.descriptors.setdefault(name, internal_descriptor(name))
            self._previous_files = self._files.current()
            return
        # A stored instance (restore, validation, dump) is the files its handle names,
        # already placed in files/ (statebackend.checkpoint.restore).
        self.load_files(self.file_paths)

    @property
    def files_path(self) -> str:
        return os.path.join(self.local_dir, self.files_dir)

    @property
    def db(self) -> Any:
        raise UsageError(f"{self.label} is in memory: it has no RocksDB instance")

    def compact_range(self, cf_name: str, lower: bytes | None = None,
                      upper: bytes | None = None, options: Any = None) -> None:
        """Nothing to compact: a table holds one version per key and no tombstone."""

    def set_memory_limit(self, limit_mb: int | None) -> MemoryStateBackend:
        """Fail writes past ``limit_mb`` MiB of state (None: unbounded); returns self."""
        self.account.limit_bytes = None if limit_mb is None else int(limit_mb) * 2**20
        self.account.check()
        return self

    @property
    def memory_bytes(self) -> int:
        """The state's size in memory, as the limit counts it."""
        return self.account.bytes

    def write_batch(self) -> Any:
        return MemoryWriteBatch()

    # ``changes`` (row counts) are not needed: a table's count is its length
    def write(self, batch: Any, changes: Mapping[str, int] | None = None) -> None:
        self._dirty = True
        self.writes += 1  # the state kinds' reads know what they read is current
        batch.apply(self.account)

    def write_pairs(self, handle: Any, puts: Iterable[tuple[bytes, bytes]],
                    deletes: Iterable[bytes] = (),
                    changes: Mapping[str, int] | None = None) -> None:
        self._dirty = True
        self.writes += 1
        handle.write_many(puts, deletes)

    def write_columns(self, handle: Any, keys: Sequence[bytes], values: Sequence[bytes],
                      changes: Mapping[str, int] | None = None) -> None:
        self._dirty = True
        self.writes += 1
        handle.write_columns(keys, values)

    def write_keys(self, families: Sequence[tuple[Any, Sequence[bytes]]], *,
                   delete: bool = False) -> None:
        self._dirty = True
        self.writes += 1
        for table, keys in families:
            if not keys:
                continue
            if delete:
                table.delete_many(keys)
            else:
                table.write_columns(keys, [b""] * len(keys))

    def is_shared_file(self, name: str) -> bool:
        return name.endswith(SUFFIX)

    @property
    def keeps_timer_keys(self) -> bool:
        index = self._cfs.get(TIMER_KEYS)
        return not isinstance(index, TimerKeysIndex) or index.built

    def ensure_family(self, name: str) -> None:
        if name not in self._cfs:
            self._cfs = self._new_tables([name], self._cfs)
            self._cf_names = sorted(self._cfs)

    def _record_dtype(self, name: str) -> np.dtype | None:
        """The records family ``name`` holds as rows (a RecordTable), or None."""
        desc = self.descriptors.get(name)
        if self.record_tables and desc is not None and desc.kind == "value" \
                and desc.ttl is None and isinstance(desc.codec, RecordCodec):
            return desc.codec.dtype
        return None

    def _new_tables(self, names: Iterable[str], tables: dict[str, MemoryTable]
                    ) -> dict[str, MemoryTable]:
        """``tables`` and a new table for each of ``names``: the timers' index after the
        timers' table, which it reads (`TimerKeysIndex`)."""
        out = dict(tables)
        wanted = set(names) | ({TIMERS} if TIMER_KEYS in names else set())
        for name in sorted(wanted - out.keys(), key=lambda n: n == TIMER_KEYS):
            out[name] = self._new_table(name, out)
            if name in INTERNAL_STATES:
                self.descriptors.setdefault(name, internal_descriptor(name))
        return out

    def _new_table(self, name: str, tables: Mapping[str, MemoryTable]) -> MemoryTable:
        if name == TIMER_KEYS and self.timer_keys_index:
            return TimerKeysIndex(name, self.account, tables[TIMERS])
        dtype = self._record_dtype(name)
        if dtype is None:
            return self.table_class(name, self.account)
        return RecordTable(name, self.account, dtype)

    def _adopted(self, tables: dict[str, MemoryTable]) -> dict[str, MemoryTable]:
        """A live instance's tables as this backend's states want them: the job may have
        changed since (a state added; a record layout changed, which the migration
        rewrites next): a table of the wrong kind moves its entries into a new one."""
        out = self._new_tables(self.descriptors, tables)
        for name, table in tables.items():
            if getattr(table, "dtype", None) == self._record_dtype(name):
                continue
            out[name] = fresh = self._new_table(name, out)
            for prefix in table.key_group_prefixes():
                keys = list(table.sorted_keys(prefix))
                values = table.get(keys)
                table.drop_part(prefix)  # first: one account counts each entry once
                fresh.load(prefix, keys, values)
        return out

    def read_records(self, handle: Any, keys: list[bytes], dtype: np.dtype
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        if isinstance(handle, RecordTable):
            return handle.read_records(keys, dtype)
        return None

    def write_records(self, handle: Any, keys: list[bytes], records: np.ndarray) -> bool:
        if not isinstance(handle, RecordTable):
            return False
        self._dirty = True
        self.writes += 1
        return handle.write_records(keys, records)

    def _table(self, name: str) -> MemoryTable:
        self.ensure_family(name)
        table: MemoryTable = self._cfs[name]
        return table

    def drop_column_family(self, name: str) -> None:
        if name in self.descriptors and not self.descriptors[name].internal:
            raise UsageError(f"state {name!r} is declared: it cannot be dropped")
        table = self._cfs.pop(name, None)
        if table is None:
            return
        self._states.pop(name, None)
        self._cf_names.remove(name)
        for prefix in table.key_group_prefixes():
            table.drop_part(prefix)
            self.account.changed.add(prefix)
        self._dirty = True
        self.writes += 1

    # -- files ---------------------------------------------------------------------
    def load_files(self, names: Iterable[str]) -> None:
        """Fill the tables from the key groups each file in ``files/`` serves (a
        restore: ``file_key_groups``, or a key-group file's own)."""
        for name in names:
            served = served_key_groups(name, self.file_key_groups.get(name, ()))
            path = os.path.join(self.files_path, name)
            where = self.file_paths.get(name, path)
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError as exc:
                raise CorruptStateError(f"{where}: not a readable key-group file of "
                                        f"{self.label}: {exc}") from exc
            sections, total = key_group_sections(name, data, served, where, self.label)
            rows: dict[int, list[tuple[str, int]]] = {kg: [] for kg in served}
            for family, kg, keys, values in sections:
                self._table(family).load(key_group_prefix(kg), keys.to_pylist(),
                                         values.to_pylist())
                rows[kg].append((family, len(keys)))
            self._files.add(name, len(data), total,
                            {key_group_prefix(kg): tuple(sorted(r)) for kg, r in rows.items()})
        self._previous_files = self._files.current()

    def _write_segment(self, prefixes: list[bytes], spare: list[str]
                       ) -> tuple[str, int, int, dict[bytes, Rows]] | None:
        """Write key groups ``prefixes`` (in order) into one new segment, into a file of
        ``spare`` renamed when there is one (`take_local_snapshot`); (name, size,
        entries, rows of each non-empty key group), None when all are empty."""
        families = []
        rows: dict[bytes, list[tuple[str, int]]] = {}
        for name in self._cf_names:
            keys, values, counts = self._cfs[name].ordered_entries(prefixes)
            for prefix, n in counts.items():
                rows.setdefault(prefix, []).append((name, n))
            if keys:
                families.append((name, keys, values))
        if not families:
            return None
        file_name = f"seg-{uuid.uuid4().hex[:16]}{SUFFIX}"
        data = memory_files.encode(families, _CODEC[self.compression])
        path = os.path.join(self.files_path, file_name)
        mode = "wb"
        if spare:
            os.replace(spare.pop(), path)
            mode = "r+b"  # overwritten in place, then cut: no blocks freed and taken again
        with open(path, mode) as fh:
            fh.write(data)
            fh.truncate()
        entries = sum(len(keys) for _, keys, _ in families)
        return file_name, len(data), entries, {p: tuple(r) for p, r in rows.items()}

    # -- snapshot --------------------------------------------------------------------
    def take_local_snapshot(self, count_rows: bool = True) -> LocalSnapshot:
        """Write the key groups changed since the last snapshot (and those of segments
        mostly rewritten since: compaction) into one segment; name the other segments."""
        if self.read_only:
            raise UsageError(f"{self.label} is read-only: it cannot snapshot")
        # Files neither the state nor the previous snapshot names are rewritten as this
        # snapshot's new files (renamed first): creating a file costs far more than
        # rewriting one on some filesystems (0.9 ms against 0.04 ms on our machines'
        # ext4). A reader of an older snapshot's files checks each one's checksum and
        # falls back to storage (restore, read_state). What is left over is deleted below.
        named = self._files.current() | self._previous_files
        spare = [e.path for e in os.scandir(self.files_path) if e.name not in named]
        changed = self.account.changed | self._files.compactable(self.account.changed)
        written = self._write_segment(sorted(changed), spare)
        self._files.replace(changed, written)
        self.account.changed.clear()
        for path in spare:  # the previous snapshot's files stay: it may be restored here
            os.unlink(path)
        self._previous_files = self._files.current()
        snapshot_id = uuid.uuid4().hex
        rows = self.count_rows() if count_rows else {}
        self._dirty = False
        self._last_snapshot_id = snapshot_id
        served = self._files.served()
        return LocalSnapshot(snapshot_id, self.files_path,
                             tuple(sorted((n, self._files.sizes[n]) for n in served)), rows,
                             served)

    def count_rows(self) -> dict[str, int]:
        return {name: len(table) for name, table in self._cfs.items()}

    def close(self) -> None:
        """Close; state left exactly as the last snapshot stays in this process for the
        next restore of that snapshot (module docstring), the rest is dropped."""
        if not self._open:
            return
        self._open = False
        self._states.clear()
        clean = not self.read_only and not self._dirty and self._last_snapshot_id is not None
        if clean:
            _keep_live(self.local_dir, _LiveInstance(
                self._last_snapshot_id or "", dict(self._cfs), self.account, self._files))
        self._cfs = {}
        self._handles = {}


class _Files:
    """Which file serves each key group, and what each file holds (module docstring)."""

    def __init__(self) -> None:
        self.source: dict[bytes, str] = {}  # key-group prefix -> the file serving it
        self.rows: dict[bytes, Rows] = {}  # key-group prefix -> its entries per state
        self.sizes: dict[str, int] = {}  # file -> bytes
        self.entries: dict[str, int] = {}  # file -> entries it holds (served or not)

    def current(self) -> set[str]:
        return set(self.source.values())

    def add(self, name: str, size: int, entries: int, rows: dict[bytes, Rows]) -> None:
        """File ``name`` serves the key groups of ``rows``."""
        self.sizes[name], self.entries[name] = size, entries
        for prefix, r in rows.items():
            self.source[prefix], self.rows[prefix] = name, r

    def compactable(self, changed: set[bytes]) -> set[bytes]:
        """The key groups (outside ``changed``) of files whose served entries are under
        COMPACT_BELOW of what they hold once ``changed`` is written elsewhere."""
        live: dict[str, int] = dict.fromkeys(self.entries, 0)
        for prefix, name in self.source.items():
            if prefix not in changed:
                live[name] += sum(n for _, n in self.rows[prefix])
        sparse = {n for n, held in live.items() if 0 < held < COMPACT_BELOW * self.entries[n]}
        return {p for p, n in self.source.items() if n in sparse and p not in changed}

    def replace(self, prefixes: set[bytes],
                written: tuple[str, int, int, dict[bytes, Rows]] | None) -> None:
        """Key groups ``prefixes`` now live in segment ``written`` (or are empty)."""
        for prefix in prefixes:
            self.source.pop(prefix, None)
            self.rows.pop(prefix, None)
        if written is not None:
            name, size, entries, rows = written
            self.add(name, size, entries, rows)
        current = self.current()
        for name in set(self.sizes) - current:
            del self.sizes[name], self.entries[name]

    def served(self) -> dict[str, tuple[tuple[int, Rows], ...]]:
        """file -> ((key group, entries per state), ...) of the key groups it serves."""
        out: dict[str, list[tuple[int, Rows]]] = {}
        for prefix, name in self.source.items():
            out.setdefault(name, []).append((int.from_bytes(prefix, "big"), self.rows[prefix]))
        return {n: tuple(sorted(kgs)) for n, kgs in out.items()}


@dataclass(frozen=True)
class _LiveInstance:
    """A closed instance's state, exactly its snapshot ``snapshot_id``."""

    snapshot_id: str
    tables: dict[str, MemoryTable]
    account: MemoryAccount
    files: _Files


# Closed instances kept in this process, by local folder, newest last: a restore of the
# same snapshot here adopts one instead of reading files (local-instance recovery, as
# RocksDB's clean instance on disk). At most LIVE_BYTES in all, oldest dropped first.
LIVE_BYTES = 2**30
_LIVE: OrderedDict[str, _LiveInstance] = OrderedDict()
_LIVE_LOCK = threading.Lock()


def has_live_instance(local_dir: str, snapshot_id: str) -> bool:
    """Whether this process holds the state of ``snapshot_id`` for ``local_dir``."""
    with _LIVE_LOCK:
        live = _LIVE.get(os.path.abspath(local_dir))
        return live is not None and live.snapshot_id == snapshot_id


def forget_live_instance(local_dir: str) -> None:
    """Drop what this process holds for ``local_dir`` (a restore that reads the files)."""
    with _LIVE_LOCK:
        _LIVE.pop(os.path.abspath(local_dir), None)


def _take_live(local_dir: str, snapshot_id: str | None) -> _LiveInstance | None:
    with _LIVE_LOCK:
        live = _LIVE.pop(local_dir, None)
    return live if live is not None and live.snapshot_id == snapshot_id else None


def _keep_live(local_dir: str, live: _LiveInstance) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(local_dir, None)
        if live.account.bytes > LIVE_BYTES:
            return
        _LIVE[local_dir] = live
        while sum(x.account.bytes for x in _LIVE.values()) > LIVE_BYTES:
            _LIVE.popitem(last=False)

