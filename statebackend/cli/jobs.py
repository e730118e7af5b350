"""``ckpt jobs``: the jobs under a storage root (needs --storage only).

A job is a folder of the root holding checkpoints (``chk-<id>``), savepoints
or leases. Per job: committed checkpoints, the latest one's id, age,
parallelism and size, savepoints and live leases. One job with unreadable
metadata is reported in its row (``error``), not as a failure of the listing.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

from statebackend.checkpoint.layout import CHK_DIR_RE, LEASES_DIR, SAVEPOINTS_DIR
from statebackend.checkpoint.leases import live_leases
from statebackend.checkpoint.store import CheckpointStore, check_job_name
from statebackend.cli.app import age_of, emit_json, human_bytes, json_flag
from statebackend.errors import CkptError, StorageError, UsageError
from statebackend.storage import Storage

LIST_THREADS = 8


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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("jobs", parents=[json_flag()], help="list the jobs under a storage root",
                       description="List the jobs (folders with checkpoints, savepoints or "
                                   "leases) under --storage, with their latest checkpoint's "
                                   "id, age, parallelism and size. Needs no --job.")
    p.set_defaults(handler=cmd_jobs, scope="root")


def is_job_folder(entries: list[str]) -> bool:
    return any(CHK_DIR_RE.match(e) or e in (SAVEPOINTS_DIR, LEASES_DIR) for e in entries)


def job_info(storage: Storage, name: str) -> JobInfo | None:
    """The row of folder ``name``, or None when it is not a job."""
    try:
        store = CheckpointStore(storage, check_job_name(name))
    except UsageError:
        return None  # not a name a job can have: some other folder
    entries = store.storage.list_dir("")
    if not is_job_folder(entries):
        return None
    savepoints = len(store.storage.list_dir(SAVEPOINTS_DIR)) if SAVEPOINTS_DIR in entries else 0
    info = JobInfo(job=name, savepoints=savepoints)
    try:
        ids = store.checkpoint_ids()
        leases = len(live_leases(store.storage)) if LEASES_DIR in entries else 0
        info = JobInfo(job=name, checkpoints=len(ids), savepoints=savepoints, live_leases=leases)
        if ids:
            meta = store.load(ids[-1])
            info = JobInfo(job=name, checkpoints=len(ids), latest=meta.checkpoint_id,
                           created_at=meta.created_at, parallelism=meta.parallelism,
                           max_parallelism=meta.max_parallelism,
                           bytes_referenced=meta.bytes_referenced, savepoints=savepoints,
                           live_leases=leases)
    except CkptError as exc:
        return replace(info, error=str(exc))
    return info


def list_jobs(storage: Storage) -> list[JobInfo]:
    storage.check_reachable()
    local_root = storage.local_path("")
    if local_root is not None and not os.path.isdir(local_root):
        raise StorageError(f"storage root {storage.url} does not exist; check --storage")
    names = storage.list_dir("")
    with ThreadPoolExecutor(max_workers=LIST_THREADS) as pool:
        rows = list(pool.map(lambda n: job_info(storage, n), names))
    return [r for r in rows if r is not None]


def cmd_jobs(args: argparse.Namespace, storage: Storage) -> int:
    jobs = list_jobs(storage)
    if args.json:
        emit_json([asdict(j) for j in jobs])
        return 0
    if not jobs:
        print(f"(no jobs under {storage.url})")
        return 0
    print(f"{'job':24}  {'checkpoints':>11}  {'latest':>6}  {'created':>12}  {'P':>3}  "
          f"{'size':>10}  {'savepoints':>10}  {'leases':>6}")
    for j in jobs:
        if j.error:
            print(f"{j.job:24}  unreadable: {j.error}")
            continue
        latest = "-" if j.latest is None else str(j.latest)
        size = "-" if j.bytes_referenced is None else human_bytes(j.bytes_referenced)
        print(f"{j.job:24}  {j.checkpoints:>11}  {latest:>6}  {age_of(j.created_at):>12}  "
              f"{j.parallelism if j.parallelism is not None else '-':>3}  {size:>10}  "
              f"{j.savepoints:>10}  {j.live_leases:>6}")
    return 0
