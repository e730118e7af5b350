"""Rescale of a memory-backend checkpoint: whole files change hands.

Each reference to a memory-backend file names the key groups the subtask reads from it
(`statebackend.state.memory`: segments, or a key-group file's own key group), so a new
subtask's state is exactly the files serving its key groups: its handle names them,
each with the key groups in its range only, and nothing is downloaded, clipped or
uploaded. A segment that served two old subtasks is one reference of a new subtask
that takes both parts; one that straddles a new boundary is referenced by both new
subtasks. The new checkpoint references the source's files like an incremental
checkpoint does; GC keeps them while referenced.

Row counts: each reference records the entries of each state per key group it serves
(`FileRef.key_groups`; a key-group file: `FileRef.rows`), so a new subtask's counts
are their sums. A file referenced without them (written before they were recorded)
leaves the subtask's counts unrecorded until its next run; an external checkpoint's
rows are in the database (counted by its next run too).
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from statebackend.checkpoint.metadata import CheckpointMetadata, FileRef, SubtaskHandle
from statebackend.rescale.plan import RescalePlan
from statebackend.rescale.task import RescaleTaskResult
from statebackend.state.external_wal import is_wal_file
from statebackend.state.memory import Rows, served_key_groups


def regrouped(meta: CheckpointMetadata, plan: RescalePlan) -> list[RescaleTaskResult]:
    """Each new subtask of ``plan`` as a handle over the source's files (and, for an
    external checkpoint in WAL mode, the WAL files of the source subtasks its range
    overlaps: until the database holds the epoch they are what commits it)."""
    served = _served(meta)
    refs = {f.path: f for h in meta.subtasks for f in h.files}
    wals = [(h.key_group_range, f) for h in meta.subtasks for f in h.files
            if is_wal_file(f.local_name)]
    # rows are known when every file records its own (module docstring)
    counted = meta.state_backend == "memory" and all(
        rows is not None for kgs in served.values() for rows in kgs.values())
    results = []
    for s in plan.subtasks:
        # a WAL reached through two source subtasks (an earlier rescale split it) once
        carried = {f.path: f for r, f in wals if len(r.intersect(s.key_groups))}
        files = []
        for path, kgs in served.items():
            mine = {kg: rows for kg, rows in kgs.items() if kg in s.key_groups}
            if mine:
                files.append(_narrowed(refs[path], mine))
        files = sorted([*files, *carried.values()], key=lambda f: f.local_name)
        handle = SubtaskHandle(
            index=s.index, key_group_start=s.key_groups.start,
            key_group_end=s.key_groups.end, backend_id=uuid.uuid4().hex,
            snapshot_id=uuid.uuid4().hex, shared_files=tuple(files), private_files=(),
            row_counts=_row_counts(meta, files) if counted else {},
            backend=meta.state_backend)
        results.append(RescaleTaskResult(
            index=s.index, attempt=0, handle=handle, uploaded_paths=(), bytes_downloaded=0,
            files_reused=len(files), entries_imported=0, clipped_share=0.0, compacted=False,
            rows=meta.subtask_rows(handle), timings={}))
    return results


def _served(meta: CheckpointMetadata) -> dict[str, dict[int, Rows | None]]:
    """path -> {key group: its entries per state (None: not recorded)} of every
    memory-backend file the source's subtasks read (a segment split by an earlier
    rescale: the union of its parts)."""
    out: dict[str, dict[int, Rows | None]] = {}
    for h in meta.subtasks:
        for f in h.files:
            if is_wal_file(f.local_name):
                continue
            kgs = out.setdefault(f.path, {})
            if f.key_groups:
                kgs.update(f.key_groups)
            else:  # a key-group file named before key groups: its own, its rows if any
                (kg,) = served_key_groups(f.local_name)
                kgs[kg] = f.rows or None
    return out


def _narrowed(ref: FileRef, key_groups: dict[int, Rows | None]) -> FileRef:
    """``ref`` serving ``key_groups`` only (a reference without key groups serves one)."""
    if not ref.key_groups:
        return ref
    return replace(ref, key_groups=tuple(sorted(
        (kg, rows) for kg, rows in key_groups.items() if rows is not None)))


def _row_counts(meta: CheckpointMetadata, files: list[FileRef]) -> dict[str, int]:
    """The entries of each state in ``files``; every state the source counted is
    named (0 too)."""
    counts = dict.fromkeys((n for h in meta.subtasks for n in h.row_counts), 0)
    for f in files:
        for name, n in f.rows:
            counts[name] = counts.get(name, 0) + n
    return counts


# What a rescale of each backend `regrouped` serves does, for ``--dry-run``
_HOW = {"memory": "each new subtask names the files serving its key groups",
        "external": "each new subtask's range is a query at the same database version"}


def describe(plan: RescalePlan, backend: str) -> list[str]:
    """``--dry-run`` lines of a memory- or external-backend rescale."""
    lines = [f"rescale plan: job {plan.job} checkpoint {plan.source_checkpoint_id} from "
             f"parallelism {plan.from_parallelism} to {plan.to_parallelism} ({backend} "
             f"backend: {_HOW[backend]}; 0 bytes to download or upload)"]
    lines += [f"  new subtask {s.index}: key groups [{s.key_groups.start}, "
              f"{s.key_groups.end}]" for s in plan.subtasks]
    return lines
