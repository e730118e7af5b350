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

Scale (issue 14: 10,000 checkpoints x 100 references, 90,000 files): the job
root is listed by name only (`Storage.walk_listing`: file:// stats a file when
its size or mtime is first asked for, so a plan stats the commit records, the
orphan candidates and the newest checkpoint's files, not every file); who
references what is held as integer positions into one path table
(`References`), so planners do set algebra on ints and name only the files they
act on; committed ids come from one listing of the job's folders; each distinct
file reference is validated once (`metadata.parse_metadata`). Sizes of
referenced files are the recorded ones (a listing that disagrees is the
manifest check's business, see retention.py's restorability).

Registry index (``<job>/_index/registry.json``): a cache of what each
committed checkpoint references, keyed by its `_metadata`'s listed (size,
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
- signed (``"mac"`` in the header: HMAC-SHA256 of its format, job and body under
  this host's key, index_signing.py), it vouches for the records listed with an mtime
  older than the listing it was built from (`Registry.vouched_before`), and the
  executors do not read those again (`Registry.ids_to_recheck`); an index that is
  not signed here is used to plan, but a build that writes the index ignores it
  and parses every record, so a signature covers only references read from the
  real records.

Index format (``ckpt-registry-index/3``; an older index is ignored once, then
rewritten): a header line ``{"format", "job", "sha256"}`` (and ``"mac"`` when
signed), then a JSON body of
columns: ``paths`` and ``sizes`` (the path table with recorded sizes), ``ids``
(ascending), ``record_sizes`` and ``record_mtimes`` (the listed `_metadata` each
entry was made from), ``counts`` and ``refs``: base64 of little-endian uint32
positions into ``paths``, every entry's ``counts[i]`` positions in id order
(one decode for all entries), and ``listing_age_seconds`` (from the listing it
was built from to its write). Changes must stay backward-compatible or bump
the format.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import json
import logging
import math
import sys
import time
from array import array
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from statebackend.checkpoint.layout import (
    CHAIN_DIR,
    COMMIT_RECORD_SUFFIX,
    GC_SCOPE_PREFIXES,
    HISTORY_DIR,
    INDEX_FILE,
    RUNS_DIR,
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
from statebackend.checkpoint.lineage import (
    STATE_PROBLEMS,
    LogListing,
    Problem,
    check_digests,
    check_log,
    digest_of,
    find_forks,
    parse_log_names,
)
from statebackend.checkpoint.metadata import (
    CheckpointMetadata,
    FileRef,
    ParseMemo,
    listed_paths,
)
from statebackend.checkpoint.store import CheckpointStore, check_name
from statebackend.errors import CheckpointNotFoundError, CkptError, LineageError, MetadataError
from statebackend.fast_json import fast_loads
from statebackend.lifecycle.index_signing import sign, signed_by, signing_key
from statebackend.storage import FileInfo, Listing

log = logging.getLogger(__name__)

INDEX_FORMAT = "ckpt-registry-index/3"
# A signed index vouches for the records whose mtime is this much older than the
# listing it was built from: one replaced with the same size and mtime would have been
# replaced within one mtime tick (S3 dates to the second) of its first write, so before
# that listing, which then saw (and the build read) the replacement.
INDEX_SLACK_SECONDS = 2.0
READ_THREADS = 16
_INDEX_KEYS = {"paths", "sizes", "ids", "record_sizes", "record_mtimes", "counts", "refs",
               "listing_age_seconds"}


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


# -- references on positions -----------------------------------------------------
@dataclass(frozen=True, eq=False)
class References:
    """Who references which file: per owner label, positions into one path table.

    ``paths`` holds each path once (``sizes``: its recorded size); planners take
    unions and differences of positions (ints, no per-reference string work) and
    turn into paths only the positions they report or act on.
    """

    paths: list[str]
    sizes: list[int]
    owners: dict[str, array[int]]  # label -> positions it lists, in record order

    def union(self, labels: Iterable[str] | None = None) -> set[int]:
        """Positions listed by any of ``labels`` (None: every owner)."""
        np = _numpy()
        owners = self.owners
        chosen = owners.values() if labels is None else [owners[label] for label in labels]
        # one mask over the table instead of a set grown by every reference (10,000
        # owners x 100 positions: 12 ms against 48 ms)
        listed = np.frombuffer(b"".join(chosen), dtype=np.uint32)
        mask = np.zeros(len(self.paths), dtype=bool)
        mask[listed] = True
        return set(np.flatnonzero(mask).tolist())

    @cached_property
    def everything(self) -> frozenset[int]:
        """Positions listed by at least one owner."""
        return frozenset(self.union())

    def paths_at(self, positions: Iterable[int]) -> list[str]:
        return list(map(self.paths.__getitem__, positions))

    def bytes_at(self, positions: Iterable[int]) -> int:
        return sum(map(self.sizes.__getitem__, positions))

    def owner_paths(self, label: str) -> tuple[str, ...]:
        return tuple(map(self.paths.__getitem__, self.owners[label]))

    @cached_property
    def position(self) -> dict[str, int]:
        """Path -> its (first) position (built on first use)."""
        paths = self.paths
        return dict(zip(reversed(paths), range(len(paths) - 1, -1, -1), strict=True))


def build_references(owners: Mapping[str, array[int] | CheckpointMetadata],
                     paths: Iterable[str] = (), sizes: Iterable[int] = ()) -> References:
    """References of ``owners`` (in their order): positions as they are (into the table
    ``paths``, from the registry index) or the files of a record, added to the table."""
    table, table_sizes = list(paths), list(sizes)
    position: dict[str, int] | None = None
    if len(table) != len(set(table)):
        # the index keys its table by (path, size): one path, two positions. Positions
        # must name paths one to one, or a path could be kept and released at once.
        position = {}
        for i, p in enumerate(table):
            position.setdefault(p, i)
        canonical = [position[p] for p in table]
        owners = {label: array("I", map(canonical.__getitem__, value))
                  if isinstance(value, array) else value for label, value in owners.items()}
    out: dict[str, array[int]] = {}
    for label, value in owners.items():
        if isinstance(value, array):
            out[label] = value
            continue
        if position is None:
            position = {p: i for i, p in enumerate(table)}
        out[label] = _positions_of(value.files, table, table_sizes, position)
    return References(table, table_sizes, out)


def _positions_of(refs: Iterable[FileRef], table: list[str], sizes: list[int],
                  position: dict[str, int]) -> array[int]:
    out = array("I")
    for ref in refs:
        i = position.get(ref.path)
        if i is None:
            i = position[ref.path] = len(table)
            table.append(ref.path)
            sizes.append(ref.size)
        out.append(i)
    return out


class OwnerPaths(Mapping[str, tuple[str, ...]]):
    """Owner label -> the paths it lists, as a tuple made on access (reports, tests)."""

    def __init__(self, refs: References) -> None:
        self._refs = refs

    def __getitem__(self, label: str) -> tuple[str, ...]:
        return self._refs.owner_paths(label)

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs.owners)

    def __len__(self) -> int:
        return len(self._refs.owners)


@dataclass(frozen=True)
class Registry:
    """Read-only view of a job: listing, owners, leases. Treat the mappings as frozen."""

    job: str
    now: datetime
    files: Listing                                 # every listed file, by job-relative path
    checkpoints: Mapping[int, CheckpointMetadata]  # committed, by id
    savepoints: Mapping[str, CheckpointMetadata]   # complete savepoints, by name
    incomplete_savepoints: tuple[str, ...]         # folders without _metadata (never touched)
    leases: tuple[Lease, ...]                      # every lease, live or expired
    refs: References = field(compare=False, repr=False)  # who references what
    # ids whose references come from the index, not from parsing their _metadata now:
    # executors re-check deletions against their real records (module docstring)
    indexed_ids: frozenset[int] = field(default=frozenset(), compare=False)
    # with an index signed by this host's key (index_signing.py): records listed with an mtime
    # before this storage time are vouched for by the signature (module docstring)
    vouched_before: float | None = field(default=None, compare=False)
    # SHA-256 of the records parsed for this registry (checked against the commit log)
    digests: Mapping[int, str] = field(default_factory=dict, compare=False)

    def ids_to_recheck(self, written_since: float | None = None) -> tuple[int, ...]:
        """The indexed checkpoints whose real records an executor reads before deleting
        (gc.py, scenario 11): each not vouched for by a signed index, and, with
        ``written_since``, listed with an mtime at or after it (or with none)."""
        out = []
        for cid in sorted(self.indexed_ids):
            info = self.files.get(metadata_path(cid))
            mtime = None if info is None else info.mtime
            if mtime is None:
                out.append(cid)
            elif (self.vouched_before is None or mtime >= self.vouched_before) and (
                    written_since is None or mtime >= written_since):
                out.append(cid)
        return tuple(out)

    @property
    def owner_paths(self) -> Mapping[str, tuple[str, ...]]:
        """Owner label -> paths it lists (planners use `refs`, on positions)."""
        return OwnerPaths(self.refs)

    @cached_property
    def referenced(self) -> frozenset[str]:
        """Paths listed by at least one owner."""
        return frozenset(self.refs.paths_at(self.refs.everything))

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
        """Listed size, else the size metadata records (a missing file), else 0."""
        info = self.files.get(path)
        if info is not None:
            return info.size
        i = self.refs.position.get(path)
        return 0 if i is None else self.refs.sizes[i]

    def owners_of(self, path: str) -> tuple[str, ...]:
        """Labels of the owners listing ``path`` (a scan: for reports and tests)."""
        i = self.refs.position.get(path)
        return () if i is None else tuple(
            label for label, positions in self.refs.owners.items() if i in positions)

    def orphans(self) -> list[FileInfo]:
        """Listed files under shared/ or chk-*/ that no checkpoint or savepoint lists."""
        referenced, files, checkpoints = self.referenced, self.files, self.checkpoints
        out = []
        for path in files:
            if path in referenced or not path.startswith(GC_SCOPE_PREFIXES) \
                    or not in_gc_scope(path) \
                    or (is_commit_record(path) and chk_id_of(path) in checkpoints):
                continue
            info = files.get(path)
            if info is not None:  # (None: deleted since the listing)
                out.append(info)
        return out

    def missing(self) -> list[str]:
        """Referenced paths absent from the listing (data loss, or a commit after listing)."""
        return sorted(self.referenced - self.files.names)

    def bytes_referenced(self) -> int:
        """Recorded bytes of every file an owner lists."""
        return self.refs.bytes_at(self.refs.everything)

    # -- the lineage --------------------------------------------------------------
    def log(self) -> LogListing:
        """The commit log's names (runs/chain, runs/, runs/history) from the listing."""
        chain = [p.rsplit("/", 1)[-1] for p in names_under(self.files.paths, CHAIN_DIR, True)]
        return parse_log_names(chain, names_under(self.files.paths, RUNS_DIR),
                               names_under(self.files.paths, HISTORY_DIR))

    def lineage_problems(self) -> list[Problem]:
        """What is wrong with the lineage (checkpoint/lineage.py): the log's checks, and
        forks among the records parsed for this registry (records taken from the index
        passed this check when they were parsed)."""
        ids = sorted(self.checkpoints)
        parsed = [cid for cid in ids if cid not in self.indexed_ids]
        before = {cid: prev for prev, cid in zip(ids, ids[1:], strict=False)}
        parents = {cid: self.checkpoints[cid].parent for cid in parsed}
        epochs = {c: self.checkpoints[c].epoch
                  for c in {*parsed, *(before[c] for c in parsed if c in before)}}
        names = self.log()
        return (check_log(ids, names) + find_forks(ids, parents, epochs)
                + check_digests(names, self.digests, ids[-1] if ids else None))

    def state_problems(self) -> list[Problem]:
        """The lineage problems under which a file's references are not known: a fork, a
        lost or doubly committed record (their files would look unreferenced)."""
        return [p for p in self.lineage_problems() if p.kind in STATE_PROBLEMS]

    def require_intact(self, what: str) -> None:
        """LineageError while `state_problems` has one."""
        bad = self.state_problems()
        if bad:
            raise LineageError(f"{what} of job {self.job!r} refused, nothing deleted: "
                               f"{bad[0].message}; {bad[0].repair}; see `ckpt doctor`")

    def to_json(self) -> dict[str, Any]:
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
    started = time.monotonic()
    # 1. list first: see the module docstring and gc.py (failure scenario 2)
    files = storage.walk_listing("")  # names in path order; sizes on demand
    # 2. committed ids from a fresh listing, so commits after step 1 are owners too
    listed = {cid for p in files.paths if p.endswith(COMMIT_RECORD_SUFFIX)
              and is_commit_record(p) and (cid := chk_id_of(p)) is not None}
    ids = sorted(set(store.checkpoint_ids(known=listed)) | listed)
    savepoint_names: set[str] = set()
    savepoint_dirs: set[str] = set()
    lease_paths: list[str] = []
    for path in files.paths:
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
    if update_index and index is not None and not index.signed \
            and signing_key(store.index_key) is not None:
        index = None  # rebuilt from the records alone: a signature vouches only for them
    cached = index.usable(ids, files) if index is not None else {}
    to_parse = [cid for cid in ids if cid not in cached]
    if update_index:  # the (size, mtime) an index entry records: seen before the read
        for cid in to_parse:
            files.get(metadata_path(cid))
    memo: ParseMemo = {}

    def read_lease(path: str) -> Lease | None:
        return read_lease_file(storage, path)

    def read_savepoint(name: str) -> CheckpointMetadata:
        return load_savepoint(store, name)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        leases = [x for x in pool.map(read_lease, sorted(lease_paths)) if x is not None]
        # parsing is CPU-bound: read_records overlaps remote reads, parsing stays here
        pairs = [(store.parse(cid, data, memo), digest_of(data))
                 for cid, data in zip(to_parse, store.read_records(to_parse), strict=True)
                 if data is not None]  # None: retired since the listing
        metas = [m for m, _ in pairs]
        savepoints = list(pool.map(read_savepoint, sorted(savepoint_names)))

    parsed = {m.checkpoint_id: m for m in metas}
    owners: dict[str, array[int] | CheckpointMetadata] = {
        checkpoint_label(cid): parsed[cid] if cid in parsed else cached[cid]
        for cid in sorted(set(parsed) | set(cached))}
    named = dict(zip(sorted(savepoint_names), savepoints, strict=True))
    owners.update((savepoint_label(name), m) for name, m in named.items())
    # (entries are cached only from an index)
    refs = build_references(owners, index.paths, index.sizes) \
        if cached and index is not None else build_references(owners)
    registry = Registry(
        job=store.job, now=when, files=files,
        checkpoints=LazyCheckpoints(store, parsed, frozenset(cached)) if cached else parsed,
        savepoints=named, incomplete_savepoints=tuple(sorted(savepoint_dirs - savepoint_names)),
        leases=tuple(leases), refs=refs, indexed_ids=frozenset(cached),
        vouched_before=_vouched_before(index, files) if cached and index is not None else None,
        digests={m.checkpoint_id: digest for m, digest in pairs})
    # (memory:// lives as long as this process: an index would only cost a write)
    if update_index and not storage.process_local and (
            index is None or to_parse or len(cached) != len(index.entries)) \
            and not registry.state_problems():  # planners refuse: leave the index alone
        write_index(store, registry, time.monotonic() - started)
    return registry


class LazyCheckpoints(Mapping[int, CheckpointMetadata]):
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
    start: int           # its positions: refs[start:start + count]
    count: int


@dataclass(frozen=True)
class RegistryIndex:
    """The parsed index: a table of (path, recorded size) and each checkpoint's refs."""

    paths: list[str]
    sizes: list[int]
    entries: Mapping[int, IndexEntry]
    refs: array[int]     # every entry's positions into paths, in id order
    listing_age: float   # seconds from the listing it was built from to its write
    signed: bool = False  # its header's HMAC verifies under this host's key

    def usable(self, ids: Iterable[int], files: Mapping[str, FileInfo]
               ) -> dict[int, array[int]]:
        """Positions of the committed ``ids`` whose listed `_metadata` is the one indexed."""
        out: dict[int, array[int]] = {}
        entries, refs = self.entries, self.refs
        for cid in ids:
            entry = entries.get(cid)
            if entry is None:
                continue  # new: parse the real record
            info = files.get(metadata_path(cid))
            if info is None or info.mtime is None \
                    or info.size != entry.size or info.mtime != entry.mtime:
                continue  # changed or vanished: parse the real record
            out[cid] = refs[entry.start:entry.start + entry.count]
        return out


def read_index(store: CheckpointStore, files: Mapping[str, FileInfo]) -> RegistryIndex | None:
    """The job's registry index, strictly parsed, or None (absent, or anything off)."""
    if INDEX_FILE not in files:
        return None
    where = f"{store.storage.url}/{INDEX_FILE}"
    try:
        data = store.storage.read_bytes_if_exists(INDEX_FILE)
        if data is None:
            return None
        return parse_index(data, store.job, signing_key(store.index_key))
    except (CkptError, ValueError, TypeError, KeyError) as exc:
        log.warning("registry index %s ignored (%s): every _metadata is parsed instead",
                    where, exc)
        return None


def _vouched_before(index: RegistryIndex, files: Mapping[str, FileInfo]) -> float | None:
    """`Registry.vouched_before` of a build that used ``index``."""
    listed = files.get(INDEX_FILE)
    if not index.signed or listed is None or listed.mtime is None:
        return None
    return listed.mtime - index.listing_age - INDEX_SLACK_SECONDS


def parse_index(data: bytes, job: str, key: bytes | None = None) -> RegistryIndex:
    """Strict: header line ``{"format", "job", "sha256"}`` (and ``"mac"`` when signed),
    then the body it hashes; ``signed`` when ``key`` verifies the MAC."""
    head, sep, body = data.partition(b"\n")
    if not sep:
        raise ValueError("no header line")
    header = fast_loads(head)
    if not isinstance(header, dict) or set(header) - {"mac"} != {"format", "job", "sha256"} \
            or header["format"] != INDEX_FORMAT or header["job"] != job:
        raise ValueError(f"header {head[:200]!r} is not a {INDEX_FORMAT} index of job {job!r}")
    if hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise ValueError("body does not match its SHA-256 (torn or edited)")
    obj = fast_loads(body)
    if not isinstance(obj, dict) or set(obj) != _INDEX_KEYS:
        raise ValueError(f"body keys are not {sorted(_INDEX_KEYS)}")
    paths, sizes, ids = obj["paths"], obj["sizes"], obj["ids"]
    record_sizes, mtimes, counts = obj["record_sizes"], obj["record_mtimes"], obj["counts"]
    if not (isinstance(paths, list) and isinstance(sizes, list) and len(paths) == len(sizes)
            and _all_of(paths, str) and _naturals(sizes)):
        raise ValueError("paths and sizes are not two lists of strings and sizes")
    columns = (ids, record_sizes, mtimes, counts)
    if not (all(isinstance(c, list) and len(c) == len(ids) for c in columns)
            and _naturals(ids) and (not ids or min(ids) >= 1)
            and ids == sorted(set(ids))
            and _naturals(record_sizes) and _naturals(counts)
            and set(map(type, mtimes)) <= {int, float}):
        raise ValueError("ids, record_sizes, record_mtimes, counts are not columns of "
                         "ascending ids, sizes, times and counts")
    np = _numpy()
    refs = _decode_positions(obj["refs"])
    if refs is None or len(refs) != sum(counts) or (
            refs and int(np.frombuffer(refs, dtype=np.uint32).max()) >= len(paths)):
        raise ValueError("refs are not base64 of the counted uint32 positions into paths")
    entries: dict[int, IndexEntry] = {}
    start = 0
    for cid, size, mtime, count in zip(ids, record_sizes, mtimes, counts, strict=True):
        entries[cid] = IndexEntry(size, float(mtime), start, count)
        start += count
    age = obj["listing_age_seconds"]
    if type(age) not in (int, float) or not 0 <= age < math.inf:
        raise ValueError(f"listing_age_seconds {age!r} is not a duration")
    return RegistryIndex(paths, sizes, entries, refs, float(age),
                         signed_by(key, _signed_message(job, body), header.get("mac")))


def _signed_message(job: str, body: bytes) -> bytes:
    """What an index's MAC covers: its format, its job and its body (a signed index
    copied into another job's folder does not verify there)."""
    return f"{INDEX_FORMAT}\n{job}\n".encode() + body


def _numpy() -> Any:
    """NumPy, imported on first use: DAG files import this module and must stay light."""
    import numpy

    return numpy


def _all_of(values: list[Any], kind: type) -> bool:
    return set(map(type, values)) <= {kind}


def _naturals(values: object) -> bool:
    """A list of ints >= 0 (bools are not ints here)."""
    return isinstance(values, list) and _all_of(values, int) and (not values or min(values) >= 0)


def _decode_positions(refs: object) -> array[int] | None:
    """The uint32 positions ``refs`` (base64, little-endian) encodes, or None."""
    if not isinstance(refs, str):
        return None
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
    return out


def _encode_positions(refs: array[int]) -> str:
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        refs = array("I", refs)
        refs.byteswap()
    return base64.b64encode(refs.tobytes()).decode("ascii")


def write_index(store: CheckpointStore, registry: Registry, listing_age: float) -> None:
    """Rewrite the index for the committed checkpoints of ``registry`` (best effort).

    Each entry records the `_metadata` (size, mtime) listed before its references
    were read (`build_registry`); the path table is the registry's (the old index's
    table plus the paths of records parsed since), compacted when more than half of
    it is no longer referenced."""
    refs = registry.refs
    rows: list[tuple[int, FileInfo, array[int]]] = []
    for label, positions in refs.owners.items():
        cid = chk_id_of(label)
        if cid is None or cid not in registry.checkpoints:
            continue  # a savepoint: read whole every time (there are few)
        info = registry.files.get(metadata_path(cid))
        if info is not None and info.mtime is not None:
            rows.append((cid, info, positions))
    paths, sizes = refs.paths, refs.sizes
    used = refs.union(checkpoint_label(cid) for cid, _, _ in rows)
    if len(used) * 2 < len(paths):  # compact: keep the used paths, in table order
        kept = sorted(used)
        remap = {old: new for new, old in enumerate(kept)}
        paths, sizes = [paths[i] for i in kept], [sizes[i] for i in kept]
        rows = [(cid, info, array("I", map(remap.__getitem__, positions)))
                for cid, info, positions in rows]
    all_refs = array("I")
    for _, _, positions in rows:
        all_refs.extend(positions)
    body = json.dumps({
        "paths": paths, "sizes": sizes, "ids": [cid for cid, _, _ in rows],
        "record_sizes": [info.size for _, info, _ in rows],
        "record_mtimes": [info.mtime for _, info, _ in rows],
        "counts": [len(positions) for _, _, positions in rows],
        "refs": _encode_positions(all_refs), "listing_age_seconds": listing_age},
        separators=(",", ":")).encode()
    head = {"format": INDEX_FORMAT, "job": store.job, "sha256": hashlib.sha256(body).hexdigest()}
    key = signing_key(store.index_key)
    if key is not None:
        head["mac"] = sign(key, _signed_message(store.job, body))
    header = json.dumps(head).encode()
    try:
        store.storage.write_bytes(INDEX_FILE, header + b"\n" + body)
    except CkptError as exc:  # a read-only or full store still plans, only slower
        log.warning("registry index %s/%s not written: %s", store.storage.url, INDEX_FILE, exc)


def referenced_by_records(store: CheckpointStore, ids: Iterable[int],
                          among: set[str]) -> set[str]:
    """The paths of ``among`` (an executor's planned deletions) that the real `_metadata`
    of ``ids`` lists (retired ones are skipped): the executors' re-check of a plan made
    from the index.

    It only decides what to spare, so it reads each record's file references alone
    (`metadata.listed_paths`, a JSON parse: about a fifth of a strict parse); a record
    not laid out as one is parsed strictly, and refused (MetadataError) if malformed.
    Each record's paths are looked up in ``among``, not gathered: 10,000 records list
    1M paths.
    """
    ids = sorted(set(ids))
    out: set[str] = set()
    memo: ParseMemo = {}
    for cid, data in zip(ids, store.read_records(ids), strict=True):
        if data is None:
            continue
        paths = listed_paths(data)
        out.update(among.intersection(
            paths if paths is not None else paths_of(store.parse(cid, data, memo))))
    return out


def make_registry(*, job: str, now: datetime | float | None,
                  files: Iterable[FileInfo] | Mapping[str, FileInfo],
                  checkpoints: Iterable[CheckpointMetadata],
                  savepoints: Mapping[str, CheckpointMetadata | None] | None = None,
                  leases: Iterable[Lease] = ()) -> Registry:
    """Pure: index who references which file (no I/O; tests build registries with it).

    ``savepoints``: name -> its `_metadata`, or None for a folder without one (incomplete).
    """
    metas = sorted(checkpoints, key=lambda m: m.checkpoint_id)
    named = {name: m for name, m in sorted((savepoints or {}).items()) if m is not None}
    owners: dict[str, array[int] | CheckpointMetadata] = {
        checkpoint_label(m.checkpoint_id): m for m in metas}
    owners.update((savepoint_label(name), m) for name, m in named.items())
    return Registry(
        job=job,
        now=as_datetime(now),
        files=files_by_path(files),
        checkpoints={m.checkpoint_id: m for m in metas},
        savepoints=named,
        incomplete_savepoints=tuple(sorted(set(savepoints or {}) - set(named))),
        leases=tuple(leases),
        refs=build_references(owners),
    )


def files_by_path(files: Iterable[FileInfo] | Mapping[str, FileInfo]) -> Listing:
    """A `Listing` of ``files`` (a listing is taken as it is)."""
    if isinstance(files, Listing):
        return files
    infos = dict(files) if isinstance(files, Mapping) else {f.path: f for f in files}
    return Listing(sorted(infos), infos)


def names_under(paths: list[str], folder: str, nested: bool = False) -> list[str]:
    """Names of the files directly in ``folder`` (``paths``: sorted relative paths)."""
    prefix = folder + "/"
    first = bisect.bisect_left(paths, prefix)
    end = bisect.bisect_left(paths, folder + "0", first)  # "0" sorts right after "/"
    return [p[len(prefix):] for p in paths[first:end] if nested or "/" not in p[len(prefix):]]


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
