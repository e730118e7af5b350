"""``ckpt bootstrap MODULE:ATTR --state NAME=PATH ... --savepoint NAME --parallelism P``.

Writes savepoint NAME of the job (``--job``, default the job's name) from one Parquet
folder per state (``--state _timers=PATH``: the timers), with
`statebackend.job.bootstrap.bootstrap_state`; a new lineage then starts from it with
``ckpt run ... --start-from <job>/savepoints/NAME``. A bad table is refused in one line
naming the state and the column, and nothing is written.
"""

from __future__ import annotations

import argparse

from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import emit_json, json_flag
from statebackend.defaults import MAX_PARALLELISM
from statebackend.errors import UsageError
from statebackend.formatting import human_bytes
from statebackend.job.bootstrap import bootstrap_state
from statebackend.job.command import importable_cwd
from statebackend.job.load import load_job
from statebackend.progress import Progress
from statebackend.storage import Storage


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bootstrap", parents=[json_flag()], help="write a savepoint from tables",
        description="Write a savepoint of a job (MODULE:ATTR) from one Parquet folder per "
                    "state: rows routed by key group, each subtask's entries written as "
                    "sorted SST files and ingested (docs/state-as-data.md). Start a new "
                    "lineage from it with `ckpt run ... --start-from <job>/savepoints/NAME`.")
    p.add_argument("job_ref", metavar="MODULE:ATTR", help="the job, e.g. jobs.dedup:JOB")
    p.add_argument("--state", action="append", required=True, metavar="NAME=PATH",
                   help="a state's table: a Parquet folder (path or URL); repeat per state; "
                        "_timers=PATH for the timers")
    p.add_argument("--savepoint", required=True, metavar="NAME", help="the savepoint's name")
    p.add_argument("--parallelism", required=True, type=int, metavar="P",
                   help="subtasks of the new lineage")
    p.add_argument("--max-parallelism", type=int, default=MAX_PARALLELISM, metavar="M",
                   help="key groups of the new lineage (default %(default)s)")
    p.set_defaults(handler=cmd_bootstrap, scope="root")


def tables_of(pairs: list[str]) -> dict[str, str]:
    """``--state NAME=PATH`` values as {name: path}; UsageError naming a bad one."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--state {pair!r} is not NAME=PATH (a Parquet folder)")
        if name in out:
            raise UsageError(f"--state names state {name!r} twice")
        out[name] = path
    return out


def cmd_bootstrap(args: argparse.Namespace, storage: Storage) -> int:
    tables = tables_of(args.state)
    importable_cwd()
    job = load_job(args.job_ref)
    store = CheckpointStore(storage, args.job or job.name)
    with Progress("bootstrap") as progress:
        progress.phase(f"bootstrapping savepoint {args.savepoint} of job {store.job}")
        summary = bootstrap_state(job, store, args.savepoint, tables,
                                  parallelism=args.parallelism,
                                  max_parallelism=args.max_parallelism)
    if args.json:
        emit_json(summary)
        return 0
    entries = sum(n for family, n in summary["entries"].items())
    print(f"savepoint {args.savepoint} of job {store.job}: {entries} entries of "
          f"{sorted(summary['entries'])} in {summary['parallelism']} subtasks "
          f"({summary['files_referenced']} files, {human_bytes(summary['bytes_referenced'])}) "
          f"at {summary['url']}; start a new lineage from it with --start-from "
          f"{summary['start_from']}")
    return 0
