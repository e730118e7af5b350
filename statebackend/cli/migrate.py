"""``ckpt migrate SOURCE TRANSFORM --to MODULE:ATTR --savepoint NAME``: transform a job's
state through a function into a savepoint of a new job
(`statebackend.job.transform.transform_state`): the escape hatch for the changes the
schema-evolution rules refuse. ``--job`` names the new job's folder (default: the new
job's name); ``--dry-run`` prints the plan and reads no state.
"""

from __future__ import annotations

import argparse

from statebackend.cli.app import (
    connect_session_flag,
    emit_json,
    json_flag,
    state_db_flags,
    state_db_of,
)
from statebackend.job.command import importable_cwd
from statebackend.job.load import load_job
from statebackend.job.transform import (
    TransformOptions,
    load_transform,
    transform_state,
    transform_summary_lines,
)
from statebackend.progress import Progress
from statebackend.storage import Storage


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "migrate", parents=[json_flag(), state_db_flags(), connect_session_flag("migrations")],
        help="transform state into a new job's savepoint",
        description="Read a checkpoint or savepoint (SOURCE), pass every key's state through "
                    "a function (TRANSFORM: per key, or per Arrow batch across the states of "
                    "the same keys) and write what it returns as a savepoint of the new job "
                    "(--to): split or merge states, change a state's kind or codec, drop "
                    "keys or change the key. Start a new lineage from it with `ckpt run ... "
                    "--start-from <job>/savepoints/NAME` (docs/state-as-data.md). An "
                    "external-backend source is read from its database (--state-db).")
    p.add_argument("source", metavar="SOURCE",
                   help="<job>:latest, <job>:<id>, <job>/savepoints/<name> or a savepoint name")
    p.add_argument("transform", metavar="TRANSFORM",
                   help="MODULE:ATTR of a StateTransform, or of a function taken per key: "
                        "fn(key, {state: value}) -> {state: value} or None to drop the key")
    p.add_argument("--to", required=True, metavar="MODULE:ATTR", dest="target",
                   help="the new job (its states are what the savepoint holds)")
    p.add_argument("--savepoint", required=True, metavar="NAME",
                   help="the new savepoint's name, under the new job's folder (--job)")
    p.add_argument("--parallelism", type=int, default=None, metavar="P",
                   help="subtasks of the new lineage (default: the source's)")
    p.add_argument("--max-parallelism", type=int, default=None, metavar="M",
                   help="key groups of the new lineage (default: the source's)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--master", default=None,
                       help="run on Spark with this master (e.g. local[2], spark://host:7077): "
                            "one task per source subtask, rows shuffled by the new key")
    where.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                       help="run on Spark as a Spark Connect client of this server")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan; read no state, write nothing")
    p.set_defaults(handler=cmd_migrate, scope="root")


def cmd_migrate(args: argparse.Namespace, storage: Storage) -> int:
    importable_cwd()
    transform = load_transform(args.transform)
    target = load_job(args.target)
    with Progress("migrate") as progress:
        result = transform_state(storage, args.source, transform, target, args.savepoint,
                                 TransformOptions(
                                     target_job=args.job, parallelism=args.parallelism,
                                     max_parallelism=args.max_parallelism,
                                     master=args.remote or args.master, dry_run=args.dry_run,
                                     connect_session=args.connect_session,
                                     state_db=state_db_of(args), progress=progress))
    if args.json:
        emit_json(result)
    else:
        print("\n".join(transform_summary_lines(result)))
    return 0
