"""``ckpt retain | gc | savepoint | savepoints | leases``: lifecycle commands.

Destructive commands plan first and print the plan with ``--dry-run``; a plan
is refused (exit 1, nothing deleted) when any metadata or lease is malformed,
and a savepoint deletion while a live lease uses the savepoint.
"""

from __future__ import annotations

import argparse

from statebackend.checkpoint.layout import savepoint_dir
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import emit_json, json_flag, state_db_flags, state_db_of
from statebackend.errors import UsageError
from statebackend.formatting import age_of, human_bytes
from statebackend.lifecycle.gc import DEFAULT_GRACE_SECONDS, MAX_GRACE_SECONDS, collect_garbage
from statebackend.lifecycle.gc import summarize_text as gc_text
from statebackend.lifecycle.registry import build_registry
from statebackend.lifecycle.retention import retain
from statebackend.lifecycle.retention import summarize_text as retain_text
from statebackend.lifecycle.savepoint import create_savepoint, delete_savepoint, list_savepoints
from statebackend.lifecycle.vacuum import vacuum_after_retention
from statebackend.progress import Progress
from statebackend.settings import number


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "retain", parents=[json_flag(), state_db_flags()],
        help="retire all but the newest N checkpoints",
        description="Keep the newest N committed checkpoints, every savepoint and every "
                    "checkpoint held by a live lease; retire the others (their _metadata first, "
                    "then their private files and the shared files nothing kept references). "
                    "An external-backend job's database is vacuumed too (with --state-db): "
                    "only what the kept checkpoints and savepoints read stays.")
    p.add_argument("--keep", type=int, required=True, help="checkpoints to keep (>= 1)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.set_defaults(handler=cmd_retain)

    p = sub.add_parser(
        "gc", parents=[json_flag()], help="delete unreferenced files (orphans) past a grace period",
        description="Delete files under shared/ and chk-*/ that no committed checkpoint, "
                    "savepoint or live lease references, once older than the grace period.")
    p.add_argument("--grace-seconds", default=DEFAULT_GRACE_SECONDS,
                   help=f"minimum age of an orphan before it is deleted "
                        f"(default {DEFAULT_GRACE_SECONDS:g})")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.set_defaults(handler=cmd_gc)

    p = sub.add_parser(
        "savepoint", parents=[json_flag(), state_db_flags()],
        help="copy a checkpoint into a self-contained savepoint, or delete one",
        description="Copy every file of a checkpoint to <job>/savepoints/NAME/ with its own "
                    "_metadata. Never collected; a new job can start from it with "
                    "--start-from JOB/savepoints/NAME, just NAME, or the URL this command "
                    "prints. With --delete NAME: remove that savepoint (refused while a live "
                    "lease uses it; never touches checkpoints). An external-backend "
                    "checkpoint in WAL mode is exported from its database (--state-db) as "
                    "memory-backend files.")
    p.add_argument("checkpoint", nargs="?", default="latest", help="ID, chk-ID or latest")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--name", help="name of the new savepoint (letters, digits, _ - .)")
    what.add_argument("--delete", metavar="NAME", help="delete savepoint NAME")
    p.add_argument("--dry-run", action="store_true",
                   help="with --delete: print what would be deleted, delete nothing")
    p.set_defaults(handler=cmd_savepoint)

    p = sub.add_parser("savepoints", parents=[json_flag()], help="list the job's savepoints",
                       description="List the job's savepoints: name, source checkpoint, "
                                   "created, parallelism, files and size. An incomplete one "
                                   "(creation running or interrupted) is marked; remove it "
                                   "with `ckpt savepoint --delete NAME`.")
    p.set_defaults(handler=cmd_savepoints)

    p = sub.add_parser("leases", parents=[json_flag()], help="list leases and the registry summary",
                       description="List the job's leases (live or expired) and a summary of "
                                   "referenced bytes, orphans and missing files.")
    p.set_defaults(handler=cmd_leases)


def cmd_retain(args: argparse.Namespace, store: CheckpointStore) -> int:
    store.require_job()
    number(args.keep, "--keep", minimum=1, integer=True)
    state_db = state_db_of(args)
    with Progress("retain") as progress:
        report = retain(store, args.keep, dry_run=args.dry_run, progress=progress)
        vacuumed = vacuum_after_retention(store, state_db, args.dry_run, progress) \
            if not report.failures else None
    if args.json:
        emit_json({**report.to_json(),
                   **({"vacuum": vacuumed.to_json()} if vacuumed else {})})
    else:
        print("\n".join(retain_text(report) + list(vacuumed.lines if vacuumed else ())))
    return 1 if report.failures else 0


def cmd_gc(args: argparse.Namespace, store: CheckpointStore) -> int:
    store.require_job()
    grace = number(args.grace_seconds, "--grace-seconds", maximum=MAX_GRACE_SECONDS)
    with Progress("gc") as progress:
        report = collect_garbage(store, grace_seconds=grace, dry_run=args.dry_run,
                                 progress=progress)
    if args.json:
        emit_json(report.to_json())
    else:
        print("\n".join(gc_text(report)))
    return 1 if report.failures else 0


def cmd_savepoint(args: argparse.Namespace, store: CheckpointStore) -> int:
    if args.delete is not None:
        return _delete_savepoint(args, store)
    if args.dry_run:
        raise UsageError("--dry-run applies to --delete only; a savepoint copy changes no "
                         "existing file")
    with Progress("savepoint") as progress:
        progress.phase(f"copying checkpoint {args.checkpoint} to savepoint {args.name}")
        meta = create_savepoint(store, args.checkpoint, args.name, state_db_of(args),
                                progress)
    path = f"{store.job}/{savepoint_dir(args.name)}"
    url = f"{store.root_storage.url}/{path}"
    copied = (meta.source or {}).get("checkpoint")  # a savepoint names its source
    if args.json:
        emit_json(dict(meta.summary(), savepoint=args.name, path=path, url=url, start_from=path,
                       source_checkpoint=copied))
    else:
        # both the URL and the path are accepted by --start-from (parse_start_spec)
        print(f"savepoint {args.name} of job {store.job}: copied checkpoint "
              f"{copied} ({len(meta.files)} files, "
              f"{human_bytes(meta.bytes_referenced)}) to {url}; start a new job from it with "
              f"--start-from {path}")
    return 0


def _delete_savepoint(args: argparse.Namespace, store: CheckpointStore) -> int:
    result = delete_savepoint(store, args.delete, dry_run=args.dry_run)
    if args.json:
        emit_json(result.to_json())
        return 0
    verb = "would delete" if result.dry_run else "deleted"
    what = "savepoint" if result.complete else "incomplete savepoint"
    print(f"{verb} {what} {result.name} of job {store.job}: {len(result.files)} files, "
          f"{human_bytes(result.bytes)}")
    if result.dry_run:
        print("(dry run: nothing deleted)")
    return 0


def cmd_savepoints(args: argparse.Namespace, store: CheckpointStore) -> int:
    store.require_job()
    savepoints = list_savepoints(store)
    if args.json:
        emit_json([s.to_json() for s in savepoints])
        return 0
    print(f"{'name':28}  {'source':>6}  {'created':>12}  {'P':>3}  {'backend':<8}  "
          f"{'files':>6}  {'size':>10}")
    for s in savepoints:
        source = "-" if s.source_checkpoint is None else str(s.source_checkpoint)
        if s.source_job not in (None, store.job):
            source = f"{s.source_job}:{source}"
        created = age_of(s.created_at) if s.complete else "incomplete"
        print(f"{s.name:28}  {source:>6}  {created:>12}  "
              f"{s.parallelism if s.parallelism is not None else '-':>3}  "
              f"{s.backend or '-':<8}  {s.files:>6}  "
              f"{human_bytes(s.bytes):>10}")
    if not savepoints:
        print(f"(no savepoints of job {store.job})")
    return 0


def cmd_leases(args: argparse.Namespace, store: CheckpointStore) -> int:
    store.require_job()
    summary = build_registry(store).to_json()
    if args.json:
        emit_json(summary)
        return 0
    print(f"job {store.job}: checkpoints {summary['checkpoints']}, savepoints "
          f"{summary['savepoints']}, {summary['files_referenced']} files referenced "
          f"({human_bytes(summary['bytes_referenced'])}), {summary['orphans']} orphans "
          f"({human_bytes(summary['orphan_bytes'])}), {summary['missing_count']} missing")
    for lease in summary["leases"]:
        state = "live" if lease["live"] else "expired"
        print(f"  {lease['name']:40} {state:8} {lease['purpose']} by {lease['holder']} until "
              f"{lease['expires_at']} holds {lease['checkpoint_ids']}")
    if not summary["leases"]:
        print("  (no leases)")
    return 0
