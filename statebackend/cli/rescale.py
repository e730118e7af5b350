"""``ckpt rescale``: redistribute a checkpoint's state to a new parallelism (see rescale.py)."""

from __future__ import annotations

import argparse

from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import (
    connect_session_flag,
    emit_json,
    human_bytes,
    json_flag,
    state_db_flags,
    state_db_of,
)
from statebackend.engines import ENGINES
from statebackend.formatting import rows_text
from statebackend.progress import Progress
from statebackend.rescale.executor import (
    RescaleOptions,
    choose_rescale_engine,
    rescale,
    rescale_spark,
)
from statebackend.rescale.plan import plan_rescale
from statebackend.spark.session import owned_session, quiet_console


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rescale", parents=[json_flag(), connect_session_flag("rescales"), state_db_flags()],
        help="rescale a checkpoint to a new parallelism",
        description="Write a new checkpoint with parallelism Q from checkpoint ID (default: "
                    "latest), one task per new subtask: each restores the old subtask with "
                    "the largest key-group overlap, clips it with delete_range and ingests "
                    "the other overlapping key groups as SST files. The tasks run in this "
                    "process's threads or as Spark tasks (--engine; auto: Spark for a cluster "
                    "or Connect master with a large state). Later job runs continue from the "
                    "new checkpoint. Holds the job's writer lease and a hold on the source; a "
                    "failure commits nothing. A memory- or external-backend checkpoint "
                    "moves whole key-group files or nothing: an external one's new subtasks "
                    "query the same database version (no --state-db needed; given, it is "
                    "checked to be the checkpoint's own).")
    p.add_argument("checkpoint", nargs="?", default="latest",
                   help="ID, chk-ID or latest (a rescale continues from the latest)")
    p.add_argument("--parallelism", "-p", type=int, required=True, metavar="Q",
                   help="new parallelism, 1..max parallelism")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="where the new subtasks run: spark, local (this process's threads, "
                        "no Spark session) or auto (default, or $CKPT_ENGINE)")
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
    options = RescaleOptions(engine=args.engine, master=args.remote or args.master,
                             compact=args.compact, dry_run=args.dry_run,
                             connect_session=args.connect_session,
                             state_db=state_db_of(args))
    if args.dry_run:
        summary = rescale(store, args.checkpoint, args.parallelism, options=options)
    else:
        # Refuse bad requests before paying for a Spark session start.
        meta = store.resolve(args.checkpoint)
        plan = plan_rescale(meta, args.parallelism)
        with Progress("rescale") as progress:
            summary = _run_rescale(args, store, options, progress,
                                   f"rescaling checkpoint {plan.source_checkpoint_id} to "
                                   f"{args.parallelism} subtasks")
    if args.json:
        emit_json(summary)
        return 0
    if summary["dry_run"]:
        print("\n".join(summary["plan_text"]))
        print("(dry run: nothing written)")
        return 0
    workers = " (exports in worker processes)" if summary["import_processes"] else ""
    print(f"checkpoint {summary['checkpoint_id']} of job {summary['job']}: rescaled from "
          f"{summary['from_parallelism']} to {summary['to_parallelism']} (source checkpoint "
          f"{summary['source_checkpoint_id']}) in {summary['duration_seconds']:.2f} s on the "
          f"{summary['engine']} engine{workers}; "
          f"downloaded {human_bytes(summary['bytes_downloaded'])}, "
          f"uploaded {human_bytes(summary['bytes_uploaded'])}, "
          f"reused {summary['files_reused']} files, {rows_text(summary['rows'])}")
    for s in summary["subtasks"]:
        print(f"  subtask {s['index']:>3}: base {s['base']} imports {s['imports'] or '-'}  "
              f"{rows_text(s['rows'])}  {s['timings'].get('total', 0):.2f} s")
    return 0


def _run_rescale(args: argparse.Namespace, store: CheckpointStore, options: RescaleOptions,
                 progress: Progress, label: str) -> dict:
    with owned_session():
        spark = None
        if choose_rescale_engine(store, store.resolve(args.checkpoint), options).engine \
                == "spark":
            progress.phase("starting Spark")
            spark = rescale_spark(store, options, quiet_console(options.master))
        progress.phase(label)
        return rescale(store, args.checkpoint, args.parallelism, spark=spark,
                       options=options, progress=progress)
