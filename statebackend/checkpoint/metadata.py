"""Checkpoint metadata: the `_metadata` commit record, as frozen dataclasses.

A checkpoint exists if and only if ``<job>/chk-<id>/_metadata`` exists. It is
written last, atomically, after every file it references has been uploaded.
The JSON carries ``format_version``; readers refuse versions they do not know
(naming the version), and every path in it is checked to be relative to the job
root with no ``..``. Changes must stay backward-compatible: add optional keys
with defaults, bump FORMAT_VERSION only for incompatible changes.

Parsing is strict (`from_bytes` / `from_json`): a record that parses but makes no
sense is refused with a MetadataError naming the file (``where``) and the broken
invariant, because every lifecycle planner trusts it (a record with P=0 and no
subtasks once let GC delete every file of the job). Invariants:

- 1 <= parallelism P <= max_parallelism M <= 32768, and exactly P subtasks;
- subtask indexes are 0..P-1 in order and each key-group range equals Flink's
  formula (`keygroups.key_group_range_for_subtask`): no gap, no overlap;
- states have unique, valid names, a known kind and a known codec;
- sizes, bytes_uploaded and row counts are integers in [0, MAX_COUNT];
  checkpoint_id >= 1; a parent, when set, is 1 <= parent < checkpoint_id;
- JSON nesting is at most MAX_NESTING deep (deeper input only exists to crash
  recursive readers with RecursionError);
- names are printable (no NUL or control character: RocksDB and C libraries cut
  or panic on them): state names, paths and ``local_name``s; a ``local_name`` is
  one plain file name (no ``/`` or ``\\``), unique within its subtask;
- a checksum is ``crc32c:`` or ``crc32:`` and at most 8 hex digits;
- every file lies where the layout puts a file of this record (issue 20, defect 2:
  a tampered record must not make retention delete what is not its own): a
  checkpoint references ``shared/<file>`` and ``chk-<k>/<subtask>/<snapshot>/<file>``
  with ``k`` its own id or an earlier one (a subtask without new rows carries its
  parent's handle forward), never a ``_metadata``, ``_attempts``, ``savepoints/``,
  ``runs/``, ``leases/``, ``reports/`` or ``_index/`` path; a savepoint references
  only ``savepoints/<its name>/<subtask>/<file>``.

Layout of one record (format 1)::

    {"format_version": 1, "job": "orders", "checkpoint_id": 7, "parent": 6,
     "kind": "checkpoint" | "rescale" | "savepoint",
     "created_at": "2026-11-21T10:00:00.123456+00:00",
     "run_id": "...", "input": ["..."], "parallelism": 4, "max_parallelism": 128,
     "rescaled_from": null, "source": null,
     "states": [{"name": "totals", "kind": "value", "codec": {...}}],
     "subtasks": [{"index": 0, "key_group_start": 0, "key_group_end": 31,
                   "backend_id": "...", "snapshot_id": "...", "bytes_uploaded": 123,
                   "shared_files": [{"path": "shared/<uuid>-000012.sst",
                                     "local_name": "000012.sst", "size": 1,
                                     "checksum": "crc32c:...",
                                     "rows": {"totals": 3}}],  # optional (FileRef)
                   "private_files": [...], "row_counts": {"totals": 10}}],
     "extra": {},
     "watermark": 1700000000000, "processing_time": 1700003600000}

``epoch`` (optional, an integer >= 1) is the fencing epoch of the writer that
committed the record (`statebackend.checkpoint.leases`); records written before
epochs have none (read as 0), and an epoch never goes down along a lineage.

A subtask's ``backend`` (optional, ``memory`` or ``external``) names the state backend
whose files it lists (`statebackend.state.backend_kinds`); without it, ``rocksdb``.
An external-backend checkpoint has ``"external": {"store": "postgresql://user@host:port/db
#table", "job": "...", "version": 7, "parent": 6}``: the committed database version its
state is (`ExternalVersion`; the store named without credentials); in WAL mode it adds
``"mode": "wal"`` and its subtasks list their write-ahead logs (``wal-*`` shared files).
``key_hash`` (optional, ``spark``) names the hash that places the lineage's keys in key
groups (`statebackend.state.keygroups`); records without it, as every record of
earlier releases, are ``murmur3``. It never changes along a lineage.

``watermark`` (event time, epoch ms: max event time seen minus the allowed
lateness, never decreasing) and ``processing_time`` (the logical time of the run
that wrote the record, epoch ms) are optional: written only when set, absent or
null means "none yet" (records of earlier releases load unchanged). A state may
carry ``"ttl": {"duration_ms", "time", "update_on"}``; internal column families
(``_timers``, ``_timer_keys``, ``_ttl``) appear in ``states`` with their kinds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import cache
from typing import Any, TypeAlias

from statebackend.checkpoint.layout import METADATA_FILE, SAVEPOINTS_DIR, SHARED_DIR, chk_id_of
from statebackend.checkpoint.metrics import MemoryHeadroom, run_figures
from statebackend.defaults import BACKENDS, EXTERNAL_MODES
from statebackend.errors import CkptError, MetadataError, UnsupportedFormatVersionError
from statebackend.fast_json import fast_loads, pretty_json
from statebackend.state.families import INTERNAL_STATES
from statebackend.state.keygroups import (
    KEY_HASHES,
    MAX_MAX_PARALLELISM,
    MURMUR3,
    KeyGroupRange,
    key_group_range_for_subtask,
)
from statebackend.state.schema import check_schema_keys
from statebackend.storage import safe_relpath

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)
CHECKPOINT_KINDS = ("checkpoint", "rescale", "savepoint")
# The deepest record this release writes is 6 levels (states -> codec -> fields);
# free-form parts (source, extra) get room to grow, not room to crash a reader.
MAX_NESTING = 32
MAX_COUNT = 2**53            # sizes, row counts, ids: larger is damage, not data
MAX_NAME_LENGTH = 255
_CHECKSUM = re.compile(r"(crc32c|crc32):[0-9a-f]{1,8}")
_SUBTASK_DIR = re.compile(r"[0-9]{1,5}")
# What `parse_metadata` remembers across records: each validated FileRef under its
# (path, local_name, size, checksum), and under "scope" each path's classification
# (`_scope_of`). A plain dict: callers start it as ``{}``.
ParseMemo: TypeAlias = dict[Any, Any]


def utc_now_iso() -> str:
    return datetime.now(UTC).isoformat()


@dataclass(frozen=True)
class FileRef:
    """One stored file: path relative to the job root, its name in the RocksDB dir.

    ``rows`` (optional): the entries of each state the file holds, where a file holds
    whole states of its key groups (the memory backend's key-group files): a rescale
    that regroups such files counts its new subtasks' rows from them without reading
    any. () when not recorded (every SST, and files written before it existed).

    ``key_groups`` (optional, the memory backend's files): the key groups this subtask
    takes from the file, each with its entries per state; ``rows`` is then their sum
    (derived, not stored). A segment may hold other key groups too (rewritten since, or
    another subtask's after a rescale): a reader takes only these."""

    path: str
    local_name: str
    size: int
    checksum: str
    rows: tuple[tuple[str, int], ...] = ()
    key_groups: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.key_groups:
            object.__setattr__(self, "rows", _summed(r for _, r in self.key_groups))

    @property
    def key_group_ids(self) -> tuple[int, ...]:
        return tuple(kg for kg, _ in self.key_groups)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "local_name": self.local_name,
                               "size": self.size, "checksum": self.checksum}
        if self.key_groups:
            out["key_groups"] = {str(kg): dict(rows) for kg, rows in self.key_groups}
        elif self.rows:
            out["rows"] = dict(self.rows)
        return out

    @staticmethod
    def from_json(data: Any, where: str) -> FileRef:
        _require(isinstance(data, dict), where, "file reference is not an object")
        raw_path = _get(data, "path", str, where)
        _require(_printable(raw_path) and "\\" not in raw_path, where,
                 f"path {raw_path!r} has a control character or a backslash")
        path = safe_relpath(raw_path, f"{where} path")
        local_name = _get(data, "local_name", str, where)
        _require(is_plain_name(local_name), where,
                 f"local_name {local_name!r} must be a plain file name")
        size = _get(data, "size", int, where)
        _require(size >= 0, where, f"size {size} is negative")
        _require(size <= MAX_COUNT, where, f"size {size} is larger than 2**53 bytes")
        checksum = _get(data, "checksum", str, where)
        _require(_CHECKSUM.fullmatch(checksum) is not None, where,
                 f"checksum {checksum!r} is not crc32c:<hex> or crc32:<hex> (8 digits at most)")
        rows = data.get("rows", {})
        _require(_is_counts(rows), where,
                 f"rows {str(rows)[:200]} of {local_name} must map state names to integers "
                 "in 0..2**53")
        if "key_groups" not in data:
            return FileRef(path, local_name, size, checksum, tuple(sorted(rows.items())))
        key_groups = data["key_groups"]
        _require(isinstance(key_groups, dict) and all(
            k.isdigit() and len(k) <= 5 and _is_counts(v) for k, v in key_groups.items()),
            where, f"key_groups {str(key_groups)[:200]} of {local_name} must map key groups "
            "to entries per state")
        ref = FileRef(path, local_name, size, checksum, (), tuple(sorted(
            (int(k), tuple(sorted(v.items()))) for k, v in key_groups.items())))
        _require(not rows or tuple(sorted(rows.items())) == ref.rows, where,
                 f"rows of {local_name} are not the sum of its key_groups")
        return ref


@dataclass(frozen=True)
class SubtaskHandle:
    """State of one subtask in one checkpoint: the files that restore it."""

    index: int
    key_group_start: int
    key_group_end: int
    backend_id: str
    snapshot_id: str
    shared_files: tuple[FileRef, ...]
    private_files: tuple[FileRef, ...]
    row_counts: dict[str, int] = field(default_factory=dict)
    bytes_uploaded: int = 0
    backend: str = "rocksdb"  # the state backend whose files these are (state.backend_kinds)

    @property
    def key_group_range(self) -> KeyGroupRange:
        return KeyGroupRange(self.key_group_start, self.key_group_end)

    @property
    def files(self) -> tuple[FileRef, ...]:
        return self.shared_files + self.private_files

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def file_key_groups(self) -> dict[str, tuple[int, ...]]:
        """local name -> the key groups read from it, for files that name them."""
        return {f.local_name: f.key_group_ids for f in self.files if f.key_groups}

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "key_group_start": self.key_group_start,
            "key_group_end": self.key_group_end,
            "backend_id": self.backend_id,
            "snapshot_id": self.snapshot_id,
            "bytes_uploaded": self.bytes_uploaded,
            "shared_files": [f.to_json() for f in self.shared_files],
            "private_files": [f.to_json() for f in self.private_files],
            "row_counts": dict(self.row_counts),
            **({} if self.backend == "rocksdb" else {"backend": self.backend}),
        }

    @staticmethod
    def from_json(data: Any, where: str) -> SubtaskHandle:
        _require(isinstance(data, dict), where, "subtask is not an object")
        index = _get(data, "index", int, where)
        w = f"{where} subtask {index}"
        shared = _get(data, "shared_files", list, w)
        private = _get(data, "private_files", list, w)
        counts = data.get("row_counts", {})
        _require(_is_counts(counts), w,
                 f"row_counts {str(counts)[:200]} must map state names to integers in 0..2**53")
        uploaded = data.get("bytes_uploaded", 0)
        _require(_is_int(uploaded) and 0 <= uploaded <= MAX_COUNT, w,
                 f"bytes_uploaded {uploaded!r} must be an integer >= 0 (at most 2**53)")
        backend = data.get("backend", "rocksdb")
        _require(backend in BACKENDS, w, f"backend {backend!r} is not one of {list(BACKENDS)}")
        handle = SubtaskHandle(
            index=index,
            key_group_start=_get(data, "key_group_start", int, w),
            key_group_end=_get(data, "key_group_end", int, w),
            backend_id=_get(data, "backend_id", str, w),
            snapshot_id=_get(data, "snapshot_id", str, w),
            shared_files=tuple(FileRef.from_json(f, w) for f in shared),
            private_files=tuple(FileRef.from_json(f, w) for f in private),
            row_counts=dict(counts),
            bytes_uploaded=uploaded,
            backend=backend,
        )
        check_local_names(handle, w)
        return handle


def _summed(rows: Iterable[tuple[tuple[str, int], ...]]) -> tuple[tuple[str, int], ...]:
    """Entries per state over several key groups, by state name."""
    total: dict[str, int] = {}
    for r in rows:
        for name, n in r:
            total[name] = total.get(name, 0) + n
    return tuple(sorted(total.items()))


def check_local_names(handle: SubtaskHandle, where: str) -> None:
    """A subtask's files land in one folder by ``local_name``: two of one name would
    overwrite each other at restore (a corrupt instance). A key group a file serves
    (`FileRef.key_groups`) is the subtask's, and one file's only."""
    seen: set[str] = set()
    served: set[int] = set()
    r = handle.key_group_range
    for ref in handle.files:
        _require(ref.local_name not in seen, where,
                 f"local_name {ref.local_name!r} appears twice in subtask {handle.index}")
        seen.add(ref.local_name)
        if not ref.key_groups:  # (every SST: this runs for each reference of each record)
            continue
        for kg in ref.key_group_ids:
            _require(kg in r, where, f"{ref.local_name} serves key group {kg}, outside "
                     f"subtask {handle.index}'s [{r.start}, {r.end}]")
            _require(kg not in served, where,
                     f"key group {kg} is served by two files of subtask {handle.index}")
            served.add(kg)


def is_plain_name(name: str) -> bool:
    """One printable file name: no separator, not ``.``/``..``, at most 255 characters."""
    return (0 < len(name) <= MAX_NAME_LENGTH and _printable(name) and "/" not in name
            and "\\" not in name and name not in (".", ".."))


def _printable(text: str) -> bool:
    return text.isprintable()


@dataclass(frozen=True)
class ExternalVersion:
    """The database version an external-backend checkpoint's state is
    (statebackend.state.external_store): ``version`` of ``job`` in ``store`` (the URL
    without credentials, ``#table``), written over ``parent`` (None: the first)."""

    store: str
    job: str
    version: int
    parent: int | None = None
    # "mvcc" (versioned rows) or "wal" (one current state, each checkpoint's write-ahead
    # logs applied to it after its commit: statebackend.state.external_wal)
    mode: str = "mvcc"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"store": self.store, "job": self.job, "version": self.version,
                               "parent": self.parent}
        if self.mode != "mvcc":  # records of MVCC checkpoints read as before
            out["mode"] = self.mode
        return out

    @staticmethod
    def from_json(obj: Any, where: str) -> ExternalVersion:
        _require(isinstance(obj, dict), where, "external must be an object")
        parent = obj.get("parent")
        _require(parent is None or (_is_int(parent) and parent >= 0), where,
                 "external.parent must be a version or null")
        version = _get(obj, "version", int, where)
        _require(0 <= version <= MAX_COUNT, where, f"external.version {version} is out of range")
        mode = obj.get("mode", "mvcc")
        _require(mode in EXTERNAL_MODES, where, f"external.mode {mode!r} is not one of "
                 f"{list(EXTERNAL_MODES)}")
        return ExternalVersion(_get(obj, "store", str, where), _get(obj, "job", str, where),
                               version, parent, mode)


def recorded_total(counts: Iterable[int | None]) -> int | None:
    """The sum of row ``counts``; None when one of them is not recorded."""
    known = list(counts)
    return None if None in known else sum(c or 0 for c in known)


@dataclass(frozen=True)
class CheckpointMetadata:
    """The commit record of one checkpoint (or savepoint)."""

    job: str
    checkpoint_id: int
    parent: int | None
    parallelism: int
    max_parallelism: int
    states: tuple[dict[str, Any], ...]
    subtasks: tuple[SubtaskHandle, ...]
    created_at: str = field(default_factory=utc_now_iso)
    kind: str = "checkpoint"
    run_id: str | None = None
    input: tuple[str, ...] = ()
    rescaled_from: int | None = None
    source: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    watermark: int | None = None
    processing_time: int | None = None
    epoch: int = 0  # fencing epoch of the writer (0: written before epochs)
    key_hash: str = MURMUR3  # how the lineage's keys are placed in key groups
    external: ExternalVersion | None = None  # the external backend's version

    # -- derived figures ---------------------------------------------------
    @property
    def state_backend(self) -> str:
        """The state backend of this checkpoint (its subtasks' files): rocksdb or memory."""
        return self.subtasks[0].backend if self.subtasks else "rocksdb"

    @property
    def files(self) -> tuple[FileRef, ...]:
        return tuple(f for s in self.subtasks for f in s.files)

    @property
    def bytes_referenced(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def bytes_uploaded(self) -> int:
        return sum(s.bytes_uploaded for s in self.subtasks)

    @property
    def created_at_epoch(self) -> float:
        return datetime.fromisoformat(self.created_at).timestamp()

    def with_changes(self, **changes: Any) -> CheckpointMetadata:
        return replace(self, **changes)

    def subtask_rows(self, handle: SubtaskHandle) -> int | None:
        """The entries ``handle`` records over every state; None when it records none of
        a checkpoint with states: a rescale that read nothing (an external checkpoint's
        rows are in its database), counted again by the next run."""
        if not handle.row_counts and self.states:
            return None
        return sum(handle.row_counts.values())

    def rows(self) -> int | None:
        """`subtask_rows` over every subtask; None when one of them is not recorded."""
        return recorded_total(self.subtask_rows(s) for s in self.subtasks)

    def state_memory(self) -> MemoryHeadroom | None:
        """The run's largest subtask state in memory against its limit, as its commit
        recorded it (None: not a memory or external backend's run, or not recorded)."""
        return MemoryHeadroom.from_json(run_figures(self.extra).get("state_memory"))

    def summary(self) -> dict[str, Any]:
        """The stable JSON shape of `ckpt show --json` / `ckpt list --json`."""
        return {
            "id": self.checkpoint_id,
            "job": self.job,
            "kind": self.kind,
            "parent": self.parent,
            "created_at": self.created_at,
            "run_id": self.run_id,
            "parallelism": self.parallelism,
            "max_parallelism": self.max_parallelism,
            "rescaled_from": self.rescaled_from,
            "source": self.source,
            "files_referenced": len(self.files),
            "bytes_referenced": self.bytes_referenced,
            "bytes_uploaded": self.bytes_uploaded,
            "rows": self.rows(),  # None: not recorded (`subtask_rows`)
            "watermark": self.watermark,
            "processing_time": self.processing_time,
            "key_hash": self.key_hash,
            "state_backend": self.state_backend,
            "external": None if self.external is None else self.external.to_json(),
            # a memory or external backend's run: its largest state in memory, its limit
            "state_memory": None if (memory := self.state_memory()) is None
            else memory.to_json(),
            "states": [s["name"] for s in self.states],
            # each state's schema (statebackend.state.schema): versions and history
            "schemas": [dict(s) for s in self.states],
            "subtasks": [
                {"index": s.index, "key_group_start": s.key_group_start,
                 "key_group_end": s.key_group_end, "files": len(s.files),
                 "bytes": s.size, "bytes_uploaded": s.bytes_uploaded,
                 "rows": self.subtask_rows(s)}
                for s in self.subtasks
            ],
        }

    # -- serialization -----------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": self.format_version,
            "job": self.job,
            "checkpoint_id": self.checkpoint_id,
            "parent": self.parent,
            "kind": self.kind,
            "created_at": self.created_at,
            "run_id": self.run_id,
            "input": list(self.input),
            "parallelism": self.parallelism,
            "max_parallelism": self.max_parallelism,
            "rescaled_from": self.rescaled_from,
            "source": self.source,
            "states": [dict(s) for s in self.states],
            "subtasks": [s.to_json() for s in self.subtasks],
            "extra": self.extra,
        }
        # optional keys only when set: a record without them reads as before
        if self.watermark is not None:
            out["watermark"] = self.watermark
        if self.processing_time is not None:
            out["processing_time"] = self.processing_time
        if self.epoch:
            out["epoch"] = self.epoch
        if self.key_hash != MURMUR3:
            out["key_hash"] = self.key_hash
        if self.external is not None:
            out["external"] = self.external.to_json()
        return out

    def to_bytes(self) -> bytes:
        return pretty_json(self.to_json())

    @staticmethod
    def from_bytes(data: bytes, where: str) -> CheckpointMetadata:
        """Parse and check a `_metadata` file; ``where`` names it in errors."""
        return CheckpointMetadata.from_json(decode_json(data, where, json.loads), where)

    @staticmethod
    def from_json(obj: Any, where: str) -> CheckpointMetadata:
        _require(isinstance(obj, dict), where, "top level is not an object")
        version = obj.get("format_version")
        if not _is_int(version) or version not in SUPPORTED_FORMAT_VERSIONS:
            raise UnsupportedFormatVersionError(
                f"metadata {where} has format version {version!r}; this tool reads "
                f"{list(SUPPORTED_FORMAT_VERSIONS)} (upgrade the tool to read newer checkpoints)")
        kind = obj.get("kind", "checkpoint")
        _require(kind in CHECKPOINT_KINDS, where, f"unknown kind {kind!r}")
        states = _get(obj, "states", list, where)
        _require(all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in states),
                 where, "states must be objects with a name")
        subtasks = tuple(SubtaskHandle.from_json(s, where)
                         for s in _get(obj, "subtasks", list, where))
        parent = obj.get("parent")
        _require(parent is None or _is_int(parent), where, "parent must be an id or null")
        run_id = obj.get("run_id")
        _require(run_id is None or isinstance(run_id, str), where, "run_id must be a string")
        inputs = obj.get("input") or []
        _require(isinstance(inputs, list) and all(isinstance(i, str) for i in inputs), where,
                 "input must be a list of strings")
        source, extra = obj.get("source"), obj.get("extra") or {}
        _require(source is None or isinstance(source, dict), where,
                 "source must be an object or null")
        _require(isinstance(extra, dict), where, "extra must be an object")
        watermark, processing_time = obj.get("watermark"), obj.get("processing_time")
        for name, value in (("watermark", watermark), ("processing_time", processing_time)):
            _require(value is None or _is_int(value), where,
                     f"{name} {value!r} must be an integer (epoch ms) or null")
        key_hash = obj.get("key_hash", MURMUR3)
        _require(key_hash in KEY_HASHES, where,
                 f"key_hash {key_hash!r} is not one of {list(KEY_HASHES)}")
        epoch = obj.get("epoch", 0)
        _require(_is_int(epoch) and 0 <= epoch <= MAX_COUNT, where,
                 f"epoch {epoch!r} must be an integer >= 0")
        _check_nesting({"states": states, "source": source, "extra": extra}, where)
        _check_states(states, where)
        created_at = _get(obj, "created_at", str, where)
        try:
            datetime.fromisoformat(created_at)
        except ValueError as exc:
            raise MetadataError(f"malformed metadata {where}: created_at {created_at!r}") from exc
        meta = CheckpointMetadata(
            job=_get(obj, "job", str, where),
            checkpoint_id=_get(obj, "checkpoint_id", int, where),
            parent=parent,
            parallelism=_get(obj, "parallelism", int, where),
            max_parallelism=_get(obj, "max_parallelism", int, where),
            states=tuple(states),
            subtasks=subtasks,
            created_at=created_at,
            kind=kind,
            run_id=run_id,
            input=tuple(inputs),
            rescaled_from=obj.get("rescaled_from"),
            source=source,
            extra=extra,
            format_version=version,
            watermark=watermark,
            processing_time=processing_time,
            epoch=epoch,
            key_hash=key_hash,
            external=None if obj.get("external") is None
            else ExternalVersion.from_json(obj["external"], where),
        )
        _check_ids(meta, where)
        _check_key_groups(meta, where)
        _require((meta.state_backend == "external") == (meta.external is not None), where,
                 "an external-backend checkpoint (and only one) records its external version")
        check_file_scope(meta, where)
        return meta


def decode_json(data: bytes, where: str, loads: Any) -> Any:
    """``loads(data)`` with every decoding failure as one MetadataError naming ``where``.

    Both the stdlib and msgspec decoders recurse per nesting level: a record like
    ``[[[[...]]]]`` 100,000 deep raises RecursionError, which no caller expects.
    """
    try:
        return loads(data)
    except RecursionError as exc:
        raise MetadataError(
            f"malformed metadata {where}: JSON nested too deeply (a `_metadata` is at most "
            f"{MAX_NESTING} levels deep); the file is damaged or not a commit record") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise MetadataError(
            f"malformed or truncated metadata {where}: not valid JSON ({exc})") from exc


def check_file_scope(meta: CheckpointMetadata, where: str, memo: ParseMemo | None = None
                     ) -> None:
    """Every file of ``meta`` lies where the layout puts this record's files (module doc).

    ``memo`` (shared across records): a path's classification is computed once."""
    if meta.kind == "savepoint":
        names = set()
        for ref in meta.files:
            parts = ref.path.split("/")
            _require(len(parts) == 4 and parts[0] == SAVEPOINTS_DIR
                     and _SUBTASK_DIR.fullmatch(parts[2]) is not None
                     and parts[3] != METADATA_FILE, where,
                     f"savepoint file {ref.path!r} is not savepoints/<name>/<subtask>/<file>")
            names.add(parts[1])
        _require(len(names) <= 1, where, f"savepoint files span several savepoints "
                                         f"{sorted(names)[:3]}")
        return
    own = meta.checkpoint_id
    kinds: dict[str, int | str] = memo.setdefault("scope", {}) if memo is not None else {}
    for sub in meta.subtasks:
        for ref in sub.shared_files + sub.private_files:
            k = kinds.get(ref.path)
            if k is None:
                k = kinds[ref.path] = _scope_of(ref.path)
            if isinstance(k, str):
                raise MetadataError(f"malformed metadata {where}: {k}")
            _require(k <= own, where, f"file {ref.path!r} lies in a later checkpoint's folder "
                                      f"(chk-{k} > chk-{own})")


def _scope_of(path: str) -> int | str:
    """0 for ``shared/<file>``, k for ``chk-<k>/<subtask>/<snapshot>/<file>``, else why not."""
    parts = path.split("/")
    if parts[0] == SHARED_DIR:
        if len(parts) == 2 and not parts[1].startswith(("_", ".")):
            return 0
        return f"shared file {path!r} is not shared/<file>"
    k = _chk_id(parts[0])
    if k is None or len(parts) != 4:
        return (f"file {path!r} is neither shared/<file> nor "
                "chk-<id>/<subtask>/<snapshot>/<file> (a checkpoint references nothing else)")
    if _SUBTASK_DIR.fullmatch(parts[1]) is None or parts[2].startswith(("_", ".")) \
            or parts[3] == METADATA_FILE:
        return f"file {path!r} is not a private file chk-<id>/<subtask>/<snapshot>/<file>"
    return k


def _chk_id(segment: str) -> int | None:
    k = chk_id_of(segment)
    return k if k is not None and segment.isascii() and len(segment) < 20 else None


def _check_ids(meta: CheckpointMetadata, where: str) -> None:
    cid, parent = meta.checkpoint_id, meta.parent
    _require(1 <= cid <= MAX_COUNT, where, f"checkpoint_id {cid} must be at least 1 (and at "
                                           "most 2**53)")
    _require(parent is None or 1 <= parent < cid, where,
             f"parent {parent} must be an earlier checkpoint id (1..{cid - 1}) or null")
    origin = meta.rescaled_from
    _require(origin is None or (_is_int(origin) and 1 <= origin <= meta.max_parallelism),
             where, f"rescaled_from {origin!r} must be a parallelism "
                    f"(1..{meta.max_parallelism}) or null")


def _check_key_groups(meta: CheckpointMetadata, where: str) -> None:
    """1 <= P <= M <= 32768; subtasks 0..P-1 in order, ranges exactly Flink's formula."""
    m, p = meta.max_parallelism, meta.parallelism
    _require(1 <= m <= MAX_MAX_PARALLELISM, where,
             f"max_parallelism {m} is out of range 1..{MAX_MAX_PARALLELISM}")
    _require(1 <= p <= m, where, f"parallelism {p} is out of range 1..max_parallelism {m}")
    _require(len(meta.subtasks) == p, where,
             f"{len(meta.subtasks)} subtasks recorded for parallelism {p}")
    for i, sub in enumerate(meta.subtasks):
        _require(sub.index == i, where,
                 f"subtask #{i} has index {sub.index}; indexes must be 0..{p - 1} in order")
        want = key_group_range_for_subtask(m, p, i)
        _require(sub.key_group_range == want, where,
                 f"subtask {i} covers key groups [{sub.key_group_start}, {sub.key_group_end}], "
                 f"expected [{want.start}, {want.end}] for parallelism {p} and max "
                 f"parallelism {m} (ranges must tile [0, {m}) with no gap or overlap)")


def _check_states(states: list[dict[str, Any]], where: str) -> None:
    """Unique valid names, known kinds and codecs: what dump/validate/rescale decode with."""
    codec_from_json, state_kinds, ttl_from_json = _state_vocabulary()
    seen: set[str] = set()
    for s in states:
        name = s["name"]
        _require(bool(name) and name != "default" and "/" not in name and "\\" not in name
                 and _printable(name) and len(name) <= MAX_NAME_LENGTH, where,
                 f"state name {name!r} is not allowed (printable, no '/', at most "
                 f"{MAX_NAME_LENGTH} characters)")
        _require(name not in seen, where, f"state {name!r} is declared twice")
        seen.add(name)
        kind = s.get("kind", "value")
        if name in INTERNAL_STATES:
            reserved = INTERNAL_STATES[name]
            _require(kind == reserved, where,
                     f"state {name!r} is reserved for kind {reserved!r}, got {kind!r}")
        else:
            _require(kind in state_kinds, where, f"state {name!r} has unknown kind {kind!r} "
                                                 f"(known: {', '.join(state_kinds)})")
        _require(s.get("ttl") is None or name not in INTERNAL_STATES, where,
                 f"state {name!r} is internal and cannot have a TTL")
        why = check_schema_keys(s)
        _require(why is None, where, f"state {name!r}: {why}")
        try:
            codec_from_json(s.get("codec", {"type": "json"}))
            if s.get("ttl") is not None:
                ttl_from_json(s["ttl"])
        except CkptError as exc:  # SerializationError, or UsageError from RecordCodec
            raise MetadataError(f"malformed metadata {where}: state {name!r}: {exc}") from exc


# (codec_from_json, STATE_KINDS, StateTtl.from_json)
_StateVocabulary: TypeAlias = tuple[Callable[[Any], object], tuple[str, ...],
                                    Callable[[Any], object]]


@cache
def _state_vocabulary() -> _StateVocabulary:
    # lazy: state and serialization pull in rocksdict and numpy, which a CLI start
    # or a DAG parse that never reads metadata should not pay for
    from statebackend.state.codecs import codec_from_json
    from statebackend.state.kinds import STATE_KINDS
    from statebackend.state.ttl import StateTtl

    return codec_from_json, STATE_KINDS, StateTtl.from_json


def _check_nesting(value: dict[str, Any] | list[Any], where: str) -> None:
    """Refuse JSON deeper than MAX_NESTING (level by level: must not recurse itself)."""
    level: list[Any] = [value]
    for _ in range(MAX_NESTING):
        level = [child for item in level
                 for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, dict | list)]
        if not level:
            return
    raise MetadataError(f"malformed metadata {where}: JSON nested more than {MAX_NESTING} "
                        "levels deep")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise MetadataError(f"malformed metadata {where}: {message}")


def _is_counts(value: object) -> bool:
    """A mapping of state names to counts in [0, MAX_COUNT] (row_counts, a file's rows)."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and _is_int(v) and 0 <= v <= MAX_COUNT for k, v in value.items())


def _get(obj: dict[str, Any], key: str, typ: type, where: str) -> Any:
    if key not in obj:
        raise MetadataError(f"malformed metadata {where}: missing key {key!r}")
    value = obj[key]
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise MetadataError(
            f"malformed metadata {where}: {key!r} should be {typ.__name__}, got {value!r}")
    return value


def listed_paths(data: bytes) -> list[str] | None:
    """The ``path`` of every file reference in `_metadata` bytes, read without checking
    the rest of the record (None: not laid out as one). Only for re-checks that spare
    the files named: a wrong path there keeps a file, never deletes one."""
    if _paths_decoder is not None:  # typed: the rest of the record is skipped unread
        try:
            record = _paths_decoder.decode(data)
        except (ValueError, RecursionError):  # (msgspec's errors are ValueErrors)
            return None
        return [ref.path for sub in record.subtasks
                for refs in (sub.shared_files, sub.private_files) for ref in refs]
    try:
        obj: Any = fast_loads(data)
    except (ValueError, RecursionError):
        return None
    subtasks = obj.get("subtasks") if isinstance(obj, dict) else None
    if not isinstance(subtasks, list):
        return None
    paths = []
    for sub in subtasks:
        for key in ("shared_files", "private_files"):
            refs = sub.get(key) if isinstance(sub, dict) else None
            if not isinstance(refs, list):
                return None
            for ref in refs:
                path = ref.get("path") if isinstance(ref, dict) else None
                if not isinstance(path, str):
                    return None
                paths.append(path)
    return paths


# A decoder of a record's file paths alone (10,000 records: 0.25 s instead of 0.43 s
# decoded whole), or None without msgspec (the generic walk in listed_paths).
_paths_decoder: Any = None
try:
    import msgspec as _msgspec

    class _PathRef(_msgspec.Struct):
        path: str

    class _PathSubtask(_msgspec.Struct):
        shared_files: list[_PathRef]
        private_files: list[_PathRef]

    class _PathRecord(_msgspec.Struct):
        subtasks: list[_PathSubtask]

    _paths_decoder = _msgspec.json.Decoder(_PathRecord)
except ImportError:  # pragma: no cover - msgspec is an Airflow dependency
    pass


def parse_metadata(data: bytes, where: str, memo: ParseMemo) -> CheckpointMetadata:
    """`CheckpointMetadata.from_bytes`, with each distinct file reference validated once.

    Thousands of checkpoints list the same shared files again and again; parsing
    each reference once (keyed by its exact, typed values) keeps planning over
    10,000 checkpoints fast. Every reference still goes through FileRef.from_json
    and everything else through CheckpointMetadata.from_json, so the result and
    the errors are the same as `from_bytes`.
    """
    obj = decode_json(data, where, fast_loads)
    if not isinstance(obj, dict) or not isinstance(obj.get("subtasks"), list) \
            or not all(isinstance(s, dict) for s in obj["subtasks"]):
        return CheckpointMetadata.from_json(obj, where)  # raises the precise error
    try:
        refs = _take_refs(obj, where, memo)
    except MetadataError:
        # the strict parser checks a subtask's own keys before its file references
        # and names the subtask: let it give the precise error (an error path only)
        return CheckpointMetadata.from_bytes(data, where)
    meta = CheckpointMetadata.from_json(obj, where)
    subtasks = tuple(replace(s, shared_files=shared, private_files=private)
                     for s, (shared, private) in zip(meta.subtasks, refs, strict=True))
    meta = replace(meta, subtasks=subtasks)
    # from_json saw the subtasks without their files: check what depends on them here
    for sub in subtasks:
        check_local_names(sub, f"{where} subtask {sub.index}")
    check_file_scope(meta, where, memo)
    return meta


def _take_refs(obj: dict[str, Any], where: str, memo: ParseMemo
               ) -> list[tuple[tuple[FileRef, ...], tuple[FileRef, ...]]]:
    """Each subtask's (shared, private) references, memoised; the lists are emptied in
    place (``obj`` is ours, freshly decoded) so from_json skips them."""
    get = memo.get
    refs: list[tuple[tuple[FileRef, ...], tuple[FileRef, ...]]] = []
    for sub in obj["subtasks"]:
        pair: list[tuple[FileRef, ...]] = []
        for key in ("shared_files", "private_files"):
            entries = sub.get(key)
            if not isinstance(entries, list):
                pair.append(())
                continue
            out: list[FileRef] = []
            for e in entries:  # the fast path of _memo_ref, inlined: 1M references
                try:
                    ref = get((e["path"], e["local_name"], e["size"], e["checksum"]))
                except (TypeError, KeyError, IndexError):
                    ref = None
                if ref is None or type(e["size"]) is not int or len(e) != 4:
                    ref = _memo_ref(e, where, memo)
                out.append(ref)
            pair.append(tuple(out))
            sub[key] = []
        refs.append((pair[0], pair[1]))
    return refs


def _memo_ref(entry: Any, where: str, memo: ParseMemo) -> FileRef:
    """``entry`` (decoded JSON, anything) as a FileRef, from ``memo`` when seen before."""
    key: tuple[Any, ...] | None
    try:
        key = (entry["path"], entry["local_name"], entry["size"], entry["checksum"])
        ref = memo.get(key)
    except (TypeError, KeyError, IndexError):  # not a dict, or unhashable values
        key, ref = None, None
    # strings only equal strings, but True == 1.0 == 1: re-check the size's type
    if isinstance(ref, FileRef) and type(entry["size"]) is int and len(entry) == 4:
        return ref
    ref = FileRef.from_json(entry, where)  # raises on anything malformed
    if key is not None and type(entry) is dict and len(entry) == 4:
        memo[key] = ref
    return ref
