"""Savepoints and start points: self-contained copies a new lineage can start from.

Savepoint layout (paths in its `_metadata` are relative to the job root)::

    <job>/savepoints/<name>/_claim                 who creates it (written first, exclusive)
    <job>/savepoints/<name>/<subtask>/<file>       its own copy of every file
    <job>/savepoints/<name>/_metadata              kind "savepoint", written last

- `create_savepoint(store, ref, name)` copies every file of checkpoint ``ref`` (a
  WAL-mode external checkpoint's state is exported instead: lifecycle/export.py)
  while holding a lease on it (retention and GC cannot take it away mid-copy),
  checks every copy's size and checksum against the record (`Storage.copy_checked`:
  on file:// a hard link of the immutable file and the checksum of its bytes, one
  after the other in this thread; elsewhere a server-side copy and one read of it, in
  a bounded pool of `COPY_THREADS` requests) (issue 20 defect 5:
  a truncated or flipped source file fails the savepoint in one line naming it,
  and the partial copy is removed), then writes `_metadata` exclusively. Nothing in
  a savepoint points into ``shared/``; GC and retention never touch
  ``savepoints/``. The name is claimed first with an exclusive ``_claim`` file, so
  two creators of one name cannot mix their files; an interrupted creation leaves
  an incomplete folder that blocks the name until removed (listed by the registry,
  never collected).
- `import_start_point(storage, target_job, spec)` copies a savepoint or another
  job's checkpoint into ``target_job`` and commits it as that job's *first*
  checkpoint (parent None, ``source`` naming where it came from), verified the same
  way. Shared files
  get fresh unique names under the target's ``shared/``, private files go to
  ``chk-<id>/<subtask>/<snapshot>/``. Because it is a copy (on file:// a hard link:
  another name for bytes nobody writes), the two lineages never share a name: neither
  job's retention or GC can hurt the other.

- `list_savepoints(store)` lists complete and incomplete savepoints;
  `delete_savepoint(store, name, dry_run=...)` removes one (its `_metadata`
  first, so it stops existing before any of its files go), refused while a live
  lease uses it: its creation, or an import copying from it (which holds a lease
  with no checkpoint ids for that purpose). It never touches checkpoints: a
  savepoint owns every file under its folder and nothing else.

Start-point specs (``--start-from``), all within the same storage root:

- ``<job>/savepoints/<name>`` -- a savepoint by path (a trailing ``/_metadata``
  is accepted), also as the full URL ``ckpt savepoint`` prints
  (``<root URL>/<job>/savepoints/<name>``, or on file:// the absolute path);
- ``<name>`` -- a savepoint by name, searched in every job of the root; refused
  when no job or several jobs have it;
- ``<job>:<id>``, ``<job>:chk-<id>``, ``<job>:latest`` -- a committed checkpoint
  of another job (held by a lease while it is copied).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from statebackend.checkpoint.layout import (
    CHK_PREFIX,
    METADATA_FILE,
    SAVEPOINTS_DIR,
    private_dir,
    savepoint_dir,
    savepoint_metadata_path,
    shared_path,
)
from statebackend.checkpoint.leases import Lease, default_holder, hold, live_leases
from statebackend.checkpoint.metadata import CheckpointMetadata, FileRef, SubtaskHandle, utc_now_iso
from statebackend.checkpoint.store import CheckpointStore, check_job_name
from statebackend.errors import (
    CheckpointNotFoundError,
    LeaseConflictError,
    MetadataError,
    StorageError,
    UnsafePathError,
    UsageError,
)
from statebackend.lifecycle.registry import (
    check_savepoint_name,
    load_savepoint,
)
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.state.external_store import ExternalStore
from statebackend.storage import Storage, checksum_algorithm

COPY_THREADS = 8
CLAIM_FILE = "_claim"


def savepoint_purpose(name: str, action: str | None = None) -> str:
    """Purpose of a lease that uses savepoint ``name`` (creation: no action)."""
    return f"savepoint {name}" if action is None else f"savepoint {name}: {action}"


def uses_savepoint(lease: Lease, name: str) -> bool:
    base = savepoint_purpose(name)
    return lease.purpose == base or lease.purpose.startswith(base + ": ")


@dataclass(frozen=True)
class SavepointInfo:
    """One savepoint of a job (`ckpt savepoints`); field names are the --json keys.

    An incomplete one (no `_metadata`: a creation running or interrupted) has
    ``complete`` False and only ``files``/``bytes``.
    """

    name: str
    complete: bool
    source_job: str | None
    source_checkpoint: int | None
    created_at: str | None
    parallelism: int | None
    files: int
    bytes: int
    # Its state's backend (a WAL-mode export is a memory-backend savepoint); None while
    # incomplete
    backend: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "complete": self.complete, "source_job": self.source_job,
                "source_checkpoint": self.source_checkpoint, "created_at": self.created_at,
                "parallelism": self.parallelism, "files": self.files, "bytes": self.bytes,
                "backend": self.backend}


@dataclass(frozen=True)
class SavepointDeletion:
    """What deleting a savepoint removes (the plan) or removed."""

    job: str
    name: str
    complete: bool
    files: tuple[str, ...]  # job-relative, `_metadata` first
    bytes: int
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "savepoint": self.name, "complete": self.complete,
                "dry_run": self.dry_run, "files": list(self.files),
                "files_deleted": 0 if self.dry_run else len(self.files), "bytes": self.bytes}


def list_savepoints(store: CheckpointStore) -> list[SavepointInfo]:
    """Every savepoint folder of the job, by name; MetadataError on a malformed one."""
    out = []
    for name in store.storage.list_dir(SAVEPOINTS_DIR):
        try:
            check_savepoint_name(name)
        except UsageError:
            continue  # not a savepoint this library wrote
        if store.storage.exists(savepoint_metadata_path(name)):
            meta = load_savepoint(store, name)
            source = meta.source or {}
            out.append(SavepointInfo(
                name, True, source.get("job"), source.get("checkpoint"), meta.created_at,
                meta.parallelism, len(meta.files), meta.bytes_referenced, meta.state_backend))
        else:
            files = store.storage.walk_files(savepoint_dir(name))
            out.append(SavepointInfo(name, False, None, None, None, None, len(files),
                                     sum(f.size for f in files)))
    return out


def plan_savepoint_deletion(store: CheckpointStore, name: str) -> SavepointDeletion:
    """The files of savepoint ``name``; refused (LeaseConflictError) while a live lease
    uses it, CheckpointNotFoundError when there is no such folder."""
    check_savepoint_name(name)
    store.require_job()
    base = savepoint_dir(name)
    listing = store.storage.walk_files(base)
    if not listing:
        raise CheckpointNotFoundError(
            f"savepoint {name!r} of job {store.job!r} not found (no {store.storage.url}/{base}); "
            "see `ckpt savepoints`")
    users = [x for x in live_leases(store.storage) if uses_savepoint(x, name)]
    if users:
        x = users[0]
        raise LeaseConflictError(
            f"savepoint {name!r} of job {store.job!r} is in use: live lease {x.name} "
            f"({x.purpose}) by {x.holder} until {x.expires_at}; nothing deleted, try again "
            "when it ends")
    meta_path = savepoint_metadata_path(name)
    paths = sorted((f.path for f in listing), key=lambda p: (p != meta_path, p))
    return SavepointDeletion(store.job, name, paths[0] == meta_path, tuple(paths),
                             sum(f.size for f in listing), dry_run=True)


def delete_savepoint(store: CheckpointStore, name: str, *,
                     dry_run: bool = False) -> SavepointDeletion:
    """Delete savepoint ``name`` (see the module docstring); ``dry_run`` only plans."""
    plan = plan_savepoint_deletion(store, name)
    if dry_run:
        return plan
    storage = store.storage
    # `_metadata` first: once it is gone the savepoint no longer exists, so a failure
    # below leaves an incomplete folder (listed, deletable again), never a savepoint
    # with files missing
    failures = storage.delete_many(plan.files[:1]) if plan.complete else []
    if not failures:
        failures = storage.delete_many(plan.files[1:] if plan.complete else plan.files)
    if failures:
        path, why = failures[0]
        raise StorageError(f"savepoint {name!r} of job {store.job!r}: {len(failures)} file(s) "
                           f"not deleted, e.g. {storage.url}/{path}: {why}; run the delete again")
    storage.delete_tree(savepoint_dir(name))  # the now empty folders
    return replace(plan, dry_run=False)


def create_savepoint(store: CheckpointStore, ref: str | int | None, name: str,
                     state_db: ExternalStore | None = None,
                     progress: ProgressSink = NO_PROGRESS) -> CheckpointMetadata:
    """Copy checkpoint ``ref`` (id, chk-<id> or latest) to ``savepoints/<name>/``; a
    WAL-mode external checkpoint is exported from ``state_db`` instead
    (statebackend.lifecycle.export)."""
    check_savepoint_name(name)
    storage = store.storage
    meta = store.resolve(ref)
    with claimed_savepoint(store, name, {"checkpoint": meta.checkpoint_id}) as base, \
            hold(storage, savepoint_purpose(name), [meta.checkpoint_id]):
        # the checkpoint may have been retired between resolve and hold: re-read it
        meta = store.load(meta.checkpoint_id)
        extra = dict(meta.extra, savepoint=name)
        exported_from = meta.external.store \
            if meta.external is not None and meta.external.mode == "wal" else None
        if exported_from:
            # restores state (pyarrow, rocksdict): Airflow's DAG parsing imports this module
            from statebackend.lifecycle.export import export_subtasks

            subtasks = export_subtasks(storage, meta, base, state_db, progress)
            extra["exported_from"] = exported_from
        else:
            copies: list[tuple[FileRef, str]] = []
            subtasks = tuple(
                _relocated(sub, copies, shared_to=_in_folder(f"{base}/{sub.index}"),
                           private_to=_in_folder(f"{base}/{sub.index}"))
                for sub in meta.subtasks)
            _check_unique([dst for _, dst in copies], f"savepoint {name!r}")
            _copy_all(storage, copies, f"savepoint {name!r} of job {store.job!r} not created")
        saved = meta.with_changes(
            kind="savepoint", parent=None, subtasks=subtasks, created_at=utc_now_iso(),
            source={"job": store.job, "checkpoint": meta.checkpoint_id, "savepoint": None},
            extra=extra, external=None if exported_from else meta.external)
        commit_savepoint(store, name, saved)
    return saved


def check_savepoint_free(store: CheckpointStore, name: str) -> None:
    """UsageError unless ``name`` is a valid savepoint name that no savepoint (complete,
    or the folder an interrupted attempt left) of the job has."""
    check_savepoint_name(name)
    storage, base = store.storage, savepoint_dir(name)
    if storage.exists(savepoint_metadata_path(name)) or storage.list_dir(base):
        raise UsageError(f"savepoint {name!r} of job {store.job!r} already exists (or an "
                         f"interrupted attempt left {storage.url}/{base}); choose another name "
                         "or delete that folder")


@contextmanager
def claimed_savepoint(store: CheckpointStore, name: str,
                      claim: Mapping[str, Any]) -> Iterator[str]:
    """Claim the name ``name`` (an exclusive ``_claim`` holding ``claim``, the holder and
    the time) and yield the savepoint's folder; UsageError when the name is taken.

    A failure inside frees the name again: unless its `_metadata` was written, the
    folder goes with whatever was written into it.
    """
    check_savepoint_free(store, name)
    storage = store.storage
    base = savepoint_dir(name)
    try:
        storage.write_exclusive(f"{base}/{CLAIM_FILE}", json.dumps(
            {"holder": default_holder(), **claim, "created_at": utc_now_iso()}).encode())
    except FileExistsError as exc:
        raise UsageError(f"savepoint {name!r} of job {store.job!r} is being created by "
                         "another process") from exc
    try:
        yield base
    except BaseException:
        if not storage.exists(savepoint_metadata_path(name)):
            storage.delete_tree(base)
        raise


def commit_savepoint(store: CheckpointStore, name: str, meta: CheckpointMetadata) -> None:
    """Write savepoint ``name``'s `_metadata` (last, exclusively), checked by the parser
    first (file scope, names, key-group ranges)."""
    data = meta.to_bytes()
    path = savepoint_metadata_path(name)
    CheckpointMetadata.from_bytes(data, f"{store.storage.url}/{path}")
    try:
        store.storage.write_exclusive(path, data)
    except FileExistsError as exc:
        raise UsageError(f"savepoint {name!r} of job {store.job!r} was committed by "
                         "another process") from exc


def parse_start_spec(storage: Storage, spec: str) -> tuple[str, str, str]:
    """(kind, job, what) of a start-point spec: ("savepoint", job, name) or
    ("checkpoint", job, "latest" | id)."""
    if not isinstance(spec, str) or not spec.strip():
        raise UsageError("start point is empty: use <job>/savepoints/<name>, <name> or "
                         "<job>:<id|latest>")
    spec = spec.strip().rstrip("/")
    if "://" in spec or spec.startswith("/"):
        spec = _relative_to_root(storage, spec)
    if ":" in spec and "/" not in spec:
        job, what = spec.split(":", 1)
        check_job_name(job)
        what = what.removeprefix(CHK_PREFIX)
        if what != "latest" and not what.isdigit():
            raise UsageError(f"start point {spec!r}: checkpoint must be an id, chk-<id> or "
                             "latest")
        return "checkpoint", job, what
    if spec.endswith("/" + METADATA_FILE):
        spec = spec[: -len(METADATA_FILE) - 1]
    parts = spec.split("/")
    if len(parts) == 3 and parts[1] == SAVEPOINTS_DIR:
        return "savepoint", check_job_name(parts[0]), check_savepoint_name(parts[2])
    if len(parts) == 1:
        name = check_savepoint_name(parts[0])
        # one existence check per job folder (a glob over '*' is unreliable on S3)
        found = [job for job in storage.list_dir("")
                 if storage.exists(f"{job}/{savepoint_metadata_path(name)}")]
        if not found:
            raise CheckpointNotFoundError(
                f"no savepoint named {name!r} under {storage.url}; use <job>/savepoints/<name> "
                "or <job>:<id|latest> for a checkpoint")
        if len(found) > 1:
            raise UsageError(f"savepoint name {name!r} exists in several jobs {found}; "
                             f"say which: <job>/savepoints/{name}")
        return "savepoint", found[0], name
    raise UsageError(f"start point {spec!r} is not <job>/savepoints/<name>, <name> or "
                     "<job>:<id|latest>")


def _relative_to_root(storage: Storage, location: str) -> str:
    """``<job>/savepoints/<name>`` of a URL (or file:// absolute path) under ``storage``."""
    prefixes = [storage.url.rstrip("/") + "/"]
    local_root = storage.local_path("")
    if local_root is not None:
        prefixes += [local_root + "/", f"file://{local_root}/"]
    for prefix in prefixes:
        if location.startswith(prefix) and len(location) > len(prefix):
            return location[len(prefix):]
    raise UsageError(f"start point {location!r} is not under the storage root {storage.url}; "
                     "run with --storage set to its root, or copy the savepoint there")


def read_start_point(storage: Storage, spec: str) -> CheckpointMetadata:
    """The record ``spec`` names (a savepoint or another job's checkpoint), read only:
    what a first run's compatibility check compares with before anything is copied."""
    return load_start_point(storage, *parse_start_spec(storage, spec))


def load_start_point(storage: Storage, kind: str, job: str, what: str) -> CheckpointMetadata:
    """The record of a parsed start point (`parse_start_spec`): savepoint ``what`` of
    ``job``, or its checkpoint ``what`` (an id or ``latest``)."""
    source = CheckpointStore(storage, job)
    source.require_job()
    return load_savepoint(source, what) if kind == "savepoint" else source.resolve(what)


def import_start_point(storage: Storage, target_job: str, spec: str) -> CheckpointMetadata:
    """Copy a savepoint or another job's checkpoint into ``target_job`` as its first checkpoint."""
    target = CheckpointStore(storage, target_job)
    if target.checkpoint_ids():
        raise UsageError(f"job {target_job!r} already has checkpoints; a start point can only "
                         "seed a new job (use another --job, or restore from its own latest)")
    kind, source_job, what = parse_start_spec(storage, spec)
    source = CheckpointStore(storage, source_job)
    source.require_job()  # a hold on a missing job would leave a phantom folder behind
    if kind == "savepoint":
        # a lease with no checkpoint ids: it only tells `delete_savepoint` to wait
        with hold(source.storage, savepoint_purpose(what, f"import into {target_job}"), []):
            meta = load_savepoint(source, what)
            return _import(storage, target, meta, {
                "job": source_job, "checkpoint": meta.checkpoint_id, "savepoint": what})
    if source_job == target.job:
        raise UsageError(f"start point {spec!r} names job {target_job!r} itself")
    meta = source.resolve(what)
    with hold(source.storage, f"import into {target_job}", [meta.checkpoint_id]):
        meta = source.load(meta.checkpoint_id)  # may have been retired before the hold
        return _import(storage, target, meta, {
            "job": source_job, "checkpoint": meta.checkpoint_id, "savepoint": None})


def _import(root: Storage, target: CheckpointStore, meta: CheckpointMetadata,
            source: dict[str, Any]) -> CheckpointMetadata:
    if meta.external is not None:
        raise UsageError(f"checkpoint {meta.checkpoint_id} of job {source['job']!r} keeps its "
                         f"state in {meta.external.store} under that job: it cannot start "
                         f"job {target.job!r} (run the job on another backend first)")
    cid = target.next_checkpoint_id()
    copies: list[tuple[FileRef, str]] = []
    subtasks = []
    for sub in meta.subtasks:
        prefix = private_dir(cid, sub.index, sub.snapshot_id)
        subtasks.append(_relocated(
            sub, copies, shared_to=lambda f: shared_path(f"{uuid.uuid4().hex}-{f.local_name}"),
            private_to=_in_folder(prefix)))
    _check_unique([dst for _, dst in copies], f"checkpoint {cid} of job {target.job!r}")
    first = CheckpointMetadata(
        job=target.job, checkpoint_id=cid, parent=None, parallelism=meta.parallelism,
        max_parallelism=meta.max_parallelism, states=meta.states, subtasks=tuple(subtasks),
        kind="checkpoint", run_id=None, input=(), source=source,
        # the key column travels: a changed key is refused on the new lineage too
        extra={"imported_at": utc_now_iso(),
               **({"key": meta.extra["key"]} if "key" in meta.extra else {})},
        watermark=meta.watermark,
        processing_time=meta.processing_time, key_hash=meta.key_hash)
    # copy through the common root: both jobs are folders of it
    src_job = source["job"]
    _copy_all(root, [(replace(f, path=f"{src_job}/{f.path}"), f"{target.job}/{d}")
                     for f, d in copies], f"start point for job {target.job!r} not imported")
    try:
        if target.checkpoint_ids():
            raise UsageError(f"job {target.job!r} got a checkpoint while the start point was "
                             "copied; nothing imported")
        target.commit(first)
    except BaseException:
        target.storage.delete_many(dst for _, dst in copies)
        raise
    return first


def _in_folder(folder: str) -> Callable[[FileRef], str]:
    """Where `_relocated` puts a file: ``<folder>/<its local name>``."""
    return lambda f: f"{folder}/{f.local_name}"


def _relocated(sub: SubtaskHandle, copies: list[tuple[FileRef, str]], *,
               shared_to: Callable[[FileRef], str],
               private_to: Callable[[FileRef], str]) -> SubtaskHandle:
    """The handle with every file at its new path; appends (source ref, dst) to ``copies``.

    The copy is self-contained, so all its bytes count as uploaded by it.
    """
    def moved(refs: Sequence[FileRef], name_of: Callable[[FileRef], str]) -> tuple[FileRef, ...]:
        out = []
        for f in refs:
            dst = name_of(f)
            copies.append((f, dst))
            out.append(replace(f, path=dst))
        return tuple(out)

    return replace(sub, shared_files=moved(sub.shared_files, shared_to),
                   private_files=moved(sub.private_files, private_to),
                   row_counts=dict(sub.row_counts), bytes_uploaded=sub.size)


def _check_unique(paths: list[str], what: str) -> None:
    if len(set(paths)) != len(paths):
        raise UsageError(f"{what}: two files would land on the same path (duplicate local "
                         "names in one subtask)")


def _copy_all(storage: Storage, copies: list[tuple[FileRef, str]], what: str) -> None:
    """Copy (source ref, dst) pairs of ``storage`` (server-side on S3, in a bounded pool
    of requests; hard links on file://, in this thread: `Storage.map_requests`), each
    verified against the source's recorded size and checksum; on any failure remove
    what was copied and raise one error: a damaged source file by name (MetadataError),
    else the distinct storage causes."""
    outcomes = storage.attempt_requests(lambda copy: _copy_verified(storage, *copy), copies,
                                        COPY_THREADS)
    errors = [e for _, e in outcomes if e is not None]
    if errors:  # a failed copy may have left a partial file: every destination goes
        storage.delete_many(dst for _, dst in copies)
        unsafe = [e for e in errors if isinstance(e, UnsafePathError)]
        if unsafe:
            raise UnsafePathError(f"{what}: {unsafe[0]}; nothing was kept") from unsafe[0]
        damaged = [e for e in errors if isinstance(e, MetadataError)]
        if damaged:
            more = f" (and {len(damaged) - 1} more damaged files)" if len(damaged) > 1 else ""
            raise MetadataError(f"{what}: {damaged[0]}{more}; nothing was kept") from damaged[0]
        causes = sorted({str(e) for e in errors})
        raise StorageError(f"{what}: copy failed for {len(errors)} of {len(copies)} files: "
                           + "; ".join(causes[:5])) from errors[0]


def _copy_verified(storage: Storage, ref: FileRef, dst: str) -> None:
    """Copy ``ref`` to ``dst`` and check the copy's size and checksum against ``ref``
    (what was recorded when the file was uploaded; `Storage.copy_checked`)."""
    size, checksum = storage.copy_checked(ref.path, dst, checksum_algorithm(ref.checksum))
    _check_facts(storage, ref.path, ref, size, checksum)


def verify_stored(storage: Storage, path: str, ref: FileRef, named: str | None = None) -> None:
    """MetadataError naming ``named`` (default ``path``) unless the stored file ``path``
    has ``ref``'s size and checksum (one read of it)."""
    size, checksum = storage.checksum(path, checksum_algorithm(ref.checksum))
    _check_facts(storage, named or path, ref, size, checksum)


def _check_facts(storage: Storage, named: str, ref: FileRef, size: int, checksum: str
                 ) -> None:
    if size != ref.size or checksum != ref.checksum:
        found = f"size {size}" if size != ref.size else f"checksum {checksum}"
        wanted = f"{ref.size}" if size != ref.size else ref.checksum
        raise MetadataError(
            f"file {storage.url_of(named)} is damaged: {found}, recorded {wanted} "
            "(run `ckpt validate --level deep` on its checkpoint)")
