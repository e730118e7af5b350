"""Checkpoints of one job: list, load, resolve, allocate ids, commit.

Job root layout: layout.py (the one module that names paths; DESIGN.md).
This module is the one lister of committed checkpoints (`checkpoint_ids`) and
the one reader of their `_metadata` (`parse`, `load`): the lifecycle registry
builds on both.

Invariants: a checkpoint exists iff its `_metadata` exists; `_metadata` is created
exclusively (a second commit of the same id fails instead of overwriting);
reading metadata never trusts paths (see metadata.py).

Before writing `_metadata`, `commit` checks (issue 10, defect 2):
1. every file the record references exists with its recorded size (one parallel
   pass of info requests), else MissingFilesError: a GC or cleanup that removed an
   in-flight upload must not yield a checkpoint that cannot restore;
2. the writer lease this context holds (`leases.writer_lease`) is still ours,
   else LeaseLostError: a writer whose lease was taken over must not commit.
Nothing is written when either check fails.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from statebackend.checkpoint.layout import CHK_DIR_RE, chk_id_of, metadata_path
from statebackend.checkpoint.leases import HeldLease, held_writer_leases
from statebackend.checkpoint.metadata import (
    CheckpointMetadata,
    FileRef,
    SubtaskHandle,
    parse_metadata,
)
from statebackend.checkpoint.runs import RunRecord, read_run_record, write_run_record
from statebackend.errors import (
    CheckpointNotFoundError,
    JobNotFoundError,
    LeaseConflictError,
    MetadataError,
    MissingFilesError,
    UsageError,
)
from statebackend.state.keygroups import check_parallelism, key_group_range_for_subtask
from statebackend.storage import Storage, child_storage, safe_relpath

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
VERIFY_THREADS = 16
MISSING_LIST_CAP = 5


def check_name(what: str, name: str) -> str:
    """A job or savepoint name: one safe path segment."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise UsageError(f"{what} {name!r} is invalid: use letters, digits, '_', '-', '.'")
    return name


def check_job_name(job: str) -> str:
    return check_name("job name", job)


class CheckpointStore:
    """Checkpoints of ``job`` under a storage root."""

    def __init__(self, storage: Storage, job: str) -> None:
        self.root_storage = storage
        self.job = check_job_name(job)
        self.storage = child_storage(storage, job)  # job root

    def __repr__(self) -> str:
        return f"CheckpointStore({self.storage.url!r})"

    # -- listing -----------------------------------------------------------
    def job_exists(self) -> bool:
        return bool(self.storage.list_dir(""))

    def require_job(self) -> None:
        self.root_storage.check_reachable()
        if not self.job_exists():
            raise JobNotFoundError(
                f"job {self.job!r} not found under {self.root_storage.url} (no checkpoints, "
                "savepoints or leases); check --storage and --job")

    def checkpoint_dirs(self) -> list[int]:
        """Ids of every chk-<id> folder, committed or not, ascending."""
        return sorted(cid for name in self.storage.list_dir("")
                      if (cid := chk_id_of(name)) is not None)

    def checkpoint_ids(self, known: Iterable[int] = ()) -> list[int]:
        """Ids of committed checkpoints (those with `_metadata`), ascending.

        One listing of the job root's folders; ids in ``known`` (committed when
        the caller last looked) are taken as they are (a retired one is skipped
        later, when its `_metadata` cannot be read), every other ``chk-<id>``
        folder costs one existence check of its `_metadata`: a handful of
        requests instead of a listing of every file of the job.
        """
        known = set(known)
        folders = self.checkpoint_dirs()
        unknown = [cid for cid in folders if cid not in known]
        workers = min(VERIFY_THREADS, len(unknown)) if self.storage.remote else 1
        if workers > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                found = list(pool.map(self._committed, unknown))
        else:
            found = [self._committed(cid) for cid in unknown]
        return sorted([cid for cid, ok in zip(unknown, found, strict=True) if ok]
                      + [cid for cid in folders if cid in known])

    def _committed(self, checkpoint_id: int) -> bool:
        return self.storage.exists(metadata_path(checkpoint_id))

    def read_record(self, checkpoint_id: int) -> bytes | None:
        """The raw `_metadata` of ``checkpoint_id``, or None if it does not exist."""
        return self.storage.read_bytes_if_exists(metadata_path(checkpoint_id))

    def parse(self, checkpoint_id: int, data: bytes, memo: dict | None = None
              ) -> CheckpointMetadata:
        """The `_metadata` bytes of ``checkpoint_id``, strictly parsed and checked to
        describe this job and id. ``memo``: shared across many records (metadata.py)."""
        where = f"{self.storage.url}/{metadata_path(checkpoint_id)}"
        meta = parse_metadata(data, where, memo if memo is not None else {})
        if meta.checkpoint_id != checkpoint_id or meta.job != self.job:
            raise MetadataError(
                f"malformed metadata {where}: it describes job {meta.job!r} checkpoint "
                f"{meta.checkpoint_id}, not job {self.job!r} checkpoint {checkpoint_id}")
        return meta

    def load(self, checkpoint_id: int) -> CheckpointMetadata:
        data = self.read_record(checkpoint_id)
        if data is None:
            raise CheckpointNotFoundError(
                f"checkpoint {checkpoint_id} of job {self.job!r} not found "
                f"(no {self.storage.url}/{metadata_path(checkpoint_id)}); see `ckpt list`")
        return self.parse(checkpoint_id, data)

    def load_all(self) -> list[CheckpointMetadata]:
        return [self.load(i) for i in self.checkpoint_ids()]

    def latest(self) -> CheckpointMetadata | None:
        ids = self.checkpoint_ids()
        return self.load(ids[-1]) if ids else None

    def resolve(self, ref: str | int | None) -> CheckpointMetadata:
        """``latest`` (default), an id, or ``chk-<id>``."""
        self.require_job()
        if ref in (None, "", "latest"):
            meta = self.latest()
            if meta is None:
                raise CheckpointNotFoundError(
                    f"job {self.job!r} has no committed checkpoint under {self.root_storage.url}")
            return meta
        text = str(ref)
        m = CHK_DIR_RE.match(text)
        if m:
            text = m.group(1)
        if not text.isdigit():
            raise UsageError(f"checkpoint {ref!r} is not 'latest', an id or chk-<id>")
        return self.load(int(text))

    def find_by_run_id(self, run_id: str) -> CheckpointMetadata | None:
        """The retained checkpoint that committed ``run_id`` (None once retired)."""
        for cid in reversed(self.checkpoint_ids()):
            meta = self.load(cid)
            if meta.run_id == run_id:
                return meta
        return None

    def find_run(self, run_id: str) -> RunRecord | None:
        """Whether ``run_id`` was ever committed: its ledger record, else a retained
        `_metadata` naming it (a crash between commit and ledger write; the record is
        written now). See runs.py."""
        record = read_run_record(self.storage, run_id)
        if record is not None:
            return record
        meta = self.find_by_run_id(run_id)
        if meta is None:
            return None
        self.record_run(meta)
        return RunRecord.of(meta)

    def record_run(self, meta: CheckpointMetadata) -> None:
        """Add ``meta``'s run to the ledger of committed runs (runs.py)."""
        write_run_record(self.storage, meta)

    def next_checkpoint_id(self) -> int:
        """One above every chk folder seen (committed or attempted)."""
        ids = self.checkpoint_dirs()
        return (ids[-1] + 1) if ids else 1

    # -- commit ------------------------------------------------------------
    def commit(self, meta: CheckpointMetadata, *,
               lease: HeldLease | None = None) -> CheckpointMetadata:
        """Verify, then write `_metadata` exclusively (see the module docstring).

        ``lease``: the writer lease to check; default: every writer lease of this
        job held by the calling context. LeaseConflictError if the id is taken.
        """
        if meta.job != self.job:
            raise UsageError(f"metadata of job {meta.job!r} cannot be committed to {self.job!r}")
        for ref in meta.files:
            safe_relpath(ref.path)
        self.verify_files(meta)
        for held in (lease,) if lease is not None else held_writer_leases(self.storage):
            held.ensure_held()  # last, right before the write: the closest check wins
        try:
            self.storage.write_exclusive(metadata_path(meta.checkpoint_id), meta.to_bytes())
        except FileExistsError as exc:
            raise LeaseConflictError(
                f"checkpoint {meta.checkpoint_id} of job {self.job!r} was committed by another "
                "writer; this attempt is aborted") from exc
        return meta

    def verify_files(self, meta: CheckpointMetadata) -> None:
        """MissingFilesError unless every file ``meta`` references exists with its size."""
        bad = wrong_files(self.storage, meta.files)
        if bad:
            shown = ", ".join(f"{path} ({why})" for path, why in bad[:MISSING_LIST_CAP])
            more = f" and {len(bad) - MISSING_LIST_CAP} more" if len(bad) > MISSING_LIST_CAP \
                else ""
            raise MissingFilesError(
                f"checkpoint {meta.checkpoint_id} of job {self.job!r} not committed: {len(bad)} "
                f"referenced file(s) under {self.storage.url} missing or with the wrong size: "
                f"{shown}{more}; were they collected while the attempt ran? Run it again")


def wrong_files(storage: Storage, refs: Iterable[FileRef],
                threads: int = VERIFY_THREADS) -> list[tuple[str, str]]:
    """(path, "missing" | "size X, recorded Y") of each reference storage does not match."""
    expected: dict[str, int] = {}
    for ref in refs:
        expected.setdefault(ref.path, ref.size)
    paths = sorted(expected)
    if not paths:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths)))) as pool:
        infos = list(pool.map(storage.info, paths))
    out = []
    for path, info in zip(paths, infos, strict=True):
        if info is None:
            out.append((path, "missing"))
        elif info.size != expected[path]:
            out.append((path, f"size {info.size}, recorded {expected[path]}"))
    return out


def build_metadata(*, job: str, checkpoint_id: int, parent: int | None, max_parallelism: int,
                   states: Sequence[dict], handles: Sequence[SubtaskHandle],
                   kind: str = "checkpoint", run_id: str | None = None,
                   inputs: Sequence[str] = (), rescaled_from: int | None = None,
                   source: dict | None = None, extra: dict | None = None) -> CheckpointMetadata:
    """Assemble and check a commit record from the subtask handles of one attempt."""
    parallelism = len(handles)
    check_parallelism(parallelism, max_parallelism)
    ordered = sorted(handles, key=lambda h: h.index)
    for i, h in enumerate(ordered):
        expected = key_group_range_for_subtask(max_parallelism, parallelism, i)
        if h.index != i or h.key_group_range != expected:
            raise UsageError(f"subtask handle {h.index} covers key groups "
                             f"[{h.key_group_start}, {h.key_group_end}], expected subtask {i} "
                             f"with [{expected.start}, {expected.end}]")
    return CheckpointMetadata(
        job=job, checkpoint_id=checkpoint_id, parent=parent, parallelism=parallelism,
        max_parallelism=max_parallelism, states=tuple(dict(s) for s in states),
        subtasks=tuple(ordered), kind=kind, run_id=run_id, input=tuple(inputs),
        rescaled_from=rescaled_from, source=source, extra=dict(extra or {}))
