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

Scale (10,000 checkpoints x 100 references): each distinct file reference is
validated once (`parse_metadata`), committed ids come from one listing of the
job's folders (`committed_ids`), ``file://`` is listed with ``os.scandir``, and
planners use set algebra over `owner_paths` instead of per-reference loops.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from .checkpoints import (
    CHK_DIR_RE,
    METADATA_FILE,
    CheckpointStore,
    check_name,
    metadata_path,
)
from .errors import CheckpointNotFoundError, MetadataError, StorageError
from .leases import LEASES_DIR, WRITER_LEASE, Lease
from .metadata import CheckpointMetadata, FileRef, decode_json
from .storage import FileInfo, Storage

SHARED_DIR = "shared"
SAVEPOINTS_DIR = "savepoints"
READ_THREADS = 16
try:  # msgspec (an Airflow dependency) decodes JSON about twice as fast as the stdlib
    from msgspec.json import decode as _msgspec_decode

    def _loads(data: bytes) -> object:
        try:
            return _msgspec_decode(data)
        except RecursionError:
            raise  # deep nesting: decode_json names it as such
        except Exception as exc:  # noqa: BLE001 - msgspec.DecodeError: report as ValueError
            raise ValueError(str(exc)) from exc
except ImportError:  # pragma: no cover - stdlib fallback
    _loads = json.loads


def check_savepoint_name(name: str) -> str:
    return check_name("savepoint name", name)


def savepoint_metadata_path(name: str) -> str:
    return f"{SAVEPOINTS_DIR}/{name}/{METADATA_FILE}"


def checkpoint_label(checkpoint_id: int) -> str:
    return f"chk-{checkpoint_id}"


def savepoint_label(name: str) -> str:
    return f"savepoint:{name}"


def as_datetime(now: datetime | float | None) -> datetime:
    """``now`` as an aware UTC datetime (None: the current time; floats: epoch seconds)."""
    if now is None:
        return datetime.now(UTC)
    if isinstance(now, int | float):
        return datetime.fromtimestamp(float(now), UTC)
    return now if now.tzinfo else now.replace(tzinfo=UTC)


def chk_id_of(path: str) -> int | None:
    """The id of ``chk-<id>/...`` paths, else None."""
    m = CHK_DIR_RE.match(path.split("/", 1)[0])
    return int(m.group(1)) if m else None


def in_gc_scope(path: str) -> bool:
    """Files GC may ever consider: under ``shared/`` or a ``chk-<id>/`` folder."""
    return path.startswith(SHARED_DIR + "/") or chk_id_of(path) is not None


def is_commit_record(path: str) -> bool:
    return chk_id_of(path) is not None and path.count("/") == 1 \
        and path.endswith("/" + METADATA_FILE)


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
                   threads: int = READ_THREADS) -> Registry:
    """List the job root, then read leases, checkpoint and savepoint metadata (strictly)."""
    when = as_datetime(now)
    storage = store.storage
    # 1. list first: see the module docstring and gc.py (failure scenario 2)
    listing = list_job_files(storage)
    files = {info.path: info for info in listing}
    # 2. committed ids from a fresh listing, so commits after step 1 are owners too
    listed = {cid for p in files if is_commit_record(p) and (cid := chk_id_of(p)) is not None}
    ids = sorted(set(committed_ids(store, known=listed)) | listed)
    savepoint_names: set[str] = set()
    savepoint_dirs: set[str] = set()
    lease_paths = []
    for path in files:
        parts = path.split("/")
        if parts[0] == SAVEPOINTS_DIR and len(parts) >= 3:
            savepoint_dirs.add(parts[1])
            if len(parts) == 3 and parts[2] == METADATA_FILE:
                savepoint_names.add(parts[1])
        elif is_lease_file(path):
            lease_paths.append(path)

    def read_lease(path: str) -> Lease | None:
        return _read_lease(storage, path)

    memo: dict = {}

    def read_checkpoint(cid: int) -> CheckpointMetadata | None:
        rel = metadata_path(cid)
        data = storage.read_bytes_if_exists(rel)
        if data is None:
            return None  # retired since the listing
        where = f"{storage.url}/{rel}"
        meta = parse_metadata(data, where, memo)
        if meta.checkpoint_id != cid or meta.job != store.job:
            raise MetadataError(
                f"malformed metadata {where}: it describes job {meta.job!r} checkpoint "
                f"{meta.checkpoint_id}, not job {store.job!r} checkpoint {cid}")
        return meta

    def read_savepoint(name: str) -> CheckpointMetadata:
        return load_savepoint(store, name)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        leases = [x for x in pool.map(read_lease, sorted(lease_paths)) if x is not None]
        metas = [m for m in pool.map(read_checkpoint, ids) if m is not None]
        savepoints = list(pool.map(read_savepoint, sorted(savepoint_names)))

    return make_registry(
        job=store.job, now=when, files=listing, checkpoints=metas,
        savepoints=dict(zip(sorted(savepoint_names), savepoints, strict=True)),
        leases=leases, incomplete_savepoints=sorted(savepoint_dirs - savepoint_names))


def make_registry(*, job: str, now: datetime | float | None, files: Iterable[FileInfo],
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
        files={f.path: f for f in files},
        checkpoints={m.checkpoint_id: m for m in metas},
        savepoints=savepoints,
        incomplete_savepoints=tuple(sorted(incomplete_savepoints)),
        leases=tuple(leases),
        owner_paths=owner_paths,
        referenced=frozenset(referenced),
    )


def paths_of(meta: CheckpointMetadata) -> tuple[str, ...]:
    return tuple(ref.path for sub in meta.subtasks
                 for ref in sub.shared_files + sub.private_files)


def parse_metadata(data: bytes, where: str, memo: dict) -> CheckpointMetadata:
    """`CheckpointMetadata.from_bytes`, with each distinct file reference validated once.

    Thousands of checkpoints list the same shared files again and again; parsing
    each reference once (keyed by its exact, typed values) keeps planning over
    10,000 checkpoints fast. Every reference still goes through FileRef.from_json
    and everything else through CheckpointMetadata.from_json, so the result and
    the errors are the same as `from_bytes`.
    """
    obj = decode_json(data, where, _loads)
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
    return replace(meta, subtasks=subtasks)


def _take_refs(obj: dict, where: str, memo: dict
               ) -> list[tuple[tuple[FileRef, ...], tuple[FileRef, ...]]]:
    """Each subtask's (shared, private) references, memoised; the lists are emptied in
    place (``obj`` is ours, freshly decoded) so from_json skips them."""
    get = memo.get
    refs: list[tuple[tuple[FileRef, ...], tuple[FileRef, ...]]] = []
    for sub in obj["subtasks"]:
        pair = []
        for key in ("shared_files", "private_files"):
            entries = sub.get(key)
            if not isinstance(entries, list):
                pair.append(())
                continue
            out = []
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


def _memo_ref(entry: object, where: str, memo: dict) -> FileRef:
    try:
        key = (entry["path"], entry["local_name"], entry["size"], entry["checksum"])
        ref = memo.get(key)
    except (TypeError, KeyError, IndexError):  # not a dict, or unhashable values
        key, ref = None, None
    # strings only equal strings, but True == 1.0 == 1: re-check the size's type
    if ref is not None and type(entry["size"]) is int and len(entry) == 4:
        return ref
    ref = FileRef.from_json(entry, where)  # raises on anything malformed
    if key is not None and type(entry) is dict and len(entry) == 4:
        memo[key] = ref
    return ref


def list_job_files(storage: Storage) -> list[FileInfo]:
    """`storage.walk_files("")`, with a scandir fast path on file:// (fsspec's local
    find costs a stat and path normalisation per entry: seconds at 100,000 files)."""
    if storage.protocol != "file":
        return storage.walk_files("")
    out: list[FileInfo] = []
    root = storage.root
    stack = [("", root)]
    while stack:
        rel, path = stack.pop()
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StorageError(f"{storage.url}: cannot list {rel or '/'}: {exc}") from exc
        for e in entries:
            child = f"{rel}/{e.name}" if rel else e.name
            if e.is_dir(follow_symlinks=False):
                stack.append((child, e.path))
            elif e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                out.append(FileInfo(child, st.st_size, st.st_mtime))
    out.sort(key=lambda f: f.path)
    return out


def committed_ids(store: CheckpointStore, known: Iterable[int] = ()) -> list[int]:
    """Ids of committed checkpoints, from one listing of the job root's folders.

    Ids in ``known`` (committed when the caller last looked) are taken as they are
    (a retired one is skipped later, when its `_metadata` cannot be read); every
    other ``chk-<id>`` folder costs one existence check of its `_metadata`. That
    is a handful of requests instead of a glob over every file of the job.
    """
    storage = store.storage
    known = set(known)
    ids = []
    for name in storage.list_dir(""):
        cid = chk_id_of(name)
        if cid is None:
            continue
        if cid in known:
            ids.append(cid)
        elif storage.protocol == "file":
            if os.path.isfile(os.path.join(storage.root, name, METADATA_FILE)):
                ids.append(cid)
        elif storage.exists(metadata_path(cid)):
            ids.append(cid)
    return sorted(ids)


def is_lease_file(path: str) -> bool:
    parts = path.split("/")
    return (len(parts) == 2 and parts[0] == LEASES_DIR and parts[1].endswith(".json")
            and not parts[1].startswith("."))


def _read_lease(storage: Storage, path: str) -> Lease | None:
    data = storage.read_bytes_if_exists(path)
    if data is None:
        return None  # released since the listing
    where = f"{storage.url}/{path}"
    try:
        return Lease.from_bytes(data, where)
    except RecursionError as exc:  # [[[[...]]]] 100,000 deep: the decoder recurses per level
        raise MetadataError(f"malformed lease {where}: JSON nested too deeply; the file is "
                            "damaged or not a lease") from exc


def read_live_leases(storage: Storage, now: datetime | float | None = None) -> list[Lease]:
    """Live leases of a job root, strictly parsed; leases released meanwhile are skipped."""
    when = as_datetime(now)
    paths = storage.list_dir(LEASES_DIR)
    leases = [_read_lease(storage, f"{LEASES_DIR}/{name}") for name in paths
              if is_lease_file(f"{LEASES_DIR}/{name}")]
    return [x for x in leases if x is not None and not x.expired(when)]


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
