"""``ckpt rescale``: redistribute a checkpoint's state to a new parallelism (see rescale.py)."""

from __future__ import annotations

import argparse

from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import emit_json, human_bytes, json_flag
from statebackend.progress import Progress
from statebackend.rescale.executor import plan_rescale, rescale


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rescale", parents=[json_flag()], help="rescale a checkpoint to a new parallelism",
        description="Write a new checkpoint with parallelism Q from checkpoint ID (default: "
                    "latest), as a Spark job with one task per new subtask: each restores the "
                    "old subtask with the largest key-group overlap, clips it with delete_range "
                    "and ingests the other overlapping key groups as SST files. Later job runs "
                    "continue from the new checkpoint. Holds the job's writer lease and a hold "
                    "on the source; a failure commits nothing.")
    p.add_argument("checkpoint", nargs="?", default="latest", help="ID, chk-ID or latest")
    p.add_argument("--parallelism", "-p", type=int, required=True, metavar="Q",
                   help="new parallelism, 1..max parallelism")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--master", default=None,
                       help="Spark master URL (default local[*]); e.g. spark://127.0.0.1:7077")
    where.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                       help="run as a Spark Connect client of this server (no local JVM)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--compact", action="store_true",
                   help="compact each new subtask to its live keys (uploads every byte again "
                        "instead of referencing the source's SSTs)")
    p.set_defaults(handler=cmd_rescale)


def cmd_rescale(args: argparse.Namespace, store: CheckpointStore) -> int:
    if args.dry_run:
        summary = rescale(store, args.checkpoint, args.parallelism, dry_run=True,
                          compact=args.compact)
    else:
        # Refuse bad requests before paying for a Spark session start.
        plan = plan_rescale(store.resolve(args.checkpoint), args.parallelism)
        with Progress("rescale") as progress:
            summary = _run_rescale(args, store, progress,
                                   f"rescaling checkpoint {plan.source_checkpoint_id} to "
                                   f"{args.parallelism} subtasks")
    if args.json:
        emit_json(summary)
        return 0
    if summary["dry_run"]:
        print("\n".join(summary["plan_text"]))
        print("(dry run: nothing written)")
        return 0
    print(f"checkpoint {summary['checkpoint_id']} of job {summary['job']}: rescaled from "
          f"{summary['from_parallelism']} to {summary['to_parallelism']} (source checkpoint "
          f"{summary['source_checkpoint_id']}) in {summary['duration_seconds']:.2f} s; "
          f"downloaded {human_bytes(summary['bytes_downloaded'])}, uploaded "
          f"{human_bytes(summary['bytes_uploaded'])}, "
          f"reused {summary['files_reused']} files, {summary['rows']} rows")
    for s in summary["subtasks"]:
        print(f"  subtask {s['index']:>3}: base {s['base']} imports {s['imports'] or '-'}  "
              f"{s['rows']} rows  {s['timings'].get('total', 0):.2f} s")
    if "warning" in summary:
        print(f"warning: {summary['warning']}")
    return 0


def _run_rescale(args: argparse.Namespace, store: CheckpointStore, progress: Progress,
                 label: str) -> dict:
    created = None
    # Only a session this command creates is stopped here (a caller's stays up).
    progress.phase("starting Spark")
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is None:
        from statebackend.spark.session import get_spark, quiet_console

        created = get_spark(args.master, app_name="ckpt-rescale", remote=args.remote,
                            conf=quiet_console(args.remote or args.master))
    try:
        progress.phase(label)
        return rescale(store, args.checkpoint, args.parallelism,
                       master=args.remote or args.master, spark=created, compact=args.compact,
                       progress=progress)
    finally:
        if created is not None:
            created.stop()
