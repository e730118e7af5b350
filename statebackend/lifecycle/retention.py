"""Retention: keep the newest N committed checkpoints, retire the rest.

Kept, always:
- the newest ``keep`` committed checkpoints (by id; ``keep`` >= 1, so the
  checkpoint a running writer builds on is never retired);
- every savepoint (they live outside ``chk-*`` and are never touched here);
- every checkpoint named by a *live* lease (an expired lease protects nothing);
- the newest *restorable* checkpoint and every newer one (issue 10, defect 2):
  a checkpoint is retired only if a newer retained one restores. Restorable =
  every file it references is listed with its recorded size (the manifest
  checks) and its latest validation report (``reports/chk-<id>/summary.json``)
  does not say ``"success": false``. Normally the newest checkpoint is
  restorable and this keeps nothing extra; when the newest ones miss files,
  retention keeps older ones down to the newest restorable one
  (``keep-last-restorable``), and when none restores it retires nothing.

Retiring checkpoint C, in this order:
0. write the ledger record of C's run (``runs/<run>.json``, runs.py), so the run
   stays committed for idempotency once C is gone, and C's retired marker in the
   commit log (``runs/chain/<C>.retired``, checkpoint/lineage.py), so a missing
   record of C reads as retired, not lost; if either write fails, C is kept;
1. delete ``chk-<C>/_metadata``: C stops existing atomically, so no reader can
   start from a checkpoint whose files are going away;
2. delete the files C lists that no kept checkpoint, savepoint or live lease
   references: its private files and the shared files only retired checkpoints
   referenced (Flink's shared-state registry: a file dies with its last
   reference). This is what reclaims SSTs replaced by RocksDB compaction.

Run history (``runs/history/``, runs.py): the files beyond the newest
`HISTORY_KEPT` are planned for deletion too (reason ``old-run-history``), so a run
only ever writes its outcome and never lists the history.

A file referenced by anything kept is never deleted, whatever folder it is in.
Files in ``chk-<C>/`` that C does not list (uploads of a failed attempt with the
same id) are orphans: GC removes them after the grace period (gc.py).

`plan_retention` is pure (registry in, frozen plan out, each checkpoint and
file with a reason); it refuses a lineage that forked or lost a commit record
(LineageError: `Registry.require_intact`), since a lost record's files would look
unreferenced. `execute_retention` is best effort and re-reads the
committed ids and leases just before deleting: a checkpoint held by a lease
taken since planning is spared, and files referenced by a checkpoint committed
since planning are spared. A plan made from the registry index (registry.py)
is re-checked against the real records: a file is deleted only if the real
`_metadata` of a retired checkpoint lists it and no kept checkpoint's real
`_metadata` does, so a tampered index never deletes anything. A metadata
deletion that fails leaves that checkpoint's files alone. `retain` = registry +
plan + execute (or dry run); its result is a `RetentionReport`, the `DeletionReport`
gc returns too (deletion.py, with the delete helpers both use).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, ClassVar

from statebackend.checkpoint.layout import (
    CHK_PREFIX,
    chk_id_of,
    metadata_path,
    report_dir,
    report_summary_path,
)
from statebackend.checkpoint.leases import live_leases
from statebackend.checkpoint.lineage import mark_retired
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.runs import HISTORY_KEPT, history_beyond
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CheckpointNotFoundError, CkptError, UsageError
from statebackend.lifecycle.deletion import DeletionReport, delete_counted, prune_empty_dirs
from statebackend.lifecycle.registry import (
    Registry,
    as_datetime,
    build_registry,
    checkpoint_label,
    referenced_by_records,
)
from statebackend.progress import NO_PROGRESS, ProgressSink

log = logging.getLogger(__name__)

# reasons (stable strings: they appear in JSON reports)
KEEP_NEWEST = "newest"
KEEP_LEASED = "leased"
KEEP_LAST_RESTORABLE = "keep-last-restorable"     # the newest checkpoint that restores
KEEP_ABOVE_RESTORABLE = "keep-above-restorable"   # newer, but does not restore
KEEP_NONE_RESTORABLE = "keep-none-restorable"     # nothing restores: retire nothing
RETIRE_BEYOND_KEEP = "beyond-keep"
DEL_METADATA = "retired-metadata"
DEL_PRIVATE = "retired-private"
DEL_RELEASED_SHARED = "released-shared"
DEL_OLD_HISTORY = "old-run-history"


@dataclass(frozen=True)
class CheckpointDecision:
    checkpoint_id: int
    action: str          # "keep" | "retire"
    reason: str          # newest | leased | keep-*-restorable | beyond-keep
    leases: tuple[str, ...] = ()
    restorable: bool | None = None  # None: not checked (only the newest few are)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.checkpoint_id, "action": self.action, "reason": self.reason,
                "leases": list(self.leases), "restorable": self.restorable}


@dataclass(frozen=True, slots=True)  # slots: one per deleted file, 90,000 at a time
class FileAction:
    path: str
    size: int
    reason: str
    checkpoint_id: int | None = None  # the retired checkpoint it belongs to, if any

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "reason": self.reason,
                "checkpoint": self.checkpoint_id}


@dataclass(frozen=True)
class RetentionPlan:
    operation: ClassVar[str] = "retain"
    job: str
    keep: int
    decisions: tuple[CheckpointDecision, ...]
    deletions: tuple[FileAction, ...]   # metadata first, then files
    savepoints: tuple[str, ...]
    bytes_kept: int
    indexed_ids: tuple[int, ...] = ()   # planned from the index, not vouched for: re-checked

    @property
    def retained(self) -> tuple[int, ...]:
        return tuple(d.checkpoint_id for d in self.decisions if d.action == "keep")

    @property
    def retired(self) -> tuple[int, ...]:
        return tuple(d.checkpoint_id for d in self.decisions if d.action == "retire")

    @property
    def bytes_to_delete(self) -> int:
        return sum(a.size for a in self.deletions)

    def report_fields(self, done: Sequence[FileAction] | None) -> dict[str, Any]:
        """retain's keys of its `DeletionReport` (``done``: deleted files; None: dry run)."""
        return {
            "keep": self.keep, "retained": list(self.retained), "retired": list(self.retired),
            "savepoints": list(self.savepoints),
            "checkpoints": [d.to_json() for d in self.decisions],
            "bytes_kept": self.bytes_kept,
            "by_reason": _by_reason(self.deletions if done is None else done),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job, "keep": self.keep,
            "retained": list(self.retained), "retired": list(self.retired),
            "savepoints": list(self.savepoints),
            "checkpoints": [d.to_json() for d in self.decisions],
            "files_to_delete": len(self.deletions), "bytes_to_delete": self.bytes_to_delete,
            "bytes_kept": self.bytes_kept,
            "by_reason": _by_reason(self.deletions),
            "deletions": [a.to_json() for a in self.deletions],
        }


RetentionReport = DeletionReport[RetentionPlan, FileAction]


def plan_retention(registry: Registry, keep: int,
                   damaged: Iterable[int] = (), history_kept: int = HISTORY_KEPT
                   ) -> RetentionPlan:
    """Decide, per committed checkpoint and per file, what retention keeps and deletes.

    ``damaged``: ids whose latest validation report failed (read by `retain`);
    ``history_kept``: how many run-history files stay (runs.py).
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise UsageError(f"--keep {keep!r} is invalid: keep at least 1 checkpoint (the newest "
                         "is the base of the next run)")
    registry.require_intact("retention")
    ids = sorted(registry.checkpoints)
    newest = set(ids[-keep:])
    held = registry.held_ids()
    checked = _restorability(registry, ids, frozenset(damaged))
    last_ok = max((cid for cid, ok in checked.items() if ok), default=None)
    decisions = []
    for cid in ids:
        ok = checked.get(cid)
        if cid in newest:
            decisions.append(CheckpointDecision(cid, "keep", KEEP_NEWEST, held.get(cid, ()), ok))
        elif cid in held:
            decisions.append(CheckpointDecision(cid, "keep", KEEP_LEASED, held[cid], ok))
        elif last_ok is None:
            decisions.append(CheckpointDecision(cid, "keep", KEEP_NONE_RESTORABLE, (), ok))
        elif cid == last_ok:
            decisions.append(CheckpointDecision(cid, "keep", KEEP_LAST_RESTORABLE, (), ok))
        elif cid > last_ok:
            decisions.append(CheckpointDecision(cid, "keep", KEEP_ABOVE_RESTORABLE, (), ok))
        else:
            decisions.append(CheckpointDecision(cid, "retire", RETIRE_BEYOND_KEEP, (), ok))
    retired = [d.checkpoint_id for d in decisions if d.action == "retire"]
    # set algebra on positions into the registry's path table (registry.References)
    refs = registry.refs
    retired_labels = {checkpoint_label(c) for c in retired}
    kept = refs.union(label for label in refs.owners if label not in retired_labels)
    released = refs.everything - kept  # what retired ones list and no kept one does
    table, sizes = refs.paths, refs.sizes
    metadata_actions = [FileAction(rel, registry.size_of(rel), DEL_METADATA, cid)
                        for cid in retired for rel in (metadata_path(cid),)]
    # a private file lives in some chk-<id>/ folder; shared ones (most) skip the parse;
    # sizes are the recorded ones (listed sizes would cost a stat per file on file://)
    file_actions = [
        FileAction(path, sizes[i], DEL_RELEASED_SHARED if folder is None else DEL_PRIVATE,
                   folder)
        for i in sorted(released, key=table.__getitem__)
        for path in (table[i],)
        for folder in (chk_id_of(path) if path.startswith(CHK_PREFIX) else None,)]
    listed = registry.files
    history_actions = [FileAction(path, info.size, DEL_OLD_HISTORY)
                       for path in history_beyond(listed.paths, history_kept)
                       if (info := listed.get(path)) is not None]
    return RetentionPlan(
        job=registry.job, keep=keep, decisions=tuple(decisions),
        deletions=tuple(metadata_actions + file_actions + history_actions),
        savepoints=tuple(sorted(registry.savepoints)), bytes_kept=refs.bytes_at(kept),
        indexed_ids=registry.ids_to_recheck())


def _restorability(registry: Registry, ids: list[int],
                   damaged: frozenset[int]) -> dict[int, bool]:
    """Restorable or not, newest first, down to the first restorable one (usually just
    the newest: cheap over 10,000 checkpoints)."""
    out: dict[int, bool] = {}
    for cid in reversed(ids):
        out[cid] = cid not in damaged and not missing_or_resized(registry, cid)
        if out[cid]:
            break
    return out


def missing_or_resized(registry: Registry, checkpoint_id: int) -> list[str]:
    """Paths checkpoint ``checkpoint_id`` references that the listing lacks or sizes
    differently from its record (pure: the manifest checks over the registry)."""
    files = registry.files
    bad = []
    for ref in registry.checkpoints[checkpoint_id].files:
        info = files.get(ref.path)
        if info is None or info.size != ref.size:
            bad.append(ref.path)
    return bad


def read_damaged(store: CheckpointStore, registry: Registry) -> set[int]:
    """Ids whose validation summary says ``"success": false`` (or cannot be read: a report
    that cannot be trusted must not vouch for a checkpoint). Reads newest first, and only
    what the plan looks at: it stops at the first checkpoint with every file listed and
    no failed report."""
    out: set[int] = set()
    for cid in sorted(registry.checkpoints, reverse=True):
        if missing_or_resized(registry, cid):
            continue
        rel = report_summary_path(cid)
        data = store.storage.read_bytes_if_exists(rel) if rel in registry.files else None
        if data is None:
            return out  # never validated (or retired meanwhile): nothing says it is damaged
        try:
            success = json.loads(data).get("success", True)
        except (ValueError, AttributeError):
            success = False
        if success is True:
            return out
        out.add(cid)
    return out


def execute_retention(store: CheckpointStore, plan: RetentionPlan, *,
                      now: datetime | float | None = None,
                      progress: ProgressSink = NO_PROGRESS) -> RetentionReport:
    """Best effort: metadata of retired checkpoints first, then their files (``progress``
    counts both deletions)."""
    started = time.perf_counter()
    storage = store.storage
    spare_ids, spare_paths = _recheck(store, plan, now)
    meta_actions = [a for a in plan.deletions if a.reason == DEL_METADATA
                    and a.checkpoint_id not in spare_ids]
    # A retired commit record no longer names its run: the ledger must, first (runs.py).
    records, unrecorded = _record_runs(store, [_retired_id(a) for a in meta_actions])
    spare_ids |= unrecorded
    # Delete only what the real records release (the plan may come from the index).
    listed_by_retired = {f.path for m in records.values() for f in m.files}
    kept_indexed = set(plan.indexed_ids) - {a.checkpoint_id for a in meta_actions}
    if kept_indexed:
        spare_paths |= referenced_by_records(store, kept_indexed,
                                             {a.path for a in plan.deletions})
    meta_actions = [a for a in meta_actions if a.checkpoint_id not in unrecorded]
    failures = delete_counted(storage, [a.path for a in meta_actions], progress,
                              f"retiring checkpoints of job {store.job}: commit records")
    failed = {p for p, _ in failures}
    for cid in unrecorded:  # still committed: everything it lists stays
        meta = _load_or_none(store, cid)
        if meta is not None:
            spare_paths.update(f.path for f in meta.files)
    # a checkpoint whose _metadata could not be deleted still exists: keep all it lists
    for a in meta_actions:
        if a.path in failed:
            meta = _load_or_none(store, _retired_id(a))
            if meta is not None:
                spare_paths.update(f.path for f in meta.files)
    # run history is referenced by nothing: planned files go as planned
    file_actions = [a for a in plan.deletions if a.reason == DEL_OLD_HISTORY] + [
                    a for a in plan.deletions if a.reason not in (DEL_METADATA, DEL_OLD_HISTORY)
                    and a.path not in spare_paths and a.path in listed_by_retired
                    and not (a.reason == DEL_PRIVATE and a.checkpoint_id in spare_ids)]
    file_failures = delete_counted(storage, [a.path for a in file_actions], progress,
                                   f"retiring checkpoints of job {store.job}: files")
    failures += file_failures
    failed |= {p for p, _ in file_failures}
    deleted = tuple(a for a in meta_actions + file_actions if a.path not in failed)
    # A retired checkpoint's validation report describes state that no longer exists.
    for a in meta_actions:
        if a.path not in failed:
            try:
                storage.delete_tree(report_dir(_retired_id(a)))
            except CkptError as exc:  # e.g. a symlinked reports/ folder: reported, kept
                failures.append((report_dir(_retired_id(a)), str(exc)))
    prune_empty_dirs(storage, [a.path for a in deleted])
    spared = tuple(sorted({a.path for a in plan.deletions} - {a.path for a in deleted}
                          - failed))
    return RetentionReport(plan, False, deleted, tuple(failures), spared,
                           time.perf_counter() - started)


def retain(store: CheckpointStore, keep: int, *, dry_run: bool = False,
           now: datetime | float | None = None,
           progress: ProgressSink = NO_PROGRESS) -> RetentionReport:
    """Plan retention over a fresh registry; execute it unless ``dry_run``."""
    started = time.perf_counter()
    progress.phase(f"planning retention of job {store.job}")
    registry = build_registry(store, now=now, update_index=not dry_run)
    plan = plan_retention(registry, keep, damaged=read_damaged(store, registry))
    if dry_run:
        return RetentionReport(plan, True, seconds=time.perf_counter() - started)
    report = execute_retention(store, plan, now=now, progress=progress)
    return replace(report, seconds=time.perf_counter() - started)


# -- helpers ------------------------------------------------------------------
def _recheck(store: CheckpointStore, plan: RetentionPlan,
             now: datetime | float | None) -> tuple[set[int], set[str]]:
    """Ids held by leases taken since planning; paths of checkpoints committed since."""
    when = as_datetime(now)
    held = {cid for lease in live_leases(store.storage, when)
            for cid in lease.checkpoint_ids}
    spare_ids = held & set(plan.retired)
    known = {d.checkpoint_id for d in plan.decisions}
    spare_paths: set[str] = set()
    for cid in set(store.checkpoint_ids(known=known)) - known:
        meta = _load_or_none(store, cid)
        if meta is not None:
            spare_paths.update(f.path for f in meta.files)
    # files of spared checkpoints stay, including shared ones the plan released
    for cid in spare_ids:
        meta = _load_or_none(store, cid)
        if meta is not None:
            spare_paths.update(f.path for f in meta.files)
    return spare_ids, spare_paths


def _record_runs(store: CheckpointStore, checkpoint_ids: list[int]
                 ) -> tuple[dict[int, CheckpointMetadata], set[int]]:
    """Write the ledger record of each checkpoint's run; the records read (strictly)
    whose run is recorded, and the ids whose write failed."""
    failed = set()
    records = {}
    for cid in checkpoint_ids:
        meta = _load_or_none(store, cid)
        try:
            if meta is not None:
                store.record_run(meta)
                mark_retired(store.storage, [cid])
                records[cid] = meta
        except CkptError as exc:
            log.warning("checkpoint %s kept: its run could not be recorded (%s)", cid, exc)
            failed.add(cid)
    return records, failed


def _retired_id(action: FileAction) -> int:
    """The checkpoint a ``retired-metadata`` deletion retires (`plan_retention` names it)."""
    if action.checkpoint_id is None:
        raise UsageError(f"retention plan deletes {action.path} without naming its checkpoint")
    return action.checkpoint_id


def _load_or_none(store: CheckpointStore, cid: int) -> CheckpointMetadata | None:
    try:
        return store.load(cid)
    except CheckpointNotFoundError:
        return None


def _by_reason(actions: Iterable[FileAction]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for a in actions:
        slot = out.setdefault(a.reason, {"files": 0, "bytes": 0})
        slot["files"] += 1
        slot["bytes"] += a.size
    return out


_SAFETY_NOTES = {
    KEEP_LAST_RESTORABLE: "the newest checkpoint that restores (newer ones miss files or "
                          "failed validation)",
    KEEP_ABOVE_RESTORABLE: "does not restore, kept with the newest that does",
    KEEP_NONE_RESTORABLE: "no checkpoint restores (missing files or failed validation): "
                          "nothing is retired; run `ckpt validate` and inspect",
}


def summarize_text(report: RetentionReport) -> list[str]:
    """Human lines for the CLI (lists capped)."""
    plan = report.plan
    files = report.files
    lines = [
        f"retain job {report.job}: keep newest {plan.keep}; retained {list(plan.retained)}; "
        f"retired {list(plan.retired)}; savepoints {len(plan.savepoints)}",
        f"{report.verb} {len(files)} files, {sum(a.size for a in files)} bytes; "
        f"{plan.bytes_kept} bytes still referenced",
    ]
    for d in plan.decisions:
        if d.reason == KEEP_LEASED:
            lines.append(f"  keep chk-{d.checkpoint_id}: held by lease {', '.join(d.leases)}")
        elif d.reason in _SAFETY_NOTES:
            lines.append(f"  keep chk-{d.checkpoint_id}: {_SAFETY_NOTES[d.reason]}")
    return lines + report.file_lines()
