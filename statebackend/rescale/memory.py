"""Rescale of a memory-backend checkpoint: whole key-group files change hands.

The memory backend stores one immutable file per key group (`statebackend.state.memory`),
so a new subtask's state is exactly the files of its key groups: its handle names them,
and nothing is downloaded, clipped or uploaded. The new checkpoint references the
source's files like an incremental checkpoint does; GC keeps them while referenced.

Row counts: each key-group file's reference records the entries of each state it holds
(`FileRef.rows`), so a new subtask's counts are their sums. A file referenced without
them (written before they were recorded) leaves the subtask's counts unrecorded until
its next run; an external checkpoint's rows are in the database (counted by its next
run too).
"""

from __future__ import annotations

import uuid

from statebackend.checkpoint.metadata import CheckpointMetadata, FileRef, SubtaskHandle
from statebackend.rescale.plan import RescalePlan
from statebackend.rescale.task import RescaleTaskResult
from statebackend.state.external_wal import is_wal_file
from statebackend.state.memory import key_group_of_file


def regrouped(meta: CheckpointMetadata, plan: RescalePlan) -> list[RescaleTaskResult]:
    """Each new subtask of ``plan`` as a handle over the source's key-group files (and,
    for an external checkpoint in WAL mode, the WAL files of the source subtasks its
    range overlaps: until the database holds the epoch they are what commits it)."""
    by_key_group: dict[int, FileRef] = {
        key_group_of_file(f.local_name): f for h in meta.subtasks for f in h.files
        if not is_wal_file(f.local_name)}
    wals = [(h.key_group_range, f) for h in meta.subtasks for f in h.files
            if is_wal_file(f.local_name)]
    # rows are known when every key-group file records its own (module docstring)
    counted = meta.state_backend == "memory" and all(f.rows for f in by_key_group.values())
    results = []
    for s in plan.subtasks:
        # a WAL reached through two source subtasks (an earlier rescale split it) once
        carried = {f.path: f for r, f in wals if len(r.intersect(s.key_groups))}
        files = tuple(sorted(
            [*(f for kg, f in by_key_group.items() if kg in s.key_groups),
             *carried.values()], key=lambda f: f.local_name))
        handle = SubtaskHandle(
            index=s.index, key_group_start=s.key_groups.start,
            key_group_end=s.key_groups.end, backend_id=uuid.uuid4().hex,
            snapshot_id=uuid.uuid4().hex, shared_files=files, private_files=(),
            row_counts=_row_counts(meta, files) if counted else {},
            backend=meta.state_backend)
        results.append(RescaleTaskResult(
            index=s.index, attempt=0, handle=handle, uploaded_paths=(), bytes_downloaded=0,
            files_reused=len(files), entries_imported=0, clipped_share=0.0, compacted=False,
            rows=sum(handle.row_counts.values()), timings={}))
    return results


def _row_counts(meta: CheckpointMetadata, files: tuple[FileRef, ...]) -> dict[str, int]:
    """The entries of each state in key-group ``files``; every state the source counted
    is named (0 too)."""
    counts = dict.fromkeys((n for h in meta.subtasks for n in h.row_counts), 0)
    for f in files:
        for name, n in f.rows:
            counts[name] = counts.get(name, 0) + n
    return counts


def describe(plan: RescalePlan) -> list[str]:
    """``--dry-run`` lines of a memory-backend rescale."""
    lines = [f"rescale plan: job {plan.job} checkpoint {plan.source_checkpoint_id} from "
             f"parallelism {plan.from_parallelism} to {plan.to_parallelism} (memory "
             "backend: each new subtask names the key-group files of its range; external "
             "backend: its range is a query at the same version; 0 bytes to download or "
             "upload)"]
    lines += [f"  new subtask {s.index}: key groups [{s.key_groups.start}, "
              f"{s.key_groups.end}]" for s in plan.subtasks]
    return lines
