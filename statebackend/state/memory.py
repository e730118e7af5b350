"""The memory backend: keyed state in per-key-group hash tables, snapshots per key group.

`MemoryStateBackend` is a `KeyedStateBackend` whose column families are `MemoryTable`s
(statebackend.state.memory_table): the state kinds, timers, TTL, migrations and scans run
unchanged on it, without RocksDB calls on the hot path.

Snapshots are copy-on-write per key group. Every write marks its key group changed; a
snapshot writes one immutable file per *changed* key group, holding that key group's
entries of every column family, and names the unchanged key groups' files again. So a
checkpoint uploads only the key groups written since the last one, every file is a
shared file (GC, retention, savepoints and the manifest treat it like an SST), and:

- restore reads the newest file of each key group (the handle lists exactly those);
- rescale moves whole key-group files: a new subtask's handle names the files of its
  key groups, nothing is clipped or rewritten.

File format (``kg-<key group:05d>-<unique>.kgs``): an Arrow IPC file, LZ4 or ZSTD
compressed, with columns ``family`` (dictionary of column-family names), ``key`` and
``value`` (binary), sorted by family then key. Reading it decodes bytes and never runs
code from storage.

An instance opened from stored files (``origin.file_paths``: the handle's files, already
in ``files/``) loads them at construction. The local folder keeps the files of the
current and the previous snapshot (``files/``): a restore on the same machine reads
those instead of downloading them.

Memory is bounded (`set_memory_limit`): a write that takes the state past the limit
fails at once with `StateMemoryLimitError` naming the limit; nothing swaps or spills.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from statebackend.errors import CorruptStateError, UsageError
from statebackend.state.backend import KeyedStateBackend, LocalSnapshot
from statebackend.state.families import INTERNAL_STATES
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.kinds import internal_descriptor
from statebackend.state.memory_table import MemoryAccount, MemoryTable, MemoryWriteBatch

FILES_DIR = "files"
SUFFIX = ".kgs"
_NAME = re.compile(r"^kg-(\d{5})-[0-9a-f]{12}\.kgs$")
_SCHEMA = pa.schema([("family", pa.dictionary(pa.int16(), pa.string())),
                     ("key", pa.binary()), ("value", pa.binary())])
_IPC_COMPRESSION = {None: "lz4", "lz4": "lz4", "snappy": "lz4", "zstd": "zstd", "none": None}


def key_group_of_file(name: str) -> int:
    """The key group a memory-backend file holds (from its name)."""
    m = _NAME.match(name)
    if m is None:
        raise CorruptStateError(f"{name!r} is not a memory-backend key-group file "
                                "(kg-<key group>-<id>.kgs)")
    return int(m.group(1))


class MemoryStateBackend(KeyedStateBackend):
    """Keyed state of one subtask in memory (module docstring)."""

    kind = "memory"

    def _open_instance(self, read_only: bool) -> None:
        del read_only  # nothing on disk is opened: a read-only instance just never snapshots
        self.account = MemoryAccount(None, self.label)
        self._cf_names = sorted(self.descriptors)
        self._cfs = {n: MemoryTable(n, self.account) for n in self._cf_names}
        self._handles = self._cfs
        self.compression: str | None = None
        self._db = None
        self._open = True
        # key-group prefix -> (file name, size) of its newest file; the previous snapshot's
        self._kg_files: dict[bytes, tuple[str, int]] = {}
        self._previous_files: set[str] = set()
        os.makedirs(self.files_path, exist_ok=True)
        # A stored instance (restore, validation, dump) is the files its handle names,
        # already placed in files/ (statebackend.checkpoint.restore).
        self.load_files(self.file_paths)

    @property
    def files_path(self) -> str:
        return os.path.join(self.local_dir, FILES_DIR)

    @property
    def db(self) -> Any:
        raise UsageError(f"{self.label} is in memory: it has no RocksDB instance")

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

    def write(self, batch: Any) -> None:
        self._dirty = True
        batch.apply(self.account)

    def is_shared_file(self, name: str) -> bool:
        return name.endswith(SUFFIX)

    def ensure_family(self, name: str) -> None:
        if name not in self._cfs:
            if name in INTERNAL_STATES:
                self.descriptors.setdefault(name, internal_descriptor(name))
            self._cfs[name] = MemoryTable(name, self.account)
            self._cf_names = sorted(self._cfs)

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
        for prefix in list(table.parts):
            table.drop_part(prefix)
            self.account.changed.add(prefix)
        self._dirty = True

    # -- files ---------------------------------------------------------------------
    def load_files(self, names: Iterable[str]) -> None:
        """Fill the tables from key-group files in ``files/`` (a restore)."""
        for name in names:
            kg = key_group_of_file(name)
            path = os.path.join(self.files_path, name)
            try:
                with pa.memory_map(path) as source:
                    table = pa.ipc.open_file(source).read_all()
            except (OSError, pa.ArrowInvalid) as exc:
                raise CorruptStateError(f"{self.file_paths.get(name, path)}: not a readable "
                                        f"key-group file of {self.label}: {exc}") from exc
            if table.schema != _SCHEMA:
                raise CorruptStateError(f"{self.file_paths.get(name, path)}: unexpected "
                                        f"columns {table.schema.names} in {self.label}")
            self._load_key_group(kg, table)
            self._kg_files[key_group_prefix(kg)] = (name, os.path.getsize(path))
        self._previous_files = {n for n, _ in self._kg_files.values()}

    def _load_key_group(self, kg: int, table: pa.Table) -> None:
        prefix = key_group_prefix(kg)
        if not table.num_rows:
            return
        families = table.column("family").combine_chunks()
        names = families.dictionary.to_pylist()
        codes = families.indices.to_numpy(zero_copy_only=False)
        keys = table.column("key").to_pylist()
        values = table.column("value").to_pylist()
        start = 0
        while start < len(keys):  # rows are sorted by family: one run per family
            code = codes[start]
            end = start
            while end < len(keys) and codes[end] == code:
                end += 1
            if any(k[:2] != prefix for k in (keys[start], keys[end - 1])):
                raise CorruptStateError(f"a key-group file of {self.label} for key group "
                                        f"{kg} holds keys of another key group")
            self._table(names[code]).load(prefix, keys[start:end], values[start:end])
            start = end

    def _write_key_group(self, prefix: bytes) -> tuple[str, int] | None:
        """Write key group ``prefix``'s file (None: the key group is empty)."""
        names: list[str] = []
        codes: list[int] = []
        keys: list[bytes] = []
        values: list[bytes] = []
        for name in self._cf_names:
            part = self._cfs[name].parts.get(prefix)
            if not part:
                continue
            ordered = sorted(part)
            names.append(name)
            codes.extend([len(names) - 1] * len(ordered))
            keys.extend(ordered)
            values.extend(part[k] for k in ordered)
        if not keys:
            return None
        kg = int.from_bytes(prefix, "big")
        file_name = f"kg-{kg:05d}-{uuid.uuid4().hex[:12]}{SUFFIX}"
        table = pa.table([
            pa.DictionaryArray.from_arrays(pa.array(codes, pa.int16()), pa.array(names)),
            pa.array(keys, pa.binary()), pa.array(values, pa.binary())], schema=_SCHEMA)
        path = os.path.join(self.files_path, file_name)
        options = pa.ipc.IpcWriteOptions(compression=_IPC_COMPRESSION[self.compression])
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, _SCHEMA,
                                                            options=options) as writer:
            writer.write_table(table)
        return file_name, os.path.getsize(path)

    # -- snapshot --------------------------------------------------------------------
    def take_local_snapshot(self, count_rows: bool = True) -> LocalSnapshot:
        """Write a file per key group changed since the last snapshot; name the rest."""
        if self.read_only:
            raise UsageError(f"{self.label} is read-only: it cannot snapshot")
        for prefix in sorted(self.account.changed):
            written = self._write_key_group(prefix)
            if written is None:
                self._kg_files.pop(prefix, None)
            else:
                self._kg_files[prefix] = written
        self.account.changed.clear()
        current = {n for n, _ in self._kg_files.values()}
        for entry in os.scandir(self.files_path):
            if entry.name not in current and entry.name not in self._previous_files:
                os.unlink(entry.path)
        self._previous_files = current
        snapshot_id = uuid.uuid4().hex
        rows = self.count_rows() if count_rows else {}
        self._dirty = False
        self._last_snapshot_id = snapshot_id
        return LocalSnapshot(snapshot_id, self.files_path,
                             tuple(sorted(self._kg_files.values())), rows)

    def count_rows(self) -> dict[str, int]:
        return {name: len(table) for name, table in self._cfs.items()}

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self._states.clear()
        self._cfs.clear()
        self._handles = {}

