"""``ckpt jobs``: the jobs under a storage root (needs --storage only).

A job is a folder of the root that holds something committed: a checkpoint
(``chk-<id>/_metadata``) or a complete savepoint (``savepoints/<name>/_metadata``).
Per job: committed checkpoints, the latest one's id, age, parallelism, state backend
and size, the share of the memory limit its run's largest subtask held (memory and
external backends), savepoints and live leases. One job with unreadable metadata is reported in
its row (``error``), not as a failure of the listing.

A folder with nothing committed (only leases, run history under ``runs/``, the
leftovers of failed attempts or of an interrupted savepoint: what a failed first
run or a ``--start-from`` of a missing job leaves behind) is not a job: it is
listed only with ``--all``, marked ``nothing committed`` (``"committed": false``
in ``--json``). Folders with none of the layout's names are never listed, nor
symlinks (file:// storage does not follow them).
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

from statebackend.checkpoint.layout import (
    CHK_DIR_RE,
    INDEX_DIR,
    LEASES_DIR,
    REPORTS_DIR,
    RUNS_DIR,
    SAVEPOINTS_DIR,
    SHARED_DIR,
    savepoint_metadata_path,
)
from statebackend.checkpoint.leases import live_leases
from statebackend.checkpoint.metrics import MemoryHeadroom
from statebackend.checkpoint.store import CheckpointStore, check_job_name
from statebackend.cli.app import emit_json, json_flag
from statebackend.errors import CkptError, StorageError, UsageError
from statebackend.formatting import age_of, human_bytes
from statebackend.storage import Storage

LIST_THREADS = 8
# Top-level names only a job folder has (besides chk-<id>).
JOB_ENTRIES = frozenset({SAVEPOINTS_DIR, LEASES_DIR, RUNS_DIR, SHARED_DIR, REPORTS_DIR,
                         INDEX_DIR})
NOTHING_COMMITTED = "nothing committed"


@dataclass(frozen=True)
class JobInfo:
    """One row of `ckpt jobs`; field names are the --json keys."""

    job: str
    checkpoints: int = 0
    latest: int | None = None
    created_at: str | None = None
    parallelism: int | None = None
    max_parallelism: int | None = None
    bytes_referenced: int | None = None
    savepoints: int = 0
    live_leases: int = 0
    error: str | None = None
    # A checkpoint or a complete savepoint exists (None: unknown, see ``error``). Rows
    # without are shown only with --all.
    committed: bool | None = True
    backend: str | None = None  # the latest checkpoint's state backend
    # memory and external backends: the latest checkpoint's run, its largest subtask's
    # state in memory against the limit (statebackend.checkpoint.metrics.MemoryHeadroom)
    state_memory: dict | None = None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("jobs", parents=[json_flag()], help="list the jobs under a storage root",
                       description="List the jobs under --storage (folders with a committed "
                                   "checkpoint or a complete savepoint), with their latest "
                                   "checkpoint's id, age, parallelism, backend and size, and on "
                                   "the memory and external backends the share of the memory "
                                   "limit its run's largest subtask held. Needs no --job.")
    p.add_argument("--all", action="store_true",
                   help="also list folders with nothing committed (only leases, run history "
                        "or leftovers of failed runs), marked 'nothing committed'")
    p.set_defaults(handler=cmd_jobs, scope="root")


def is_job_folder(entries: list[str]) -> bool:
    """Whether a folder's names are a job's (committed or not)."""
    return any(e in JOB_ENTRIES or CHK_DIR_RE.match(e) for e in entries)


def complete_savepoints(storage: Storage, names: list[str]) -> int:
    """How many of these savepoint folders (of a job root) have their `_metadata`."""
    return sum(1 for n in names if storage.exists(savepoint_metadata_path(n)))


def job_info(storage: Storage, name: str) -> JobInfo | None:
    """The row of folder ``name`` (``committed`` False when it holds nothing committed),
    or None when it is not a job folder at all."""
    try:
        store = CheckpointStore(storage, check_job_name(name))
    except UsageError:
        return None  # not a name a job can have: some other folder
    info = JobInfo(job=name, committed=None)
    try:
        entries = store.storage.list_dir("")
        if not is_job_folder(entries):
            return None
        folders = store.storage.list_dir(SAVEPOINTS_DIR) if SAVEPOINTS_DIR in entries else []
        info = JobInfo(job=name, savepoints=len(folders), committed=None)
        ids = store.checkpoint_ids()
        leases = len(live_leases(store.storage)) if LEASES_DIR in entries else 0
        committed = bool(ids) or complete_savepoints(store.storage, folders) > 0
        info = JobInfo(job=name, checkpoints=len(ids), savepoints=len(folders),
                       live_leases=leases, committed=committed)
        if ids:
            meta = store.load(ids[-1])
            info = replace(info, latest=meta.checkpoint_id, created_at=meta.created_at,
                           parallelism=meta.parallelism,
                           max_parallelism=meta.max_parallelism,
                           bytes_referenced=meta.bytes_referenced,
                           backend=meta.state_backend,
                           state_memory=None if (memory := meta.state_memory()) is None
                           else memory.to_json())
    except CkptError as exc:
        return replace(info, error=str(exc))
    return info


def list_jobs(storage: Storage, include_uncommitted: bool = False) -> list[JobInfo]:
    """The jobs under ``storage``, by name; with ``include_uncommitted`` also the folders
    holding nothing committed. A row with an ``error`` is always listed."""
    storage.check_reachable()
    local_root = storage.local_path("")
    if local_root is not None and not os.path.isdir(local_root):
        raise StorageError(f"storage root {storage.url} does not exist; check --storage")
    names = storage.list_dir("")
    with ThreadPoolExecutor(max_workers=LIST_THREADS) as pool:
        rows = list(pool.map(lambda n: job_info(storage, n), names))
    return [r for r in rows if r is not None and (include_uncommitted or r.committed is not False)]


def cmd_jobs(args: argparse.Namespace, storage: Storage) -> int:
    rows = list_jobs(storage, include_uncommitted=True)
    jobs = rows if args.all else [j for j in rows if j.committed is not False]
    if args.json:
        emit_json([asdict(j) for j in jobs])
        return 0
    hidden = len(rows) - len(jobs)
    note = (f"({hidden} folder{'s' if hidden > 1 else ''} with {NOTHING_COMMITTED} not shown: "
            "see --all)") if hidden else None
    if not jobs:
        print(f"(no jobs under {storage.url})")
        if note:
            print(note)
        return 0
    print(f"{'job':24}  {'checkpoints':>11}  {'latest':>6}  {'created':>12}  {'P':>3}  "
          f"{'backend':<8}  {'size':>10}  {'mem/limit':>9}  {'savepoints':>10}  {'leases':>6}")
    for j in jobs:
        if j.error:
            print(f"{j.job:24}  unreadable: {j.error}")
            continue
        latest = "-" if j.latest is None else str(j.latest)
        size = "-" if j.bytes_referenced is None else human_bytes(j.bytes_referenced)
        memory = MemoryHeadroom.from_json(j.state_memory)
        share = (memory.share_text() if memory is not None else None) or "-"
        print(f"{j.job:24}  {j.checkpoints:>11}  {latest:>6}  {age_of(j.created_at):>12}  "
              f"{j.parallelism if j.parallelism is not None else '-':>3}  "
              f"{j.backend or '-':<8}  {size:>10}  {share:>9}  "
              f"{j.savepoints:>10}  {j.live_leases:>6}"
              + ("" if j.committed else f"  ({NOTHING_COMMITTED})"))
    if note:
        print(note)
    return 0
