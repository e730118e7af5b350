"""The rescale plan (pure): which old subtasks each new subtask restores, clips, imports
and downloads.

New subtask j of Q owns key groups R_j (Flink's range formula). Every old handle whose
range meets R_j contributes: the *base*, the old handle with the largest key-group
overlap (ties: the larger handle, then the lower index), restored and clipped to its
own part of R_j; and every other overlapping handle as an *import* of its part of R_j
(statebackend.rescale.task builds it; statebackend.rescale.executor runs the tasks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskHandle
from statebackend.errors import MetadataError, UsageError
from statebackend.state.keygroups import (
    KeyGroupRange,
    check_parallelism,
    key_group_range_for_subtask,
)


class NothingToRescaleError(UsageError):
    """The requested parallelism equals the checkpoint's: a rescale would be a no-op."""


@dataclass(frozen=True)
class PlannedFile:
    """One file a new subtask downloads, and why."""

    source: int  # old subtask index
    path: str
    local_name: str
    size: int
    reason: str

    def to_json(self) -> dict:
        return {"source": self.source, "path": self.path, "local_name": self.local_name,
                "size": self.size, "reason": self.reason}


@dataclass(frozen=True)
class ImportRange:
    """Key groups of one non-base old handle that a new subtask exports and ingests."""

    source: int
    key_groups: KeyGroupRange

    def to_json(self) -> dict:
        return {"source": self.source, "key_group_start": self.key_groups.start,
                "key_group_end": self.key_groups.end}


@dataclass(frozen=True)
class SubtaskPlan:
    index: int
    key_groups: KeyGroupRange
    base: int  # old subtask index restored and clipped
    base_overlap: KeyGroupRange
    imports: tuple[ImportRange, ...]
    downloads: tuple[PlannedFile, ...]

    @property
    def sources(self) -> tuple[int, ...]:
        return (self.base,) + tuple(i.source for i in self.imports)

    @property
    def bytes_to_download(self) -> int:
        return sum(f.size for f in self.downloads)

    @property
    def bytes_to_import(self) -> int:
        """The downloads of the imports (the old handles exported key by key)."""
        return sum(f.size for f in self.downloads if f.source != self.base)

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "key_group_start": self.key_groups.start,
            "key_group_end": self.key_groups.end,
            "base": self.base,
            "base_overlap": [self.base_overlap.start, self.base_overlap.end],
            "imports": [i.to_json() for i in self.imports],
            "bytes_to_download": self.bytes_to_download,
            "downloads": [f.to_json() for f in self.downloads],
        }


@dataclass(frozen=True)
class RescalePlan:
    """What each new subtask restores, clips, imports and downloads."""

    job: str
    source_checkpoint_id: int
    from_parallelism: int
    to_parallelism: int
    max_parallelism: int
    subtasks: tuple[SubtaskPlan, ...]

    @property
    def bytes_to_download(self) -> int:
        return sum(s.bytes_to_download for s in self.subtasks)

    @property
    def bytes_to_import(self) -> int:
        return sum(s.bytes_to_import for s in self.subtasks)

    def to_json(self) -> dict:
        return {
            "job": self.job,
            "source_checkpoint_id": self.source_checkpoint_id,
            "from_parallelism": self.from_parallelism,
            "to_parallelism": self.to_parallelism,
            "max_parallelism": self.max_parallelism,
            "bytes_to_download": self.bytes_to_download,
            "subtasks": [s.to_json() for s in self.subtasks],
        }

    def describe(self) -> list[str]:
        """Human lines for ``--dry-run``."""
        lines = [f"rescale plan: job {self.job} checkpoint {self.source_checkpoint_id} "
                 f"from parallelism {self.from_parallelism} to {self.to_parallelism} "
                 f"(max parallelism {self.max_parallelism}); "
                 f"{self.bytes_to_download} bytes to download in total"]
        for s in self.subtasks:
            r, o = s.key_groups, s.base_overlap
            lines.append(f"  new subtask {s.index}: key groups [{r.start}, {r.end}]; base old "
                         f"subtask {s.base} (keeps [{o.start}, {o.end}], clip the rest)")
            for imp in s.imports:
                k = imp.key_groups
                lines.append(f"    import key groups [{k.start}, {k.end}] from old subtask "
                             f"{imp.source} (SST export + ingest)")
            lines.append(f"    download {len(s.downloads)} files, {s.bytes_to_download} bytes")
        return lines


def plan_rescale(meta: CheckpointMetadata, new_parallelism: int) -> RescalePlan:
    """Pure: which old handles each of ``new_parallelism`` subtasks needs, and why."""
    if isinstance(new_parallelism, bool) or not isinstance(new_parallelism, int):
        raise UsageError(f"parallelism {new_parallelism!r} is not an integer")
    m, p = meta.max_parallelism, meta.parallelism
    check_parallelism(new_parallelism, m)
    if new_parallelism == p:
        raise NothingToRescaleError(
            f"checkpoint {meta.checkpoint_id} of job {meta.job!r} is already at parallelism "
            f"{p}: nothing to do")
    old = sorted(meta.subtasks, key=lambda h: h.index)
    _check_tiling(meta, old)
    plans = []
    for j in range(new_parallelism):
        target = key_group_range_for_subtask(m, new_parallelism, j)
        overlapping = [(h, target.intersect(h.key_group_range)) for h in old]
        overlapping = [(h, r) for h, r in overlapping if len(r) > 0]
        base, base_overlap = max(overlapping, key=lambda hr: (len(hr[1]), hr[0].size,
                                                               -hr[0].index))
        imports = tuple(ImportRange(h.index, r) for h, r in overlapping if h is not base)
        downloads = [PlannedFile(base.index, f.path, f.local_name, f.size,
                                 f"base: restore old subtask {base.index}, clip to "
                                 f"[{target.start}, {target.end}]") for f in base.files]
        for imp in imports:
            h = old[imp.source]
            k = imp.key_groups
            downloads += [PlannedFile(h.index, f.path, f.local_name, f.size,
                                      f"import: export key groups [{k.start}, {k.end}] of old "
                                      f"subtask {h.index}") for f in h.files]
        plans.append(SubtaskPlan(j, target, base.index, base_overlap, imports, tuple(downloads)))
    return RescalePlan(meta.job, meta.checkpoint_id, p, new_parallelism, m, tuple(plans))


def _check_tiling(meta: CheckpointMetadata, old: Sequence[SubtaskHandle]) -> None:
    for i, h in enumerate(old):
        expected = key_group_range_for_subtask(meta.max_parallelism, meta.parallelism, i)
        if h.index != i or h.key_group_range != expected:
            raise MetadataError(
                f"malformed metadata of checkpoint {meta.checkpoint_id}: subtask {h.index} covers "
                f"key groups [{h.key_group_start}, {h.key_group_end}], expected subtask {i} with "
                f"[{expected.start}, {expected.end}]; cannot rescale it")
