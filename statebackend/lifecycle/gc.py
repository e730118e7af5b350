"""Compaction-aware garbage collection of one job's ``shared/`` and ``chk-*/`` files.

Rule: a file dies only when no committed checkpoint, no savepoint and no live
lease references it (an *orphan*), and only once it is older than the grace
period (default 1 h) by *storage* mtime. Files that retired checkpoints
released are deleted by retention itself (retention.py), without a grace
period: they were committed, so no attempt can still be uploading them.
Committed ``_metadata`` files are never collected here (retention retires
checkpoints); ``savepoints/``, ``leases/``, ``reports/`` and anything outside
``shared/`` and ``chk-<id>/`` are never touched. GC never looks outside its own
job root, so it cannot harm another job, and another job's GC cannot harm
state this job imported (imports copy, see savepoint.py).

Classification of each listed file in scope (reasons appear in the report):

- ``referenced``          listed by a committed checkpoint or savepoint: keep
- ``commit-record``       ``chk-<id>/_metadata`` of a committed checkpoint: keep
- ``orphan-leased``       orphan inside ``chk-<id>/`` of an id a live lease names: keep
- ``orphan-writer-active`` while a writer lease is live: orphan inside a ``chk-<id>/``
                          above the newest committed id (the writer's attempt
                          folder), or written after the lease was taken: keep
- ``orphan-no-mtime``     orphan whose age the storage cannot tell: keep
- ``orphan-pending``      orphan younger than the grace period: keep
- ``orphan-shared``       expired orphan under ``shared/``: delete
- ``orphan-uncommitted``  expired file of a ``chk-<id>/`` that never committed: delete
- ``orphan-unreferenced`` expired file in a committed ``chk-<id>/`` that its
                          ``_metadata`` does not list (an overlapping attempt): delete

Failure scenarios this design handles (numbered; tests name them):

1. *Upload in progress.* An attempt is still uploading while GC runs: its files
   are listed but no `_metadata` references them yet. They are younger than
   the grace period, so they stay (``orphan-pending``); with a live writer lease
   they stay whatever the grace (``orphan-writer-active``), so ``--grace-seconds
   0`` is safe while the job runs. The writer renews its lease (leases.py), so a
   run longer than the lease TTL stays protected (issue 10, defect 2).
2. *Commit between listing and reading.* The registry lists files *first* and
   reads metadata *after* (registry.py): a checkpoint committed in between is
   read, so its files are ``referenced``. The reverse order would see its files
   but not its metadata and call them orphans.
3. *Commit after reading, before deleting.* Its new files are young (scenario 1);
   the files it reuses belong to its base checkpoint, which is the newest
   committed one (retention keeps at least one) or is held by the writer's
   lease. And the executor re-reads the committed ids just before deleting and
   spares every file a checkpoint committed since planning references.
4. *Aborted attempt whose files a later checkpoint references* (Flink lost
   data this way when discarding an aborted checkpoint deleted shared state).
   Classification is by reference first: where a file was uploaded and which
   attempt uploaded it never matter, and aborts never delete shared files
   another checkpoint lists.
5. *Two overlapping attempts with the same id.* `_metadata` is created
   exclusively, so the second commit fails; its files sit in ``chk-<id>/`` of a
   committed checkpoint but are not listed by it (``orphan-unreferenced``) and
   go after the grace period; the committed checkpoint's files are
   ``referenced`` and stay.
6. *Interrupted retention.* `_metadata` is deleted before the files, so a crash
   leaves unreferenced, old files: ordinary orphans, collected here.
7. *Malformed metadata or lease.* The registry raises MetadataError and
   nothing is planned: an unreadable checkpoint could reference any file. So
   does a lineage that forked or lost a commit record (LineageError,
   checkpoint/lineage.py): a lost record's files would look unreferenced.
8. *Clock skew.* Ages use the storage's mtime against ``now``; a writer lease's
   ``created_at`` comes from the writer's clock, so it is compared with
   ``WRITER_SKEW_SECONDS`` of slack.
9. *Reader without a lease.* A restore, rescale or validation must hold a lease
   on what it reads (leases.py); one that does not may see its checkpoint
   retired and then fails loudly (missing file or checksum), never silently.
10. *Lease taken after planning.* A writer or hold lease taken between planning
    and deleting: the executor re-reads the live leases and spares every planned
    deletion such a lease protects (same rules as planning).
11. *Stale or tampered registry index.* An index entry is used only while the
    listed `_metadata` keeps its size and mtime, and when a plan with deletions
    used any, the executor reads the real `_metadata` of those checkpoints
    (`registry.referenced_by_records`) and spares every file they list. Only the
    records that could list a planned deletion are read: a record is written once,
    after every file it lists was uploaded, so one whose storage mtime is older than
    the oldest planned deletion (less `RECORD_SKEW_SECONDS`) lists none of them
    (`records_to_recheck`; a record without an mtime is read). GC after every run
    deletes recent orphans, so it reads the few records committed since them. An
    index signed with this host's key (index_signing.py) vouches for the records older
    than the listing it was built from: those are not read either. A tampered index
    does not verify, so it vouches for nothing, and a build that writes the index
    parses every record instead of trusting it (registry.py).

`plan_gc` is pure; `execute_gc` deletes best effort (batched on S3) after the
re-checks of scenarios 3 and 10; `collect_garbage` = registry + plan + execute. Its
result is a `GcReport`, the `DeletionReport` retention returns too (deletion.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, ClassVar, TypedDict

from statebackend.checkpoint.layout import (
    GC_SCOPE_PREFIXES,
    chk_id_of,
    in_gc_scope,
    is_commit_record,
)
from statebackend.checkpoint.leases import WRITER_LEASE, Lease, live_leases
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CheckpointNotFoundError
from statebackend.lifecycle.deletion import DeletionReport, delete_counted, prune_empty_dirs
from statebackend.lifecycle.registry import (
    Registry,
    as_datetime,
    build_registry,
    referenced_by_records,
)
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.settings import number

DEFAULT_GRACE_SECONDS = 3600.0
MAX_GRACE_SECONDS = 10 * 365 * 86400.0  # longer is a typo (or `inf`)
WRITER_SKEW_SECONDS = 300.0
# slack between the storage mtimes of a file and of a record listing it (scenario 11):
# the same storage's clock, but S3 dates a multipart upload by its start
RECORD_SKEW_SECONDS = 300.0

KEEP_REFERENCED = "referenced"
KEEP_COMMIT_RECORD = "commit-record"
KEEP_LEASED = "orphan-leased"
KEEP_WRITER_ACTIVE = "orphan-writer-active"
KEEP_NO_MTIME = "orphan-no-mtime"
KEEP_PENDING = "orphan-pending"
DEL_SHARED = "orphan-shared"
DEL_UNCOMMITTED = "orphan-uncommitted"
DEL_UNREFERENCED = "orphan-unreferenced"
ORPHAN_KEEP_REASONS = (KEEP_LEASED, KEEP_WRITER_ACTIVE, KEEP_NO_MTIME, KEEP_PENDING)


class ReasonTally(TypedDict):
    """One reason's line of `GcPlan.by_reason`."""

    action: str  # "keep" | "delete"
    files: int
    bytes: int


@dataclass(frozen=True, slots=True)  # one per orphan: there may be many
class GcFile:
    path: str
    size: int
    age_seconds: float | None
    reason: str
    mtime: float | None = None  # storage mtime, for the executor's lease re-check

    def to_json(self) -> dict[str, Any]:
        age = None if self.age_seconds is None else round(self.age_seconds, 3)
        return {"path": self.path, "size": self.size, "age_seconds": age, "reason": self.reason}


@dataclass(frozen=True)
class GcPlan:
    """Deletions and pending orphans file by file; kept referenced files by path only
    (there are as many as the job has live files)."""

    operation: ClassVar[str] = "gc"
    job: str
    grace_seconds: float
    deletions: tuple[GcFile, ...]
    pending: tuple[GcFile, ...]          # orphans kept for now (grace, lease, writer, no mtime)
    referenced: tuple[str, ...]          # kept: listed by a checkpoint or savepoint
    commit_records: tuple[str, ...]      # kept: _metadata of committed checkpoints
    referenced_bytes: int = 0
    commit_record_bytes: int = 0
    indexed_ids: tuple[int, ...] = ()    # planned from the index and may list a deletion:
    #                                      the executor reads their real records

    @property
    def bytes_to_delete(self) -> int:
        return sum(f.size for f in self.deletions)

    @property
    def files_kept(self) -> int:
        return len(self.pending) + len(self.referenced) + len(self.commit_records)

    @property
    def bytes_kept(self) -> int:
        return (sum(f.size for f in self.pending) + self.referenced_bytes
                + self.commit_record_bytes)

    def by_reason(self, deleted: set[str] | None = None) -> dict[str, ReasonTally]:
        """{reason: {action, files, bytes}}; with ``deleted``, deletions actually done."""
        out: dict[str, ReasonTally] = {
            KEEP_REFERENCED: {"action": "keep", "files": len(self.referenced),
                              "bytes": self.referenced_bytes},
            KEEP_COMMIT_RECORD: {"action": "keep", "files": len(self.commit_records),
                                 "bytes": self.commit_record_bytes}}
        for f in self.pending:
            slot = out.setdefault(f.reason, {"action": "keep", "files": 0, "bytes": 0})
            slot["files"] += 1
            slot["bytes"] += f.size
        for f in self.deletions:
            slot = out.setdefault(f.reason, {"action": "delete", "files": 0, "bytes": 0})
            if deleted is None or f.path in deleted:
                slot["files"] += 1
                slot["bytes"] += f.size
        return out

    def report_fields(self, done: Sequence[GcFile] | None) -> dict[str, Any]:
        """gc's keys of its `DeletionReport` (``done``: deleted files; None: dry run)."""
        pending = self.pending
        return {
            "grace_seconds": self.grace_seconds,
            "files_kept": self.files_kept, "bytes_kept": self.bytes_kept,
            "orphans_pending": len(pending), "orphan_bytes_pending": sum(f.size for f in pending),
            "by_reason": self.by_reason(None if done is None else {f.path for f in done}),
            "deletions": [f.to_json() for f in (self.deletions if done is None else done)],
            "pending": [f.to_json() for f in pending],
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job, "grace_seconds": self.grace_seconds,
            "files_to_delete": len(self.deletions), "bytes_to_delete": self.bytes_to_delete,
            "files_kept": self.files_kept, "bytes_kept": self.bytes_kept,
            "orphans_pending": len(self.pending),
            "by_reason": self.by_reason(),
            "deletions": [f.to_json() for f in self.deletions],
            "pending": [f.to_json() for f in self.pending],
        }


GcReport = DeletionReport[GcPlan, GcFile]


@dataclass(frozen=True)
class LeaseGuard:
    """What the live leases protect from GC, whatever the grace period."""

    held_ids: frozenset[int]          # chk-<id>/ folders named by a live lease
    writer_from_id: int | None        # with a live writer: chk-<id>/ folders at or above
    writer_since: float | None        # with a live writer: files written at or after

    def reason(self, path: str, mtime: float | None) -> str | None:
        cid = chk_id_of(path)
        if cid is not None and cid in self.held_ids:
            return KEEP_LEASED
        if self.writer_from_id is not None and cid is not None and cid >= self.writer_from_id:
            return KEEP_WRITER_ACTIVE  # the writer's attempt folder (its id is not known)
        if self.writer_since is not None and (mtime is None or mtime >= self.writer_since):
            return KEEP_WRITER_ACTIVE
        return None


def lease_guard(live: Iterable[Lease], committed: Iterable[int]) -> LeaseGuard:
    """Pure: the protection of ``live`` leases given the committed ids."""
    live = list(live)
    held = frozenset(cid for lease in live for cid in lease.checkpoint_ids)
    writers = [x for x in live if x.name == WRITER_LEASE]
    if not writers:
        return LeaseGuard(held, None, None)
    # A writer's attempt id is above every committed id (next_checkpoint_id).
    from_id = max(committed, default=0) + 1
    try:
        since = min(datetime.fromisoformat(w.created_at).timestamp() for w in writers) \
            - WRITER_SKEW_SECONDS
    except ValueError:
        since = float("-inf")  # unknown start: protect every orphan
    return LeaseGuard(held, from_id, since)


def plan_gc(registry: Registry, *, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> GcPlan:
    """Classify every listed file under shared/ and chk-*/ (see the module docstring)."""
    grace_seconds = float(number(grace_seconds, "--grace-seconds", maximum=MAX_GRACE_SECONDS))
    registry.require_intact("gc")
    now = registry.now.timestamp()
    guard = lease_guard(registry.live_leases, registry.checkpoints)
    deletions: list[GcFile] = []
    pending: list[GcFile] = []
    referenced: list[str] = []
    records: list[str] = []
    record_bytes = 0
    referenced_set = registry.referenced
    checkpoints = registry.checkpoints
    files = registry.files  # sizes and mtimes read only for what is not referenced
    for path in files:  # in path order (a Listing)
        if path in referenced_set:
            referenced.append(path)
            continue
        if not path.startswith(GC_SCOPE_PREFIXES):
            continue
        cid = chk_id_of(path)
        if cid is None and not in_gc_scope(path):
            continue
        info = files.get(path)
        if info is None:
            continue  # deleted since the listing: nothing to collect
        if cid in checkpoints and is_commit_record(path):
            records.append(path)
            record_bytes += info.size
            continue
        age = None if info.mtime is None else now - info.mtime
        reason = guard.reason(path, info.mtime)
        if reason is not None:
            pass
        elif age is None:
            reason = KEEP_NO_MTIME
        elif age < grace_seconds:
            reason = KEEP_PENDING
        elif cid is None:
            reason = DEL_SHARED
        elif cid in checkpoints:
            reason = DEL_UNREFERENCED
        else:
            reason = DEL_UNCOMMITTED
        target = pending if reason in ORPHAN_KEEP_REASONS else deletions
        target.append(GcFile(path, info.size, age, reason, info.mtime))
    # recorded sizes of the referenced files (listed ones would cost a stat each)
    refs = registry.refs
    unlisted = referenced_set - files.names  # (rare: missing files)
    referenced_bytes = refs.bytes_at(refs.everything) - refs.bytes_at(
        map(refs.position.__getitem__, unlisted))
    return GcPlan(registry.job, float(grace_seconds), tuple(deletions), tuple(pending),
                  tuple(referenced), tuple(records), referenced_bytes, record_bytes,
                  records_to_recheck(registry, deletions))


def records_to_recheck(registry: Registry, deletions: Sequence[GcFile]) -> tuple[int, ...]:
    """The indexed checkpoints whose real records could list a planned deletion
    (scenario 11): those a signed index does not vouch for, written after the oldest
    deletion's file or of unknown age."""
    if not deletions or not registry.indexed_ids:
        return ()
    mtimes = [f.mtime for f in deletions]
    oldest = None if None in mtimes else min(m for m in mtimes if m is not None)
    return registry.ids_to_recheck(None if oldest is None else oldest - RECORD_SKEW_SECONDS)


def execute_gc(store: CheckpointStore, plan: GcPlan, known_ids: set[int] | None = None, *,
               now: datetime | float | None = None,
               progress: ProgressSink = NO_PROGRESS) -> GcReport:
    """Delete the planned files (best effort, batched), sparing late commits (scenario 3)
    and what leases taken since planning protect (scenario 10); ``progress`` counts the
    files deleted of those planned."""
    started = time.perf_counter()
    spare: set[str] = set()
    committed = set(store.checkpoint_ids(known=known_ids or ()))
    if known_ids is not None:
        for cid in committed - known_ids:
            try:
                spare.update(f.path for f in store.load(cid).files)
            except CheckpointNotFoundError:
                continue
    if plan.deletions and plan.indexed_ids:  # scenario 11: the real records decide
        spare |= referenced_by_records(store, plan.indexed_ids,
                                       {f.path for f in plan.deletions})
    guard = lease_guard(live_leases(store.storage, as_datetime(now)), committed)
    spare.update(f.path for f in plan.deletions if guard.reason(f.path, f.mtime) is not None)
    todo = [f for f in plan.deletions if f.path not in spare]
    failures = delete_counted(store.storage, [f.path for f in todo], progress,
                              f"deleting orphans of job {store.job}")
    failed = {p for p, _ in failures}
    deleted = tuple(f for f in todo if f.path not in failed)
    prune_empty_dirs(store.storage, [f.path for f in deleted])
    spared = tuple(sorted(f.path for f in plan.deletions if f.path in spare))
    return GcReport(plan, False, deleted, tuple(failures), spared,
                    time.perf_counter() - started)


def collect_garbage(store: CheckpointStore, *, grace_seconds: float = DEFAULT_GRACE_SECONDS,
                    dry_run: bool = False, now: datetime | float | None = None,
                    progress: ProgressSink = NO_PROGRESS) -> GcReport:
    """Plan GC over a fresh registry; execute it unless ``dry_run``."""
    started = time.perf_counter()
    progress.phase(f"planning gc of job {store.job}")
    registry = build_registry(store, now=now, update_index=not dry_run)
    plan = plan_gc(registry, grace_seconds=grace_seconds)
    if dry_run:
        return GcReport(plan, True, seconds=time.perf_counter() - started)
    report = execute_gc(store, plan, known_ids=set(registry.checkpoints), now=registry.now,
                        progress=progress)
    return replace(report, seconds=time.perf_counter() - started)


def summarize_text(report: GcReport) -> list[str]:
    """Human lines for the CLI (lists capped)."""
    plan = report.plan
    files = report.files
    pending = plan.pending
    lines = [
        f"gc job {report.job} (grace {plan.grace_seconds:g} s): {report.verb} {len(files)} "
        f"files, {sum(f.size for f in files)} bytes; kept {plan.files_kept} files; "
        f"{len(pending)} orphans pending ({sum(f.size for f in pending)} bytes)",
    ]
    for reason, slot in sorted(plan.by_reason().items()):
        lines.append(f"  {slot['action']:6} {reason:22} {slot['files']:>7} files "
                     f"{slot['bytes']:>14} bytes")
    return lines + report.file_lines()
