"""What gc and retention delete, and how: one result type and the delete helpers.

Both are a pure plan over the registry (gc.py, retention.py) and a best-effort
executor; both executors delete through `delete_counted` (batched, counted on the
progress line, failures collected, never raised) and then `prune_empty_dirs`, and
both return a `DeletionReport`:

- ``plan``: the operation's frozen plan (`DeletionPlan`: its ``deletions`` file by
  file with a reason, and the operation's own figures in `DeletionPlan.report_fields`);
- ``deleted``: the planned files actually deleted (none in a dry run);
- ``failures``: (path, error) of deletions that failed (the command exits 1);
- ``spared``: planned deletions the last-moment re-checks skipped (a commit or a
  lease since planning);
- ``seconds``: wall time of planning and executing.

``to_json()`` is the ``--json`` document of ``ckpt gc`` / ``ckpt retain`` and the
XCom of their Airflow tasks: the common keys (``operation``, ``job``, ``dry_run``,
``files_planned``, ``bytes_planned``, ``files_deleted``, ``bytes_deleted``,
``spared``, ``failures``, ``seconds``) and the plan's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from statebackend.checkpoint.layout import PERMANENT_DIRS
from statebackend.progress import ProgressSink
from statebackend.storage import Storage

LIST_CAP = 50        # files listed in a text report (the JSON lists them all)
DELETE_BATCH = 1000  # files per delete call: S3's batch limit, and one progress step


class PlannedFile(Protocol):
    """One planned deletion (gc's `GcFile`, retention's `FileAction`)."""

    @property
    def path(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def reason(self) -> str: ...
    def to_json(self) -> dict[str, Any]: ...


F = TypeVar("F", bound=PlannedFile)


class DeletionPlan(Protocol[F]):
    """A plan of deletions: what gc and retention plan have in common."""

    operation: ClassVar[str]   # "gc" | "retain": the report's ``operation``

    @property
    def job(self) -> str: ...
    @property
    def deletions(self) -> tuple[F, ...]: ...
    @property
    def bytes_to_delete(self) -> int: ...
    def report_fields(self, done: Sequence[F] | None) -> dict[str, Any]:
        """The operation's own report keys; ``done``: the files deleted (None: dry run)."""
        ...


P = TypeVar("P", bound="DeletionPlan[Any]")


@dataclass(frozen=True)
class DeletionReport(Generic[P, F]):
    """The result of gc or retention (module docstring)."""

    plan: P
    dry_run: bool
    deleted: tuple[F, ...] = ()
    failures: tuple[tuple[str, str], ...] = ()
    spared: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def job(self) -> str:
        return self.plan.job

    @property
    def files(self) -> tuple[F, ...]:
        """What the text lists: the deletions planned in a dry run, else those done."""
        return self.plan.deletions if self.dry_run else self.deleted

    @property
    def verb(self) -> str:
        return "would delete" if self.dry_run else "deleted"

    @property
    def files_deleted(self) -> int:
        return len(self.deleted)

    @property
    def bytes_deleted(self) -> int:
        return sum(f.size for f in self.deleted)

    def to_json(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "operation": plan.operation, "job": self.job, "dry_run": self.dry_run,
            "files_planned": len(plan.deletions), "bytes_planned": plan.bytes_to_delete,
            "files_deleted": self.files_deleted, "bytes_deleted": self.bytes_deleted,
            **plan.report_fields(None if self.dry_run else self.deleted),
            "spared": list(self.spared),
            "failures": [{"path": p, "error": e} for p, e in self.failures],
            "seconds": round(self.seconds, 3),
        }

    def file_lines(self) -> list[str]:
        """The text report's tail: the files (capped at `LIST_CAP`), then the failures."""
        files = self.files
        lines = [f"  {self.verb} {f.path} ({f.size} bytes, {f.reason})"
                 for f in files[:LIST_CAP]]
        if len(files) > LIST_CAP:
            lines.append(f"  ... and {len(files) - LIST_CAP} more (use --json for the full "
                         "list)")
        lines += [f"  FAILED {p}: {e}" for p, e in self.failures[:LIST_CAP]]
        return lines


def delete_counted(storage: Storage, paths: list[str], progress: ProgressSink,
                   label: str) -> list[tuple[str, str]]:
    """`Storage.delete_many` in batches, counting the files in phase ``label`` of
    ``progress``; returns the failures (gc and retention delete through this)."""
    progress.phase(label, total=len(paths), unit="files")
    failures: list[tuple[str, str]] = []
    for i in range(0, len(paths), DELETE_BATCH):
        batch = paths[i:i + DELETE_BATCH]
        failures += storage.delete_many(batch)
        progress.advance(len(batch))
    return failures


def prune_empty_dirs(storage: Storage, deleted_paths: list[str]) -> None:
    """Remove folders left empty by deletions (where the storage has folders)."""
    dirs: set[str] = set()
    for p in deleted_paths:
        parts = p.split("/")[:-1]
        while parts:
            dirs.add("/".join(parts))
            parts.pop()
    storage.remove_empty_dirs(dirs - PERMANENT_DIRS)
