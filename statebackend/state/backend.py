"""Keyed state backend: one embedded RocksDB instance per (job, subtask).

Local layout of one instance (``local_dir``)::

    local_dir/
      db/                      the working RocksDB instance (raw mode, one CF per state)
      snapshots/<snapshot_id>/ RocksDB native checkpoints (hard links), kept for
                               local recovery; the newest two are kept
      instance.json            {"backend_id", "clean_snapshot_id"}: set on close when
                               the working db equals that snapshot exactly

Internal column families (reserved names, recorded in ``_metadata`` like states):
``_ttl``, the expiry index, whenever a declared state has a TTL (`statebackend.state.ttl`);
``_timers`` and ``_timer_keys`` when declared with `statebackend.state.timers.with_timers`
or already present in a restored instance (`statebackend.state.timers`). The instance
keeps one clock per time domain (`set_time`): TTL reads filter with it.

The WAL is disabled (as in Flink): durability comes from checkpoints, and the
synchronous part of a snapshot flushes every column family before the native
checkpoint, so a snapshot is SST files plus small private files.

Row counts: a snapshot records the live entries of every column family. They are
tracked, not scanned, while every write since they were last known said what it
changed (`write` with ``changes``: the TTL states' writes and purge, `insert_absent`,
reducing, aggregating and list adds, and a put of the very keys a state just read, as
a fold's read-then-write does: they read each key before writing it anyway); the
start is the restored handle's
recorded counts, or zero for a new instance. Any other write (a blind put, a clip, an
ingestion) makes them unknown and the next snapshot counts by a scan, which is
O(state) where tracking is O(changes). ``CKPT_ROW_COUNTS``: ``tracked`` (default),
``scan`` (always scan) or ``verify`` (tracked and checked against a scan: a mismatch
fails the snapshot; the test suite runs so).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, overload

import numpy as np
import pyarrow as pa
from rocksdict import (
    AccessType,
    BlockBasedOptions,
    Checkpoint,
    ColumnFamily,
    CompactOptions,
    DBCompactionStyle,
    Env,
    Options,
    Rdict,
    UniversalCompactOptions,
    WriteBatch,
    WriteOptions,
)

from statebackend import settings
from statebackend.errors import CorruptStateError, SnapshotError, UsageError
from statebackend.state.codecs import as_time, serialize_key, serialize_keys
from statebackend.state.families import INTERNAL_STATES, TTL_INDEX
from statebackend.state.keygroups import (
    MURMUR3,
    KeyGroupRange,
    check_key_hash,
    check_max_parallelism,
    key_group_for_bytes,
    key_group_prefix,
)
from statebackend.state.keygroups_bulk import key_groups, prefixed_keys
from statebackend.state.kinds import (
    STATE_CLASSES,
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    StateDescriptor,
    ValueState,
    _State,
    internal_descriptor,
)
from statebackend.state.scan import (
    checked_copy,
    checked_count,
    checked_entries,
    checked_scan,
    damaged_state,
)

if TYPE_CHECKING:
    from statebackend.state.timers import TimerFiring

DB_DIR = "db"
SNAPSHOTS_DIR = "snapshots"
INSTANCE_FILE = "instance.json"
LOCAL_SNAPSHOTS_KEPT = 2
ROW_COUNTS_ENV = "CKPT_ROW_COUNTS"  # tracked | scan | verify (module doc: row counts)
_PREFIXES = [key_group_prefix(i) for i in range(1 << 15)]
_S = TypeVar("_S", bound=_State)


class SharedFileRef(Protocol):
    """A stored shared file as a checkpoint handle names it (`checkpoint.metadata.FileRef`)."""

    @property
    def local_name(self) -> str: ...


class CommittedHandle(Protocol):
    """What `KeyedStateBackend.notify_checkpoint_complete` reads of a committed
    subtask handle (`checkpoint.metadata.SubtaskHandle`, a layer above this one)."""

    @property
    def shared_files(self) -> Sequence[SharedFileRef]: ...


def rocks_options(write_buffer_mb: int = 64) -> Options:
    """Options of every instance and column family.

    Universal compaction, because checkpoints are incremental: leveled compaction
    rewrites the whole of L1 at each L0 -> L1 compaction, and while the state fits
    in L1 (most per-subtask states of a scheduled job) that means re-uploading the
    full state every few runs and retaining one more full copy per kept checkpoint.
    Universal compaction merges the small recent runs and rewrites the large base
    only when size amplification demands it. Measured over 50 runs with --keep 3
    (tests/statebackend/lifecycle/test_lifecycle_scenarios.py): mean bytes uploaded per
    checkpoint 160 KB vs 299 KB, referenced bytes at the end 1.13x vs 2.08x the
    newest checkpoint (20,000 keys, 1% updated per run).
    """
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    opts.set_write_buffer_size(write_buffer_mb * 1024 * 1024)
    opts.set_max_background_jobs(2)
    opts.set_keep_log_file_num(2)
    # Open reads each SST's footer with this many threads, started on every open
    # (default 16): a subtask's instance holds few files, and the starts cost more than
    # the reads (a restored 4-SST instance opened in 2.9 ms with 16, 1.7 ms with 1)
    opts.set_max_file_opening_threads(1)
    opts.set_compaction_style(DBCompactionStyle.universal())
    opts.set_universal_compaction_options(UniversalCompactOptions())
    # A Bloom filter of 10 bits per key in every SST (as Spark's RocksDB state store has):
    # a lookup of an absent key (dedup's new ids) or of a key in an older sorted run skips
    # the SSTs that cannot hold it. Dedup on Spark went from 2.97-3.21x to 3.28-3.34x
    # Spark's peer; keyed aggregation unchanged; about 1.2 bytes more per key uploaded.
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    return opts


class BackgroundPools:
    """RocksDB's flush (high) and compaction (low) thread pools, grown with the instances
    open at once in this process, up to the cores.

    Every instance of a process shares those two pools, and RocksDB grows them only to
    the largest ``max_background_jobs`` of an instance: one flush thread and one
    compaction thread with ours. So the subtasks that the local engine and a local
    rescale run in threads of one process queued on one thread each for their flushes
    and compactions (manual ones too: ``compact_range`` waits for the pool); a rescale
    4 -> 8 of 1M keys compacted its 8 clipped bases one at a time on one core. A Spark
    task's Python worker holds one instance at a time and keeps one thread of each: a
    pool sized to the cores in every worker would start two threads per core per worker
    on a large executor, all but two of them idle.
    """

    def __init__(self, cores: int) -> None:
        self.cores = max(1, cores)
        self.size = 1  # RocksDB's own sizing with our options
        self._open = 0
        self._lock = threading.Lock()

    def opened(self) -> None:
        with self._lock:
            self._open += 1
            wanted = min(self._open, self.cores)
            if wanted > self.size:  # pools never shrink: threads wait idle in them
                env = Env()  # the process's default environment, every instance's
                env.set_low_priority_background_threads(wanted)
                env.set_high_priority_background_threads(wanted)
                self.size = wanted

    def closed(self) -> None:
        with self._lock:
            self._open -= 1


POOLS = BackgroundPools(os.cpu_count() or 1)


def no_wal() -> WriteOptions:
    wo = WriteOptions()
    # rocksdict's stub declares a method; at run time it is a settable property
    wo.disable_wal = True  # type: ignore[method-assign, assignment]
    return wo


@dataclass(frozen=True)
class LocalSnapshot:
    """Result of the synchronous part: an immutable local checkpoint directory."""

    snapshot_id: str
    path: str
    files: tuple[tuple[str, int], ...]  # (file name, size)
    row_counts: dict[str, int]
    # file name -> ((key group, ((state, entries), ...)), ...): the key groups this
    # snapshot reads from a file holding whole states of some key groups (the memory
    # backend's), recorded in its FileRef (metadata.FileRef.key_groups)
    file_key_groups: Mapping[str, tuple[tuple[int, tuple[tuple[str, int], ...]], ...]] = \
        field(default_factory=dict)


@dataclass(frozen=True)
class StoredInstance:
    """What an instance opened from stored files knows of them (restore, rescale,
    validation, dump); a new instance has none of it.

    ``backend_id``: the stored instance's id, kept so local recovery and the next
    snapshot know it (None: an instance built from stored files gets a new id);
    ``label`` names it in scan errors ("subtask 1 of checkpoint 7"); ``file_paths``:
    each local file's stored path (local name -> path under the job root), named when
    a scan meets a damaged block.
    """

    backend_id: str | None = None
    label: str | None = None
    file_paths: Mapping[str, str] = field(default_factory=dict)
    snapshot_id: str | None = None  # the stored snapshot these files are
    row_counts: Mapping[str, int] | None = None  # its recorded live entries per family
    # local name -> the key groups read from it (memory-backend segments: FileRef.key_groups)
    file_key_groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


class KeyedStateBackend:
    """Keyed state of one subtask: key groups ``key_group_range`` of ``max_parallelism``.

    ``origin``: the stored instance it opens (`StoredInstance`); ``read_only`` opens
    RocksDB read-only and never marks the instance clean.
    """

    key_hash = MURMUR3  # how keys are placed in key groups (the lineage's: `place_keys_by`)
    kind = "rocksdb"  # the backend kind each handle records (`state.backend_kinds`)
    files_dir = DB_DIR  # where a restore places a handle's files under the local folder
    # Column families by name: Rdict families here, `MemoryTable`s in the memory backend.
    _cfs: dict[str, Any]
    _handles: dict[str, Any]

    def __init__(self, local_dir: str, descriptors: Sequence[StateDescriptor],
                 max_parallelism: int, key_group_range: KeyGroupRange, *,
                 read_only: bool = False, origin: StoredInstance | None = None) -> None:
        origin = origin or StoredInstance()
        check_max_parallelism(max_parallelism)
        self.local_dir = os.path.abspath(local_dir)
        self.max_parallelism = max_parallelism
        self.key_group_range = key_group_range
        self.descriptors = {d.name: d for d in descriptors}
        if any(d.ttl is not None for d in descriptors):
            self.descriptors.setdefault(TTL_INDEX, internal_descriptor(TTL_INDEX))
        # Clock per time domain (epoch ms, None = not set): TTL reads treat entries with
        # expiry <= the clock as gone; TTL writes without a timestamp are stamped with it.
        self.times: dict[str, int | None] = {"event": None, "processing": None}
        # Running `timers.fire_due` passes per domain (timers registered meanwhile join).
        self.timer_firings: dict[str, TimerFiring] = {}
        self.read_only = read_only
        self.backend_id = origin.backend_id or uuid.uuid4().hex
        # SSTs confirmed in committed checkpoints of this lineage: local name -> FileRef
        # (statebackend.checkpoint.metadata: a layer above, so not named here).
        self.uploaded: dict[str, Any] = {}
        # Remote shared files local recovery found damaged (missing, wrong size or
        # checksum) and dropped from ``uploaded``: the next snapshot uploads them again.
        self.reuploaded: tuple[str, ...] = ()
        self.restore_mode = "new"
        # What local recovery checked of the stored files it reuses (a
        # checkpoint.restore.ReuseReport, set there: this layer cannot name its type).
        self.reuse_report: Any = None
        # Names this instance in scan errors ("subtask 1 of checkpoint 7"); stored paths
        # of its files (local name -> path under the job root) when restored from storage.
        self.label = origin.label or (f"the instance at {self.local_dir} (key groups "
                                      f"[{key_group_range.start}, {key_group_range.end}])")
        self.file_paths: dict[str, str] = dict(origin.file_paths)
        self.file_key_groups: dict[str, tuple[int, ...]] = dict(origin.file_key_groups)
        self._dirty = False
        self._last_snapshot_id: str | None = origin.snapshot_id
        self._states: dict[str, _State] = {}
        # Live entries per family while known (module doc: row counts); None: unknown.
        self._row_counts: dict[str, int] | None = None
        self.writes = 0  # writes so far: a read's result holds until the next one
        self._recorded_counts = origin.row_counts
        self._open_instance(read_only)
        self._forget_clean_marker()

    def _open_instance(self, read_only: bool) -> None:
        """Open (or create) the RocksDB instance with one column family per state."""
        os.makedirs(self.db_path, exist_ok=True)
        names = set(self.descriptors)
        stored: set[str] = set()
        if os.path.exists(os.path.join(self.db_path, "CURRENT")):
            stored = set(Rdict.list_cf(self.db_path, Options(raw_mode=True))) - {"default"}
            names |= stored
        for name in sorted(names & set(INTERNAL_STATES)):
            # an internal family found in a restored instance is read like a declared one
            self.descriptors.setdefault(name, internal_descriptor(name))
        self._cf_names = sorted(names)
        opts = rocks_options()
        db = Rdict(
            self.db_path, opts,
            column_families={n: rocks_options() for n in self._cf_names},
            access_type=AccessType.read_only() if read_only else AccessType.read_write(),
        )
        self._db: Rdict | None = db  # None once closed
        POOLS.opened()
        db.set_write_options(no_wal())
        self._cfs = {n: db.get_column_family(n) for n in self._cf_names}
        for cf in self._cfs.values():
            cf.set_write_options(no_wal())
        self._handles = {n: db.get_column_family_handle(n) for n in self._cf_names}
        recorded = self._recorded_counts or {}
        if stored <= set(recorded):  # a new family (or instance) holds nothing yet
            self._row_counts = {n: int(recorded[n]) if n in stored else 0
                                for n in self._cf_names}

    def write_batch(self) -> WriteBatch:
        """An empty write batch for `write` (raw mode: keys and values are bytes)."""
        return WriteBatch(raw_mode=True)

    def is_shared_file(self, name: str) -> bool:
        """Whether a snapshot file goes to ``shared/`` (immutable, referenced by later
        checkpoints) rather than the checkpoint's private folder."""
        return name.endswith(".sst")

    @property
    def db(self) -> Rdict:
        """The open RocksDB instance (UsageError once closed)."""
        if self._db is None:
            raise UsageError(f"{self.label} is closed")
        return self._db

    # -- paths -------------------------------------------------------------
    @property
    def db_path(self) -> str:
        return os.path.join(self.local_dir, self.files_dir)

    @property
    def snapshots_path(self) -> str:
        return os.path.join(self.local_dir, SNAPSHOTS_DIR)

    # -- keys --------------------------------------------------------------
    def place_keys_by(self, key_hash: str) -> KeyedStateBackend:
        """Place keys in key groups by ``key_hash`` (`keygroups.KEY_HASHES`: the
        lineage's); returns the backend."""
        self.key_hash = check_key_hash(key_hash)
        return self

    def key_group_and_bytes(self, key: str) -> tuple[int, bytes]:
        kb = serialize_key(key)
        kg = key_group_for_bytes(kb, self.max_parallelism, self.key_hash)
        r = self.key_group_range
        if kg < r.start or kg > r.end:
            raise UsageError(f"key {key!r} is in key group {kg}, outside this backend's range "
                             f"[{r.start}, {r.end}]: route keys by key group before writing")
        return kg, kb

    def rocks_key(self, key: str) -> bytes:
        kg, kb = self.key_group_and_bytes(key)
        return _PREFIXES[kg] + kb

    def rocks_keys(self, keys: Iterable[str] | pa.Array | pa.ChunkedArray) -> list[bytes]:
        """`rocks_key` of every key, computed column-wise (no per-key Python step)."""
        kgs, key_bytes = self.key_groups_and_bytes(keys)
        if not len(key_bytes):
            return []
        out: list[bytes] = prefixed_keys(kgs, key_bytes).to_pylist()
        return out

    def key_groups_and_bytes(self, keys: Iterable[str] | pa.Array | pa.ChunkedArray
                             ) -> tuple[np.ndarray, pa.Array]:
        """`key_group_and_bytes` of every key, computed column-wise: (key groups,
        serialized keys); UsageError naming the first key outside this backend's range."""
        key_bytes = serialize_keys(keys)
        if not len(key_bytes):
            return np.zeros(0, np.int64), key_bytes
        kgs = key_groups(key_bytes, self.max_parallelism, self.key_hash)
        r = self.key_group_range
        outside = (kgs < r.start) | (kgs > r.end)
        if outside.any():
            self.key_group_and_bytes(key_bytes[int(np.argmax(outside))].as_py().decode())
        return kgs, key_bytes

    # -- time ----------------------------------------------------------------
    def set_time(self, *, event_time: int | None = None,
                 processing_time: int | None = None) -> None:
        """Set the clocks TTL reads and writes use (the watermark; the run's logical time).

        A clock never goes back: an older value is ignored (a watermark never decreases).
        """
        for domain, t in (("event", event_time), ("processing", processing_time)):
            if t is None:
                continue
            t = as_time(t)
            current = self.times[domain]
            self.times[domain] = t if current is None else max(current, t)

    def current_time(self, domain: str) -> int | None:
        return self.times[domain]

    # -- states ------------------------------------------------------------
    def state(self, name: str) -> _State:
        if name not in self._states:
            if name not in self.descriptors:
                raise UsageError(
                    f"state {name!r} is not declared; declared: {sorted(self.descriptors)}")
            desc = self.descriptors[name]
            if desc.internal:
                raise UsageError(f"{name!r} is the backend's internal {desc.kind} column "
                                 "family, not a state: use statebackend.state.timers / .ttl")
            self._states[name] = STATE_CLASSES[desc.kind](self, desc)
        return self._states[name]

    def value_state(self, name: str) -> ValueState:
        return self._typed(name, ValueState)

    def list_state(self, name: str) -> ListState:
        return self._typed(name, ListState)

    def map_state(self, name: str) -> MapState:
        return self._typed(name, MapState)

    def reducing_state(self, name: str) -> ReducingState:
        return self._typed(name, ReducingState)

    def aggregating_state(self, name: str) -> AggregatingState:
        return self._typed(name, AggregatingState)

    def _typed(self, name: str, cls: type[_S]) -> _S:
        st = self.state(name)
        if type(st) is not cls or not isinstance(st, cls):  # a subclass is another kind
            raise UsageError(f"state {name!r} is {self.descriptors[name].kind} state, "
                             f"not {cls.__name__}")
        return st

    def column_family(self, name: str) -> Rdict:
        """Family ``name``: an Rdict here; the memory backend's `MemoryTable` has the part
        of its API the state code uses (statebackend.state.memory_table)."""
        cf: Rdict = self._cfs[name]
        return cf

    def drop_column_family(self, name: str) -> None:
        """Drop a stored family no declared state uses any more (a dropped or renamed
        state, statebackend.state.migrate): the next snapshot does not hold it."""
        if name in self.descriptors and not self.descriptors[name].internal:
            raise UsageError(f"state {name!r} is declared: it cannot be dropped")
        if name not in self._cfs:
            return
        self._states.pop(name, None)
        self._cfs.pop(name)
        self._handles.pop(name)
        self._cf_names.remove(name)
        self.db.drop_column_family(name)
        self.mark_dirty()

    def ensure_family(self, name: str) -> None:
        """Create column family ``name`` if the instance has none of that name (a
        conversion from another backend brings every stored family)."""
        if name in self._cfs:
            return
        if name in INTERNAL_STATES:
            self.descriptors.setdefault(name, internal_descriptor(name))
        cf = self.db.create_column_family(name, rocks_options())
        cf.set_write_options(no_wal())
        self._cfs[name] = cf
        self._handles[name] = self.db.get_column_family_handle(name)
        self._cf_names = sorted(self._cfs)
        if self._row_counts is not None:
            self._row_counts[name] = 0

    def column_family_handle(self, name: str) -> ColumnFamily:
        handle: ColumnFamily = self._handles[name]
        return handle

    @property
    def column_families(self) -> list[str]:
        return list(self._cf_names)

    def write_pairs(self, handle: ColumnFamily, puts: Iterable[tuple[bytes, bytes]],
                    deletes: Iterable[bytes] = (),
                    changes: Mapping[str, int] | None = None) -> None:
        """One atomic write to one family: ``puts`` (key, value) then ``deletes``;
        ``changes`` as for `write`."""
        wb = self.write_batch()
        wb.set_default_column_family(handle)
        for k, v in puts:
            wb.put(k, v)
        for k in deletes:
            wb.delete(k)
        self.write(wb, changes)

    def write_columns(self, handle: ColumnFamily, keys: Sequence[bytes],
                      values: Sequence[bytes], changes: Mapping[str, int] | None = None
                      ) -> None:
        """`write_pairs` of ``keys[i]`` -> ``values[i]`` (no deletes; the memory
        backend takes the two lists as they are)."""
        self.write_pairs(handle, zip(keys, values, strict=True), (), changes)

    @property
    def keeps_timer_keys(self) -> bool:
        """Whether timer writes go to ``_timer_keys`` too (the memory backend derives it
        from ``_timers`` until it is read: `memory_timer_keys`)."""
        return True

    def write_keys(self, families: Sequence[tuple[ColumnFamily, Sequence[bytes]]], *,
                   delete: bool = False) -> None:
        """One write of keys with empty values (``delete``: their deletion) in each of
        ``families`` (handle, keys): the timers' two families, a column each (the memory
        backend takes each list as it is, no step per key)."""
        wb = self.write_batch()
        for handle, keys in families:
            for key in keys:
                if delete:
                    wb.delete(key, handle)
                else:
                    wb.put(key, b"", handle)
        self.write(wb)

    # Record value states held as rows (the memory backend's RecordTable): the job API's
    # columnar calls go straight to them; here, and for any other family, they do not
    # apply (None / False: take the bytes path).
    def read_records(self, handle: ColumnFamily, keys: list[bytes], dtype: np.dtype
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """(found mask, records) of ``keys`` in ``handle``, or None."""
        del handle, keys, dtype
        return None

    def write_records(self, handle: ColumnFamily, keys: list[bytes], records: np.ndarray
                      ) -> bool:
        """Put ``records[i]`` at ``keys[i]`` in ``handle``; False: nothing written."""
        del handle, keys, records
        return False

    def write(self, batch: WriteBatch, changes: Mapping[str, int] | None = None) -> None:
        """Apply ``batch`` atomically. ``changes``: the live entries it adds per family
        (negative: removes), from a writer that knows them exactly; without it the next
        snapshot counts its rows by a scan (module doc: row counts)."""
        self._dirty = True
        self.writes += 1
        try:
            self.db.write(batch)
        except BaseException:
            self._row_counts = None
            raise
        if changes is None:
            self._row_counts = None
        elif self._row_counts is not None:
            for name, n in changes.items():
                self._row_counts[name] += n

    def mark_dirty(self) -> None:
        """The instance changed outside `write` (row counts: unknown until a scan)."""
        self._dirty = True
        self.writes += 1
        self._row_counts = None

    # -- raw access (dump, validation, rescale) ----------------------------
    def scan_where(self, cf_name: str) -> str:
        return f"column family {cf_name!r} of {self.label}"

    @overload
    def iter_raw(self, cf_name: str, key_groups: KeyGroupRange | None = None, *,
                 lower: bytes | None = None, upper: bytes | None = None,
                 values: Literal[True] = True) -> Iterator[tuple[bytes, bytes]]: ...
    @overload
    def iter_raw(self, cf_name: str, key_groups: KeyGroupRange | None = None, *,
                 lower: bytes | None = None, upper: bytes | None = None,
                 values: Literal[False]) -> Iterator[bytes]: ...

    def iter_raw(self, cf_name: str, key_groups: KeyGroupRange | None = None, *,
                 lower: bytes | None = None, upper: bytes | None = None,
                 values: bool = True) -> Iterator[tuple[bytes, bytes]] | Iterator[bytes]:
        """Checked scan of one column family: ``key_groups`` or explicit byte bounds.

        Yields (key, value), or keys only if not ``values``; raises `CorruptStateError`
        if RocksDB stops the scan on an error.
        """
        if key_groups is not None:
            lower, upper = key_groups.byte_bounds()
        return checked_scan(self._cfs[cf_name], self.scan_where(cf_name), lower, upper,
                            values=values, file_paths=self.file_paths)

    @overload
    def read_raw(self, cf_name: str, key_groups: KeyGroupRange | None = None, *,
                 values: Literal[True] = True) -> tuple[list[bytes], list[bytes]]: ...
    @overload
    def read_raw(self, cf_name: str, key_groups: KeyGroupRange | None = None, *,
                 values: Literal[False]) -> tuple[list[bytes], None]: ...

    def read_raw(self, cf_name: str, key_groups: KeyGroupRange | None = None, *,
                 values: bool = True) -> tuple[list[bytes], list[bytes] | None]:
        """Every key (and value) of one column family (within ``key_groups``) as lists;
        checked like `iter_raw` (`checked_entries`)."""
        lower, upper = key_groups.byte_bounds() if key_groups is not None else (None, None)
        return checked_entries(self._cfs[cf_name], self.scan_where(cf_name), lower, upper,
                               values=values, file_paths=self.file_paths)

    def copy_raw(self, cf_name: str, key_groups: KeyGroupRange,
                 sink: Callable[[bytes, bytes], object]) -> int | None:
        """Feed every entry of one column family within ``key_groups`` to ``sink``,
        streamed; the number fed, or None when the caller must start over with
        `read_raw` (`checked_copy`)."""
        lower, upper = key_groups.byte_bounds()
        return checked_copy(self._cfs[cf_name], self.scan_where(cf_name), lower, upper, sink,
                            file_paths=self.file_paths)

    def count_keys(self, cf_name: str, key_groups: KeyGroupRange | None = None) -> int:
        """Live entries of one column family (within ``key_groups``), checked scan."""
        lower, upper = key_groups.byte_bounds() if key_groups is not None else (None, None)
        return checked_count(self._cfs[cf_name], self.scan_where(cf_name), lower, upper,
                             file_paths=self.file_paths)

    def count_rows(self) -> dict[str, int]:
        return {name: self.count_keys(name) for name in self._cf_names}

    def delete_key_groups_outside(self, keep: KeyGroupRange) -> None:
        """Clip: drop every key outside ``keep`` with two range tombstones per CF."""
        lower, upper = keep.byte_bounds()
        for cf in self._cfs.values():
            if lower > b"\x00\x00":
                cf.delete_range(b"\x00\x00", lower)
            cf.delete_range(upper, b"\xff\xff\xff")
        self.mark_dirty()

    def compact(self) -> None:
        for name in self._cf_names:
            self.compact_range(name)

    def compact_range(self, cf_name: str, lower: bytes | None = None,
                      upper: bytes | None = None,
                      options: CompactOptions | None = None) -> None:
        """Compact ``[lower, upper)`` of family ``cf_name`` (None: open ends). A damaged
        block met by the compaction raises `CorruptStateError` naming the stored file:
        RocksDB does not fail the call, it records a background error and stops writing,
        and only the next write (a flush, a close) would report it."""
        self._cfs[cf_name].compact_range(lower, upper, options or CompactOptions())
        if not self.db.property_int_value("rocksdb.background-errors"):
            return
        what = f"a compaction of {self.scan_where(cf_name)}"
        try:
            self._cfs[cf_name].flush(True)
        except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
            raise damaged_state(what, exc, self.file_paths) from exc
        raise CorruptStateError(f"{what} failed; RocksDB reported a background error and "
                                "no cause")

    # -- snapshot: synchronous part ----------------------------------------
    def take_local_snapshot(self, count_rows: bool = True) -> LocalSnapshot:
        """Flush every CF and create a RocksDB native checkpoint (hard links)."""
        for cf in self._cfs.values():
            cf.flush(True)
        self.db.flush(True)
        snapshot_id = uuid.uuid4().hex
        os.makedirs(self.snapshots_path, exist_ok=True)
        path = os.path.join(self.snapshots_path, snapshot_id)
        Checkpoint(self.db).create_checkpoint(path)
        files = tuple(sorted((n, os.path.getsize(os.path.join(path, n))) for n in os.listdir(path)))
        rows = self._snapshot_counts() if count_rows else {}
        self._dirty = False
        self._last_snapshot_id = snapshot_id
        self._prune_local_snapshots(keep=snapshot_id)
        return LocalSnapshot(snapshot_id, path, files, rows)

    def _snapshot_counts(self) -> dict[str, int]:
        """The snapshot's row counts: tracked when known, else (or with
        ``CKPT_ROW_COUNTS=scan``) a scan; ``verify`` checks the tracked ones by a scan."""
        mode = settings.choice(ROW_COUNTS_ENV)
        if self._row_counts is None or mode == "scan":
            counted = self.count_rows()
        else:
            counted = dict(self._row_counts)
            if mode == "verify":
                scanned = self.count_rows()
                if scanned != counted:
                    raise SnapshotError(f"{self.label}: tracked row counts {counted} differ "
                                        f"from a scan's {scanned} ({ROW_COUNTS_ENV}=verify)")
        self._row_counts = dict(counted)
        return counted

    def _prune_local_snapshots(self, keep: str) -> None:
        try:
            entries = sorted(os.scandir(self.snapshots_path), key=lambda e: e.stat().st_mtime)
        except FileNotFoundError:
            return
        old = [e for e in entries if e.name != keep][: max(0, len(entries) - LOCAL_SNAPSHOTS_KEPT)]
        for e in old:
            shutil.rmtree(e.path, ignore_errors=True)

    def notify_checkpoint_complete(self, handle: CommittedHandle) -> None:
        """After a commit: its shared files may be referenced by later snapshots."""
        self.uploaded = {f.local_name: f for f in handle.shared_files}

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        """Close; if nothing changed since the last snapshot, mark the instance clean."""
        db = self._db
        if db is None:
            return
        clean = None if self._dirty else self._last_snapshot_id
        self._states.clear()
        self._cfs.clear()
        self._handles.clear()
        db.close()
        self._db = None
        POOLS.closed()
        if clean and not self.read_only:
            write_instance_marker(self.local_dir, self.backend_id, clean)

    def __enter__(self) -> KeyedStateBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forget_clean_marker(self) -> None:
        if not self.read_only:
            try:
                os.unlink(os.path.join(self.local_dir, INSTANCE_FILE))
            except FileNotFoundError:
                pass


def write_instance_marker(local_dir: str, backend_id: str, clean_snapshot_id: str) -> None:
    tmp = os.path.join(local_dir, INSTANCE_FILE + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"backend_id": backend_id, "clean_snapshot_id": clean_snapshot_id}, fh)
    os.replace(tmp, os.path.join(local_dir, INSTANCE_FILE))


def read_instance_marker(local_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(local_dir, INSTANCE_FILE)) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
