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
   else LeaseLostError: a writer whose lease was taken over must not commit;
3. the record's id is its parent's + 1 (`lineage.check_successor`).
Nothing is written when a check fails. Then it follows the commit protocol of
lineage.py: exclusive `_metadata`, then its commit-log entry (a writer paused past
its lease withdraws its record there), so a lineage never forks.

Writers hold the lineage through `writer` (lease, then the lineage check, the
writer's epoch, and a fence after taking over a stale lease); readers of "latest"
refuse a lineage whose newest records fork or whose newest commit went missing
(`Lineage.require_intact`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from statebackend.checkpoint import lineage as log
from statebackend.checkpoint.layout import CHK_DIR_RE, chk_id_of, metadata_path
from statebackend.checkpoint.leases import HeldLease, held_writer_leases, writer_lease
from statebackend.checkpoint.lineage import LogListing, Problem
from statebackend.checkpoint.metadata import (
    CheckpointMetadata,
    FileRef,
    ParseMemo,
    SubtaskHandle,
    parse_metadata,
    utc_now_iso,
)
from statebackend.checkpoint.runs import (
    RunRecord,
    read_run_record,
    safe_run_name,
    write_record,
    write_run_record,
)
from statebackend.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    JobNotFoundError,
    LeaseConflictError,
    LineageError,
    MetadataError,
    MissingFilesError,
    UnsafePathError,
    UsageError,
)
from statebackend.state.keygroups import MURMUR3, check_parallelism, key_group_range_for_subtask
from statebackend.storage import Storage, child_storage, safe_relpath

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
VERIFY_THREADS = 16
MISSING_LIST_CAP = 5
FENCE_ATTEMPTS = 5
# What a fence keeps of the record it copies: the state's clocks and the job's kind; the
# run's own figures (metrics, outputs, context) belong to that run's checkpoint only.
FENCE_KEEPS = ("time", "job_kind", "engine", "key")  # "key": evolution checks it
log_ = logging.getLogger(__name__)


def check_name(what: str, name: str) -> str:
    """A job or savepoint name: one safe path segment."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise UsageError(f"{what} {name!r} is invalid: use letters, digits, '_', '-', '.'")
    return name


def check_job_name(job: str) -> str:
    return check_name("job name", job)


class CheckpointStore:
    """Checkpoints of ``job`` under a storage root. ``index_key`` signs and checks the
    job's registry index instead of this host's key (statebackend.lifecycle.index_signing:
    a key shared by hosts that have no disk in common); it is never shown."""

    def __init__(self, storage: Storage, job: str, index_key: bytes | None = None) -> None:
        self.root_storage = storage
        self.job = check_job_name(job)
        self.storage = child_storage(storage, job)  # job root
        self.index_key = index_key

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
        found = list(self.storage.map_requests(self._committed, unknown, VERIFY_THREADS))
        return sorted([cid for cid, ok in zip(unknown, found, strict=True) if ok]
                      + [cid for cid in folders if cid in known])

    def _committed(self, checkpoint_id: int) -> bool:
        try:
            return self.storage.exists(metadata_path(checkpoint_id))
        except UnsafePathError as exc:  # a symlinked record: not ours, never read (file://)
            log_.warning("checkpoint %s skipped: %s", checkpoint_id, exc)
            return False

    def read_record(self, checkpoint_id: int) -> bytes | None:
        """The raw `_metadata` of ``checkpoint_id``, or None if it does not exist."""
        return self.storage.read_bytes_if_exists(metadata_path(checkpoint_id))

    def read_records(self, checkpoint_ids: Iterable[int]) -> Iterator[bytes | None]:
        """`read_record` of each id, in order (`Storage.read_many`: batched)."""
        return self.storage.read_many(map(metadata_path, checkpoint_ids))

    def parse(self, checkpoint_id: int, data: bytes, memo: ParseMemo | None = None
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
        """The newest committed checkpoint; LineageError if it does not build on the one
        before it (a fork, lineage.py scenario 6)."""
        return self._latest_record(self.checkpoint_ids())[0]

    def lineage(self, *, repair: bool = False) -> Lineage:
        """The lineage's state now (lineage.py): committed ids, the latest record, the
        commit log's names and every problem they show. ``repair`` (a writer holding
        the lease): write missing log entries and ledger records first (scenarios 3-4).
        """
        ids = self.checkpoint_ids()
        names = log.read_log(self.storage, ids[0] if ids else None)
        latest, data = self._latest_record(ids)
        problems = log.check_log(ids, names)
        needs = any(p.kind in ("unlogged", "ledger-missing") for p in problems) or (
            bool(ids) and not names.entries)  # a lineage from before the log: backfill
        if repair and needs:
            parents, epochs = self._repair_log(ids, names)
            names = log.read_log(self.storage, ids[0] if ids else None)
            problems = log.check_log(ids, names) + log.find_forks(ids, parents, epochs)
        if latest is not None:
            problems += log.check_digests(names, {latest.checkpoint_id: log.digest_of(data)},
                                          latest.checkpoint_id)
        return Lineage(self.job, tuple(ids), latest, names, tuple(problems))

    def _latest_record(self, ids: Sequence[int]) -> tuple[CheckpointMetadata | None, bytes]:
        """The newest record (and its bytes), checked to build on the one before it and
        to carry no older writer epoch than it."""
        if not ids:
            return None, b""
        data = self.read_record(ids[-1])
        if data is None:
            raise CheckpointNotFoundError(f"checkpoint {ids[-1]} of job {self.job!r} was "
                                          "retired while it was read; try again")
        meta = self.parse(ids[-1], data)
        # the record before it too: a writer that lost its lease may have built on the
        # right parent with an older epoch (lineage.py scenario 1)
        epochs = {meta.checkpoint_id: meta.epoch}
        before = self.read_record(ids[-2]) if len(ids) > 1 else None
        try:
            if before is not None:
                epochs[ids[-2]] = self.parse(ids[-2], before).epoch
        except MetadataError:
            pass  # an old malformed record is reported by `ckpt doctor`, not here
        forks = log.find_forks(ids[-2:], {meta.checkpoint_id: meta.parent}, epochs)
        if forks:
            raise LineageError(f"job {self.job!r}: {forks[0].message}; {forks[0].repair}")
        return meta, data

    def run_still_counts(self, record: RunRecord) -> bool:
        """Whether a ledger record's checkpoint is committed, retired, or from before the
        commit log (three cheap checks); False: it names a lost commit (lineage.py 5)."""
        cid = record.checkpoint_id
        return (self._committed(cid) or self.storage.exists(log.retired_path(cid))
                or not log.slot(self.storage, cid))

    def _repair_log(self, ids: Sequence[int], names: LogListing
                    ) -> tuple[dict[int, int | None], dict[int, int]]:
        """Write the commit-log entries of committed records without one (parsed now;
        a malformed one is skipped and reported by its readers) and the ledger records
        of logged runs without one; (parents, epochs) of the records parsed."""
        memo: ParseMemo = {}
        parents: dict[int, int | None] = {}
        epochs: dict[int, int] = {}
        for cid in ids:
            if cid in names.entries:
                continue
            data = self.read_record(cid)
            if data is None:
                continue
            try:
                meta = self.parse(cid, data, memo)
            except MetadataError as exc:
                log_.warning("commit log: checkpoint %s not logged: %s", cid, exc)
                continue
            parents[cid], epochs[cid] = meta.parent, meta.epoch
            log.write_entry(self.storage, log.ChainEntry.of(meta, data))
        for cid, run in names.entry_runs.items():
            if run and run not in names.ledger:
                entry = log.entry_of(self.storage, names, cid)
                if entry is not None and entry.run is not None:
                    write_record(self.storage, entry.run)
        return parents, epochs

    def resolve(self, ref: str | int | None) -> CheckpointMetadata:
        """``latest`` (default), an id, or ``chk-<id>``. "latest" is refused (LineageError)
        while the lineage forked or lost its newest commit: it would name the wrong one."""
        self.require_job()
        if ref in (None, "", "latest"):
            lineage = self.lineage()
            lineage.require_intact(log.STATE_PROBLEMS)
            meta = lineage.latest
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

    def find_run(self, run_id: str, lineage: Lineage | None = None) -> RunRecord | None:
        """Whether ``run_id`` was ever committed: its ledger record, else the commit-log
        entry naming it (the ledger record is written again from it), else, in a lineage
        committed before the log, a retained `_metadata` naming it. See runs.py and
        lineage.py. A record naming a checkpoint that is neither committed nor retired
        is not trusted: None, and the lineage check refuses the run (scenario 5)."""
        record = read_run_record(self.storage, run_id)
        if record is not None and (lineage is None or self._still_counts(record, lineage)):
            return record
        if lineage is None:
            ids = self.checkpoint_ids()
            names = log.read_log(self.storage, ids[0] if ids else None)
        else:
            names = lineage.log
        cid = names.entry_of_run(safe_run_name(run_id))
        if cid is not None:
            entry = log.entry_of(self.storage, names, cid)
            if entry is not None and entry.run is not None and entry.run.run_id == run_id:
                write_record(self.storage, entry.run)
                return entry.run
        if not names.entries:  # written before the commit log: its records name their runs
            meta = self.find_by_run_id(run_id)
            if meta is not None:
                self.record_run(meta)
                return RunRecord.of(meta)
        return None

    @staticmethod
    def _still_counts(record: RunRecord, lineage: Lineage) -> bool:
        cid = record.checkpoint_id
        return (cid in lineage.committed or cid in lineage.log.retired
                or cid not in lineage.log.entries)

    def record_run(self, meta: CheckpointMetadata) -> None:
        """Add ``meta``'s run to the ledger of committed runs (runs.py)."""
        write_run_record(self.storage, meta)

    def next_checkpoint_id(self) -> int:
        """The id a commit on the latest checkpoint takes: latest + 1 (lineage.py step 1);
        a folder an earlier failed attempt left at that id is shared (its files have
        unique names and are orphans for gc)."""
        ids = self.checkpoint_ids()
        return (ids[-1] + 1) if ids else 1

    # -- the writer ---------------------------------------------------------------
    @contextmanager
    def writer(self, purpose: str, *, checkpoint_ids: Sequence[int] = ()
               ) -> Iterator[WriterSession]:
        """Hold the lineage for a write: the writer lease (renewed), then the lineage
        check (repairing the commit log and the ledger; LineageError on a fork, a lost
        commit or a forgotten run), the writer's epoch above every commit's, and, after
        taking over a stale lease, a fence (lineage.py scenario 1)."""
        with writer_lease(self.storage, purpose, checkpoint_ids=checkpoint_ids) as held:
            lineage = self.lineage(repair=True)
            lineage.require_intact()
            latest = lineage.latest
            taken = held.taken_over
            held.set_epoch(max(latest.epoch if latest else 0, held.lease.epoch,
                               taken.epoch if taken else 0) + 1)
            if taken is not None and latest is not None:
                latest = self.fence(latest, taken)
                lineage = replace(lineage, latest=latest,
                                  committed=lineage.committed + (latest.checkpoint_id,))
            yield WriterSession(held, lineage)

    def fence(self, latest: CheckpointMetadata, taken: object) -> CheckpointMetadata:
        """Commit a carry-forward copy of ``latest`` at the next id, so a writer paused
        with the lease ``taken`` over can never commit (lineage.py scenario 1). If that
        writer commits first, fence on top of its commit."""
        for _ in range(FENCE_ATTEMPTS):
            fence = latest.with_changes(
                checkpoint_id=latest.checkpoint_id + 1, parent=latest.checkpoint_id,
                kind="checkpoint", run_id=None, input=(), rescaled_from=None, source=None,
                created_at=utc_now_iso(), epoch=0,
                subtasks=tuple(replace(s, bytes_uploaded=0) for s in latest.subtasks),
                extra={**{k: latest.extra[k] for k in FENCE_KEEPS if k in latest.extra},
                       "fence": {"after_takeover_of": getattr(taken, "purpose", ""),
                                 "holder": getattr(taken, "holder", ""),
                                 "epoch": getattr(taken, "epoch", 0)}})
            try:
                return self.commit(fence)
            except CommitConflictError:
                latest = self.latest() or latest  # the paused writer committed: fence on it
        raise LeaseConflictError(f"job {self.job!r}: could not fence the lineage after "
                                 "taking over a stale writer lease; retry later")

    # -- commit ------------------------------------------------------------
    def commit(self, meta: CheckpointMetadata, *,
               lease: HeldLease | None = None) -> CheckpointMetadata:
        """Verify, then write `_metadata` exclusively (see the module docstring).

        ``lease``: the writer lease to check; default: every writer lease of this
        job held by the calling context. LeaseConflictError if the id is taken.
        """
        if meta.job != self.job:
            raise UsageError(f"metadata of job {meta.job!r} cannot be committed to {self.job!r}")
        log.check_successor(meta)
        for ref in meta.files:
            safe_relpath(ref.path)
        self.verify_files(meta)
        held_leases = (lease,) if lease is not None else held_writer_leases(self.storage)
        for held in held_leases:
            held.ensure_held()  # last, right before the write: the closest check wins
        epoch = max((h.lease.epoch for h in held_leases), default=0)
        if epoch and meta.epoch != epoch:
            meta = meta.with_changes(epoch=epoch)
        data = meta.to_bytes()
        # the parser's rules hold for what we write too (file scope, names, ranges)
        self.parse(meta.checkpoint_id, data)
        try:
            self.storage.write_exclusive(metadata_path(meta.checkpoint_id), data)
        except FileExistsError as exc:
            raise CommitConflictError(
                f"checkpoint {meta.checkpoint_id} of job {self.job!r} was committed by another "
                "writer; this attempt is aborted") from exc
        log.log_commit(self.storage, meta, data)
        # the ledger remembers the run once retention retires this record (runs.py); a
        # crash before this line is repaired from the log entry (lineage.py scenario 4)
        self.record_run(meta)
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


@dataclass(frozen=True)
class Lineage:
    """A job's lineage at one moment: committed ids, the latest record, the commit log's
    names and the problems they show (lineage.py)."""

    job: str
    committed: tuple[int, ...]
    latest: CheckpointMetadata | None
    log: LogListing
    problems: tuple[Problem, ...]

    @property
    def blocking(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.blocking)

    def require_intact(self, kinds: Sequence[str] | None = None) -> None:
        """LineageError (one line: the first blocking problem and its repair); ``kinds``:
        only problems of these kinds count."""
        bad = [p for p in self.blocking if kinds is None or p.kind in kinds]
        if bad:
            more = f" ({len(bad) - 1} more problem(s))" if len(bad) > 1 else ""
            raise LineageError(f"job {self.job!r}: {bad[0].message}; {bad[0].repair}{more}; "
                               "see `ckpt doctor`")


@dataclass(frozen=True)
class WriterSession:
    """What `CheckpointStore.writer` yields: the held lease and the lineage it checked."""

    lease: HeldLease
    lineage: Lineage


def wrong_files(storage: Storage, refs: Iterable[FileRef],
                threads: int = VERIFY_THREADS) -> list[tuple[str, str]]:
    """(path, "missing" | "size X, recorded Y") of each reference storage does not match."""
    expected: dict[str, int] = {}
    for ref in refs:
        expected.setdefault(ref.path, ref.size)
    paths = sorted(expected)
    if not paths:
        return []
    infos = list(storage.map_requests(storage.info, paths, threads))
    out = []
    for path, info in zip(paths, infos, strict=True):
        if info is None:
            out.append((path, "missing"))
        elif info.size != expected[path]:
            out.append((path, f"size {info.size}, recorded {expected[path]}"))
    return out


@dataclass(frozen=True)
class MetadataParts:
    """What a writer knows of a checkpoint it commits; `build_metadata` checks the
    handles and derives the rest (parallelism, subtask order)."""

    job: str
    checkpoint_id: int
    parent: int | None
    max_parallelism: int
    states: Sequence[Mapping[str, Any]]
    handles: Sequence[SubtaskHandle]
    kind: str = "checkpoint"
    run_id: str | None = None
    inputs: Sequence[str] = ()
    rescaled_from: int | None = None
    source: dict[str, Any] | None = None
    extra: Mapping[str, Any] | None = None
    key_hash: str = MURMUR3  # the lineage's (a new lineage's choice, else its parent's)


def build_metadata(parts: MetadataParts) -> CheckpointMetadata:
    """Assemble and check a commit record from the subtask handles of one attempt."""
    parallelism = len(parts.handles)
    check_parallelism(parallelism, parts.max_parallelism)
    ordered = sorted(parts.handles, key=lambda h: h.index)
    for i, h in enumerate(ordered):
        expected = key_group_range_for_subtask(parts.max_parallelism, parallelism, i)
        if h.index != i or h.key_group_range != expected:
            raise UsageError(f"subtask handle {h.index} covers key groups "
                             f"[{h.key_group_start}, {h.key_group_end}], expected subtask {i} "
                             f"with [{expected.start}, {expected.end}]")
    return CheckpointMetadata(
        job=parts.job, checkpoint_id=parts.checkpoint_id, parent=parts.parent,
        parallelism=parallelism, max_parallelism=parts.max_parallelism,
        states=tuple(dict(s) for s in parts.states), subtasks=tuple(ordered), kind=parts.kind,
        run_id=parts.run_id, input=tuple(parts.inputs), rescaled_from=parts.rescaled_from,
        source=parts.source, extra=dict(parts.extra or {}), key_hash=parts.key_hash)
