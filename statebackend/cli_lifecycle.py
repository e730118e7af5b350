"""``ckpt retain | gc | savepoint | leases``: lifecycle commands.

Destructive commands plan first and print the plan with ``--dry-run``; a plan
is refused (exit 1, nothing deleted) when any metadata or lease is malformed.
"""

from __future__ import annotations

import argparse

from .checkpoints import CheckpointStore
from .cli import emit_json, json_flag
from .errors import UsageError
from .gc import DEFAULT_GRACE_SECONDS, collect_garbage
from .gc import summarize_text as gc_text
from .registry import build_registry
from .retention import retain
from .retention import summarize_text as retain_text
from .savepoint import create_savepoint


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "retain", parents=[json_flag()], help="retire all but the newest N checkpoints",
        description="Keep the newest N committed checkpoints, every savepoint and every "
                    "checkpoint held by a live lease; retire the others (their _metadata first, "
                    "then their private files and the shared files nothing kept references).")
    p.add_argument("--keep", type=int, required=True, help="checkpoints to keep (>= 1)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.set_defaults(handler=cmd_retain)

    p = sub.add_parser(
        "gc", parents=[json_flag()], help="delete unreferenced files (orphans) past a grace period",
        description="Delete files under shared/ and chk-*/ that no committed checkpoint, "
                    "savepoint or live lease references, once older than the grace period.")
    p.add_argument("--grace-seconds", type=float, default=DEFAULT_GRACE_SECONDS,
                   help=f"minimum age of an orphan before it is deleted "
                        f"(default {DEFAULT_GRACE_SECONDS:g})")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.set_defaults(handler=cmd_gc)

    p = sub.add_parser(
        "savepoint", parents=[json_flag()],
        help="copy a checkpoint into a self-contained savepoint",
        description="Copy every file of a checkpoint to <job>/savepoints/NAME/ with its own "
                    "_metadata. Never collected; a new job can start from it with "
                    "--start-from JOB/savepoints/NAME (or just NAME).")
    p.add_argument("checkpoint", nargs="?", default="latest", help="ID, chk-ID or latest")
    p.add_argument("--name", required=True, help="savepoint name (letters, digits, _ - .)")
    p.set_defaults(handler=cmd_savepoint)

    p = sub.add_parser("leases", parents=[json_flag()], help="list leases and the registry summary",
                       description="List the job's leases (live or expired) and a summary of "
                                   "referenced bytes, orphans and missing files.")
    p.set_defaults(handler=cmd_leases)


def cmd_retain(args: argparse.Namespace, store: CheckpointStore) -> int:
    store.require_job()
    if args.keep < 1:
        raise UsageError(f"--keep {args.keep} is invalid: keep at least 1 checkpoint")
    report = retain(store, args.keep, dry_run=args.dry_run)
    if args.json:
        emit_json(report.to_json())
    else:
        print("\n".join(retain_text(report)))
    return 1 if report.failures else 0


def cmd_gc(args: argparse.Namespace, store: CheckpointStore) -> int:
    store.require_job()
    report = collect_garbage(store, grace_seconds=args.grace_seconds, dry_run=args.dry_run)
    if args.json:
        emit_json(report.to_json())
    else:
        print("\n".join(gc_text(report)))
    return 1 if report.failures else 0


def cmd_savepoint(args: argparse.Namespace, store: CheckpointStore) -> int:
    meta = create_savepoint(store, args.checkpoint, args.name)
    path = f"{store.job}/savepoints/{args.name}"
    if args.json:
        emit_json(dict(meta.summary(), savepoint=args.name, path=path,
                       source_checkpoint=meta.source["checkpoint"]))
    else:
        print(f"savepoint {args.name} of job {store.job}: copied checkpoint "
              f"{meta.source['checkpoint']} ({len(meta.files)} files, {meta.bytes_referenced} "
              f"bytes) to {store.root_storage.url}/{path}; start a new job from it with "
              f"--start-from {path}")
    return 0


def cmd_leases(args: argparse.Namespace, store: CheckpointStore) -> int:
    store.require_job()
    summary = build_registry(store).to_json()
    if args.json:
        emit_json(summary)
        return 0
    print(f"job {store.job}: checkpoints {summary['checkpoints']}, savepoints "
          f"{summary['savepoints']}, {summary['files_referenced']} files referenced "
          f"({summary['bytes_referenced']} bytes), {summary['orphans']} orphans "
          f"({summary['orphan_bytes']} bytes), {summary['missing_count']} missing")
    for lease in summary["leases"]:
        state = "live" if lease["live"] else "expired"
        print(f"  {lease['name']:40} {state:8} {lease['purpose']} by {lease['holder']} until "
              f"{lease['expires_at']} holds {lease['checkpoint_ids']}")
    if not summary["leases"]:
        print("  (no leases)")
    return 0
