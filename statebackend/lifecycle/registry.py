"""Shared-state registry of one job: which committed state references which file.

Built, read-only, from one job root::

    <job>/shared/<unique>.sst            referenced by any number of checkpoints
    <job>/chk-<id>/_metadata             commit record (the checkpoint exists iff present)
    <job>/chk-<id>/<subtask>/<snap>/...  private files of that checkpoint (or of a
                                         failed attempt that used the same id)
    <job>/savepoints/<name>/_metadata    self-contained savepoint (kind "savepoint")
    <job>/leases/<lease>.json            writer lease and hold leases

Owners: every committed checkpoint (label ``chk-<id>``) and every savepoint
(label ``savepoint:<name>``). A file is *referenced* when at least one owner
lists it; an *orphan* is a file under ``shared/`` or ``chk-*/`` that no owner
lists (an upload of a failed or aborted attempt, or a leftover of an
interrupted retention) -- never a committed ``_metadata``.

Build order (why it matters, see gc.py): the job root is listed *first*, then
leases and metadata are read. A checkpoint committed after the listing is
therefore seen as an owner, so its files are never mistaken for orphans.

Reading is strict: a malformed `_metadata` or lease raises MetadataError, and
every planner built on the registry refuses to plan (it cannot know what an
unreadable checkpoint references). A `_metadata` or lease that disappears
between listing and reading (a concurrent retention or release) is skipped:
it no longer exists. Metadata is read by a thread pool (I/O bound on S3).

Paths come from checkpoint/layout.py; committed ids from the one lister
(`CheckpointStore.checkpoint_ids`), records from the one `_metadata` reader
(`CheckpointStore.parse`), leases from the one lease reader (leases.py).

Scale (10,000 checkpoints x 100 references): each distinct file reference is
validated once (`metadata.parse_metadata`), committed ids come from one listing
of the job's folders, ``file://`` is listed with ``os.scandir`` (local.py), and
planners use set algebra over `owner_paths` instead of per-reference loops.

Registry index (``<job>/_index/registry.json``, issue 14): a cache of what each
committed checkpoint references, keyed by its `_metadata`'s listed (path, size,
mtime). A warm build reads that one file instead of parsing every `_metadata`
(10,000 x 100: about 5 s of strict parsing). Rules that keep it safe:

- an entry is used only when the listing shows the same `_metadata` size and
  mtime (a changed, new or vanished record is parsed strictly, or dropped); a
  storage without mtimes never uses it;
- the file is parsed strictly (format, job, types, ranges) and carries a SHA-256
  of its body: anything off and the whole index is ignored (a cold build);
- it only ever *plans*: ``registry.checkpoints[cid]`` is the real record (read
  strictly when first accessed), and the executors (retention.py, gc.py)
  re-check every planned deletion against the real `_metadata` of the
  checkpoints that came from the index (`indexed_ids`), so a tampered index can
  make a plan wrong but never deletes a file a real record lists;
- it is written only by a build with ``update_index=True`` (the non-dry-run
  retain and gc), best effort: a store that refuses the write still plans.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from operator import attrgetter, itemgetter

from statebackend.checkpoint.layout import (
    COMMIT_RECORD_SUFFIX,
    GC_SCOPE_PREFIXES,
    INDEX_FILE,
    checkpoint_dir,
    chk_id_of,
    in_gc_scope,
    is_commit_record,
    is_lease_file,
    metadata_path,
    savepoint_metadata_path,
    savepoint_of,
)
from statebackend.checkpoint.leases import WRITER_LEASE, Lease, read_lease_file
from statebackend.checkpoint.metadata import CheckpointMetadata, fast_loads
from statebackend.checkpoint.store import CheckpointStore, check_name
from statebackend.errors import CheckpointNotFoundError, CkptError, MetadataError
from statebackend.storage import FileInfo

log = logging.getLogger(__name__)

INDEX_FORMAT = "ckpt-registry-index/1"
READ_THREADS = 16
def check_savepoint_name(name: str) -> str:
    return check_name("savepoint name", name)


def checkpoint_label(checkpoint_id: int) -> str:
    """An owner's label: a checkpoint is named by its folder."""
    return checkpoint_dir(checkpoint_id)


def savepoint_label(name: str) -> str:
    return f"savepoint:{name}"


def as_datetime(now: datetime | float | None) -> datetime:
    """``now`` as an aware UTC datetime (None: the current time; floats: epoch seconds)."""
    if now is None:
        return datetime.now(UTC)
    if isinstance(now, int | float):
        return datetime.fromtimestamp(float(now), UTC)
    return now if now.tzinfo else now.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Registry:
    """Read-only view of a job: listing, owners, leases. Treat the mappings as frozen."""

    job: str
    now: datetime
    files: Mapping[str, FileInfo]                 # every listed file, by job-relative path
    checkpoints: Mapping[int, CheckpointMetadata]  # committed, by id
    savepoints: Mapping[str, CheckpointMetadata]   # complete savepoints, by name
    incomplete_savepoints: tuple[str, ...]         # folders without _metadata (never touched)
    leases: tuple[Lease, ...]                      # every lease, live or expired
    owner_paths: Mapping[str, tuple[str, ...]]     # owner label -> paths it lists
    referenced: frozenset[str]                     # paths listed by at least one owner
    _recorded_sizes: dict = field(default_factory=dict, compare=False, repr=False)
    # ids whose owner_paths come from the index, not from parsing their _metadata now:
    # executors re-check deletions against their real records (module docstring)
    indexed_ids: frozenset[int] = field(default=frozenset(), compare=False)
    # (path, recorded size) of every reference, for size_of (None: from the records)
    _sizes_source: Callable[[], Iterable[tuple[str, int]]] | None = field(
        default=None, compare=False, repr=False)

    # -- leases ---------------------------------------------------------------
    @property
    def live_leases(self) -> tuple[Lease, ...]:
        return tuple(lease for lease in self.leases if not lease.expired(self.now))

    def held_ids(self) -> dict[int, tuple[str, ...]]:
        """Checkpoint id -> names of the live leases that hold it."""
        held: dict[int, list[str]] = {}
        for lease in self.live_leases:
            for cid in lease.checkpoint_ids:
                held.setdefault(cid, []).append(lease.name)
        return {cid: tuple(names) for cid, names in held.items()}

    def live_writer(self) -> Lease | None:
        return next((x for x in self.live_leases if x.name == WRITER_LEASE), None)

    # -- files ----------------------------------------------------------------
    def size_of(self, path: str) -> int:
        """Listed size, else the size metadata records (a missing file)."""
        info = self.files.get(path)
        if info is not None:
            return info.size
        if not self._recorded_sizes:  # built once, on the first unlisted path
            if self._sizes_source is not None:
                self._recorded_sizes.update(self._sizes_source())
            else:
                for meta in list(self.checkpoints.values()) + list(self.savepoints.values()):
                    self._recorded_sizes.update((ref.path, ref.size) for ref in meta.files)
            self._recorded_sizes.setdefault("", 0)
        return self._recorded_sizes.get(path, 0)

    def owners_of(self, path: str) -> tuple[str, ...]:
        """Labels of the owners listing ``path`` (a scan: for reports and tests)."""
        return tuple(label for label, paths in self.owner_paths.items() if path in paths)

    def orphans(self) -> list[FileInfo]:
        """Listed files under shared/ or chk-*/ that no checkpoint or savepoint lists."""
        return [info for path, info in sorted(self.files.items())
                if in_gc_scope(path) and path not in self.referenced
                and not (is_commit_record(path) and chk_id_of(path) in self.checkpoints)]

    def missing(self) -> list[str]:
        """Referenced paths absent from the listing (data loss, or a commit after listing)."""
        return sorted(p for p in self.referenced if p not in self.files)

    def bytes_referenced(self) -> int:
        return sum(self.size_of(p) for p in self.referenced)

    def to_json(self) -> dict:
        orphans = self.orphans()
        missing = self.missing()
        return {
            "job": self.job,
            "checkpoints": sorted(self.checkpoints),
            "savepoints": sorted(self.savepoints),
            "incomplete_savepoints": list(self.incomplete_savepoints),
            "leases": [dict(lease.to_json(), live=not lease.expired(self.now))
                       for lease in self.leases],
            "files_listed": len(self.files),
            "files_referenced": len(self.referenced),
            "bytes_referenced": self.bytes_referenced(),
            "orphans": len(orphans),
            "orphan_bytes": sum(o.size for o in orphans),
            "missing": missing[:100],
            "missing_count": len(missing),
        }


def build_registry(store: CheckpointStore, *, now: datetime | float | None = None,
                   threads: int = READ_THREADS, use_index: bool = True,
                   update_index: bool = False) -> Registry:
    """List the job root, then read leases, checkpoint and savepoint metadata (strictly).

    ``use_index``: take the references of unchanged checkpoints from the registry
    index (module docstring); ``update_index``: then rewrite it if it was stale.
    """
    when = as_datetime(now)
    storage = store.storage
    # 1. list first: see the module docstring and gc.py (failure scenario 2)
    files = {info.path: info for info in storage.walk_files("")}  # in path order
    # 2. committed ids from a fresh listing, so commits after step 1 are owners too
    listed = {chk_id_of(p) for p in files if p.endswith(COMMIT_RECORD_SUFFIX)
              and is_commit_record(p)}
    ids = sorted(set(store.checkpoint_ids(known=listed)) | listed)
    savepoint_names: set[str] = set()
    savepoint_dirs: set[str] = set()
    lease_paths = []
    for path in files:
        if path.startswith(GC_SCOPE_PREFIXES):
            continue  # most of the listing: neither savepoint nor lease
        savepoint = savepoint_of(path)
        if savepoint is not None:
            savepoint_dirs.add(savepoint[0])
            if savepoint[1]:
                savepoint_names.add(savepoint[0])
        elif is_lease_file(path):
            lease_paths.append(path)

    index = read_index(store, files) if use_index else None
    cached = index.usable(ids, files) if index is not None else {}
    to_parse = [cid for cid in ids if cid not in cached]
    memo: dict = {}

    def read_lease(path: str) -> Lease | None:
        return read_lease_file(storage, path)

    def read_savepoint(name: str) -> CheckpointMetadata:
        return load_savepoint(store, name)

    # parsing is CPU-bound: threads only help to overlap remote reads
    workers = max(1, threads) if storage.remote else 1
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        leases = [x for x in pool.map(read_lease, sorted(lease_paths)) if x is not None]
        reader = pool.map if workers > 1 else map  # remote: overlap reads, parse here
        metas = [store.parse(cid, data, memo)
                 for cid, data in zip(to_parse, reader(store.read_record, to_parse), strict=True)
                 if data is not None]  # None: retired since the listing
        savepoints = list(pool.map(read_savepoint, sorted(savepoint_names)))

    registry = _assemble(store, when, files, metas, cached, index,
                         dict(zip(sorted(savepoint_names), savepoints, strict=True)),
                         leases, sorted(savepoint_dirs - savepoint_names))
    # (memory:// lives as long as this process: an index would only cost a write)
    if update_index and not storage.process_local and (
            index is None or to_parse or len(cached) != len(index.entries)):
        write_index(store, registry, index, metas)
    return registry


def _assemble(store: CheckpointStore, when: datetime, files: dict[str, FileInfo],
              metas: list[CheckpointMetadata], cached: dict[int, tuple[str, ...]],
              index: RegistryIndex | None, savepoints: dict[str, CheckpointMetadata],
              leases: list[Lease], incomplete: list[str]) -> Registry:
    """`make_registry`, with the references of ``cached`` ids taken from the index and
    their records read (strictly) only when someone asks for them."""
    if not cached:
        return make_registry(job=store.job, now=when, files=files, checkpoints=metas,
                             savepoints=savepoints, leases=leases,
                             incomplete_savepoints=incomplete)
    parsed = {m.checkpoint_id: m for m in metas}
    owner_paths: dict[str, tuple[str, ...]] = {}
    for cid in sorted(set(parsed) | set(cached)):
        m = parsed.get(cid)
        owner_paths[checkpoint_label(cid)] = paths_of(m) if m is not None else cached[cid]
    for name, m in sorted(savepoints.items()):
        owner_paths[savepoint_label(name)] = paths_of(m)
    referenced: set[str] = set()
    for paths in owner_paths.values():
        referenced.update(paths)
    checkpoints = LazyCheckpoints(store, parsed, frozenset(cached))

    def sizes() -> Iterator[tuple[str, int]]:
        yield from zip(index.paths, index.sizes, strict=True)
        for m in list(parsed.values()) + list(savepoints.values()):
            yield from ((ref.path, ref.size) for ref in m.files)

    return Registry(
        job=store.job, now=when, files=files, checkpoints=checkpoints,
        savepoints=savepoints, incomplete_savepoints=tuple(incomplete), leases=tuple(leases),
        owner_paths=owner_paths, referenced=frozenset(referenced),
        indexed_ids=frozenset(cached), _sizes_source=sizes)


class LazyCheckpoints(Mapping):
    """Committed records by id; those planned from the index are read (strictly, from
    their real `_metadata`) on first access, so whatever looks at a record's content
    (restorability, reports) never sees the index."""

    def __init__(self, store: CheckpointStore, parsed: dict[int, CheckpointMetadata],
                 lazy: frozenset[int]) -> None:
        self._store = store
        self._loaded = dict(parsed)
        self._ids = sorted(set(parsed) | lazy)
        self._known = frozenset(self._ids)

    def __getitem__(self, cid: int) -> CheckpointMetadata:
        meta = self._loaded.get(cid)
        if meta is None:
            if cid not in self._known:
                raise KeyError(cid)
            meta = self._loaded[cid] = self._store.load(cid)
        return meta

    def __contains__(self, cid: object) -> bool:
        return cid in self._known

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


# -- registry index ----------------------------------------------------------------
@dataclass(frozen=True)
class IndexEntry:
    size: int            # listed size of chk-<id>/_metadata when it was parsed
    mtime: float         # listed mtime then
    refs: str            # base64 of little-endian uint32 positions in paths


@dataclass(frozen=True)
class RegistryIndex:
    """The parsed index: a table of (path, recorded size) and each checkpoint's refs."""

    paths: tuple[str, ...]
    sizes: tuple[int, ...]
    entries: Mapping[int, IndexEntry]

    def usable(self, ids: Iterable[int], files: Mapping[str, FileInfo]
               ) -> dict[int, tuple[str, ...]]:
        """Paths of the committed ``ids`` whose listed `_metadata` is the one indexed."""
        out: dict[int, tuple[str, ...]] = {}
        table = self.paths
        for cid in ids:
            entry = self.entries.get(cid)
            info = files.get(metadata_path(cid))
            if entry is None or info is None or info.mtime is None \
                    or info.size != entry.size or info.mtime != entry.mtime:
                continue  # new, changed or unlisted: parse the real record
            positions = _positions(entry.refs)
            try:
                if positions is None:
                    raise IndexError("refs are not base64 of uint32 positions")
                if len(positions) == 1:
                    out[cid] = (table[positions[0]],)
                else:
                    out[cid] = itemgetter(*positions)(table) if positions else ()
            except IndexError:
                return {}  # damaged (or a position beyond the table): trust nothing here
        return out


def _positions(refs: str, table_size: int | None = None) -> array | None:
    """The positions ``refs`` encodes; None if malformed or (given ``table_size``) out
    of range. Without ``table_size`` the caller's indexing raises IndexError instead."""
    try:
        raw = base64.b64decode(refs, validate=True)
    except ValueError:
        return None
    if len(raw) % 4:
        return None
    out = array("I")
    out.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        out.byteswap()
    if table_size is not None and out and max(out) >= table_size:
        return None
    return out


def read_index(store: CheckpointStore, files: Mapping[str, FileInfo]) -> RegistryIndex | None:
    """The job's registry index, strictly parsed, or None (absent, or anything off)."""
    if INDEX_FILE not in files:
        return None
    where = f"{store.storage.url}/{INDEX_FILE}"
    try:
        data = store.storage.read_bytes_if_exists(INDEX_FILE)
        return parse_index(data, store.job) if data is not None else None
    except (CkptError, ValueError, TypeError, KeyError) as exc:
        log.warning("registry index %s ignored (%s): every _metadata is parsed instead",
                    where, exc)
        return None


def parse_index(data: bytes, job: str) -> RegistryIndex:
    """Strict: header line ``{"format", "job", "sha256"}``, then the body it hashes."""
    head, sep, body = data.partition(b"\n")
    if not sep:
        raise ValueError("no header line")
    header = fast_loads(head)
    if not isinstance(header, dict) or set(header) != {"format", "job", "sha256"} \
            or header["format"] != INDEX_FORMAT or header["job"] != job:
        raise ValueError(f"header {head[:200]!r} is not a {INDEX_FORMAT} index of job {job!r}")
    if hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise ValueError("body does not match its SHA-256 (torn or edited)")
    obj = fast_loads(body)
    if not isinstance(obj, dict) or set(obj) != {"paths", "sizes", "checkpoints"}:
        raise ValueError("body keys are not paths, sizes, checkpoints")
    paths, sizes, rows = obj["paths"], obj["sizes"], obj["checkpoints"]
    if not (isinstance(paths, list) and isinstance(sizes, list) and isinstance(rows, list)
            and len(paths) == len(sizes)
            and set(map(type, paths)) <= {str} and set(map(type, sizes)) <= {int}
            and (not sizes or min(sizes) >= 0)):
        raise ValueError("paths and sizes are not two lists of strings and sizes")
    entries: dict[int, IndexEntry] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4 and type(row[0]) is int
                and row[0] >= 1 and type(row[1]) is int and row[1] >= 0
                and type(row[2]) in (int, float) and type(row[3]) is str) or row[0] in entries:
            raise ValueError(f"checkpoint entry {str(row)[:200]} is malformed")
        entries[row[0]] = IndexEntry(row[1], float(row[2]), row[3])
    return RegistryIndex(tuple(paths), tuple(sizes), entries)


def write_index(store: CheckpointStore, registry: Registry, old: RegistryIndex | None,
                parsed: Iterable[CheckpointMetadata]) -> None:
    """Rewrite the index for the checkpoints of ``registry`` (best effort).

    Only records parsed by this build or kept from the old index (same listed
    size and mtime) are written; the path table is appended to and compacted when
    more than half of it is no longer referenced."""
    paths: list[str] = list(old.paths) if old is not None else []
    sizes: list[int] = list(old.sizes) if old is not None else []
    position = {(p, n): i for i, (p, n) in enumerate(zip(paths, sizes, strict=True))}
    rows: list[list] = []
    for meta in parsed:
        info = registry.files.get(metadata_path(meta.checkpoint_id))
        if info is None or info.mtime is None:
            continue
        refs = array("I")
        for ref in meta.files:
            key = (ref.path, ref.size)
            i = position.get(key)
            if i is None:
                i = position[key] = len(paths)
                paths.append(ref.path)
                sizes.append(ref.size)
            refs.append(i)
        rows.append([meta.checkpoint_id, info.size, info.mtime, _encode(refs)])
    if old is not None:
        rows += [[cid, e.size, e.mtime, e.refs] for cid, e in old.entries.items()
                 if cid in registry.indexed_ids]
    rows.sort()
    if len(paths) > 2 * len(registry.referenced):  # cheap bound before the exact count
        paths, sizes, rows = _compact(paths, sizes, rows)
    body = json.dumps({"paths": paths, "sizes": sizes, "checkpoints": rows},
                      separators=(",", ":")).encode()
    header = json.dumps({"format": INDEX_FORMAT, "job": store.job,
                         "sha256": hashlib.sha256(body).hexdigest()}).encode()
    try:
        store.storage.write_bytes(INDEX_FILE, header + b"\n" + body)
    except CkptError as exc:  # a read-only or full store still plans, only slower
        log.warning("registry index %s/%s not written: %s", store.storage.url, INDEX_FILE, exc)


def _encode(refs: array) -> str:
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        refs = array("I", refs)
        refs.byteswap()
    return base64.b64encode(refs.tobytes()).decode("ascii")


def _compact(paths: list[str], sizes: list[int], rows: list[list]
             ) -> tuple[list[str], list[int], list[list]]:
    """Drop table entries no row references once they are more than half the table."""
    decoded = [_positions(r[3], len(paths)) for r in rows]
    used = sorted({i for refs in decoded for i in refs or ()})
    if len(used) * 2 >= len(paths):
        return paths, sizes, rows
    remap = {old: new for new, old in enumerate(used)}
    rows = [[r[0], r[1], r[2], _encode(array("I", (remap[i] for i in refs or ())))]
            for r, refs in zip(rows, decoded, strict=True)]
    return [paths[i] for i in used], [sizes[i] for i in used], rows


def referenced_by_records(store: CheckpointStore, ids: Iterable[int],
                          threads: int = READ_THREADS) -> set[str]:
    """Every path the real `_metadata` of ``ids`` lists (retired ones are skipped):
    the executors' re-check of a plan made from the index, read strictly."""
    ids = sorted(set(ids))
    workers = max(1, min(threads, len(ids))) if store.storage.remote else 1
    out: set[str] = set()
    memo: dict = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        reader = pool.map if workers > 1 else map
        for cid, data in zip(ids, reader(store.read_record, ids), strict=True):
            if data is not None:
                out.update(paths_of(store.parse(cid, data, memo)))
    return out


def make_registry(*, job: str, now: datetime | float | None,
                  files: Iterable[FileInfo] | Mapping[str, FileInfo],
                  checkpoints: Iterable[CheckpointMetadata],
                  savepoints: Mapping[str, CheckpointMetadata] | None = None,
                  leases: Iterable[Lease] = (),
                  incomplete_savepoints: Iterable[str] = ()) -> Registry:
    """Pure: index who references which file (no I/O; tests build registries with it)."""
    metas = sorted(checkpoints, key=lambda m: m.checkpoint_id)
    savepoints = dict(savepoints or {})
    owner_paths: dict[str, tuple[str, ...]] = {}
    for m in metas:
        owner_paths[checkpoint_label(m.checkpoint_id)] = paths_of(m)
    for name, m in sorted(savepoints.items()):
        owner_paths[savepoint_label(name)] = paths_of(m)
    referenced: set[str] = set()
    for paths in owner_paths.values():
        referenced.update(paths)
    return Registry(
        job=job,
        now=as_datetime(now),
        files=files_by_path(files),
        checkpoints={m.checkpoint_id: m for m in metas},
        savepoints=savepoints,
        incomplete_savepoints=tuple(sorted(incomplete_savepoints)),
        leases=tuple(leases),
        owner_paths=owner_paths,
        referenced=frozenset(referenced),
    )


def files_by_path(files: Iterable[FileInfo] | Mapping[str, FileInfo]) -> dict[str, FileInfo]:
    """Listing by path, in path order (planners iterate it without sorting again);
    a mapping is taken as such one (`build_registry` made it)."""
    if isinstance(files, Mapping):
        return files if isinstance(files, dict) else dict(files)
    listing = sorted(files, key=_path_key)  # near free on an already sorted listing
    return {f.path: f for f in listing}


_path_key = attrgetter("path")


def paths_of(meta: CheckpointMetadata) -> tuple[str, ...]:
    return tuple(ref.path for sub in meta.subtasks
                 for ref in sub.shared_files + sub.private_files)


def load_savepoint(store: CheckpointStore, name: str) -> CheckpointMetadata:
    """Read ``<job>/savepoints/<name>/_metadata`` strictly (kind must be "savepoint")."""
    check_savepoint_name(name)
    rel = savepoint_metadata_path(name)
    where = f"{store.storage.url}/{rel}"
    data = store.storage.read_bytes_if_exists(rel)
    if data is None:
        raise CheckpointNotFoundError(
            f"savepoint {name!r} of job {store.job!r} not found (no {where})")
    meta = CheckpointMetadata.from_bytes(data, where)
    if meta.kind != "savepoint" or meta.job != store.job:
        raise MetadataError(f"malformed metadata {where}: it describes a {meta.kind} of job "
                            f"{meta.job!r}, not a savepoint of job {store.job!r}")
    return meta
