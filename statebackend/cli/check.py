"""``ckpt check MODULE:ATTR``: what the next run of a (changed) job does to each state.

Loads the job (its code decides, as `ckpt run` does; nothing read from storage chooses
code), reads the latest checkpoint of its lineage (``--job``, default the job's name)
or, for a lineage that does not exist yet, the ``--start-from`` point, and prints per
state: ``kept``, ``added``, ``migrated`` (how), ``dropped`` or ``refused`` (why). It
changes nothing. Exit 0 when the next run can continue the lineage, 1 when a change is
refused (docs/evolve-a-job.md).
"""

from __future__ import annotations

import argparse

from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import emit_json, json_flag
from statebackend.job.command import importable_cwd
from statebackend.job.load import load_job
from statebackend.job.plan import new_lineage_plan, plan_for
from statebackend.lifecycle.savepoint import read_start_point


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", parents=[json_flag()],
        help="what the next run of a job does to each state (changes nothing)",
        description="Compare a job's declared states with its lineage's latest checkpoint "
                    "(or --start-from): per state kept, added, migrated (how), dropped or "
                    "refused (why). Changes nothing; exit 1 when a change is refused.")
    p.add_argument("job_ref", metavar="MODULE:ATTR",
                   help="the job: a statebackend.job.Job, e.g. examples.user_activity:job")
    p.add_argument("--start-from", default=None,
                   help="a lineage not started yet: the savepoint or checkpoint it would "
                        "start from")
    p.set_defaults(handler=cmd_check, scope="root")


def cmd_check(args: argparse.Namespace, storage) -> int:
    importable_cwd()
    job = load_job(args.job_ref)
    job = job.configured(job.resolve_options())
    store = CheckpointStore(storage, args.job or job.name)
    base = store.latest() if store.job_exists() else None
    if base is None and args.start_from:
        base = read_start_point(storage, args.start_from)
    where = f"checkpoint {base.checkpoint_id} of {base.job!r}" if base is not None else \
        f"a new lineage {store.job!r} (no checkpoint under {storage.url})"
    plan = plan_for(job, base) or new_lineage_plan(job)
    if args.json:
        emit_json(dict(plan.to_json(), job=job.name, lineage=store.job, base=where))
    else:
        print(f"job {job.name} on {where}:")
        for change in plan.changes:
            print(f"  {change.line()}")
        verdict = "refused: the next run fails before any work" if plan.refused else \
            "compatible: the next run continues the lineage"
        print(f"{verdict}{' (every subtask rewrites its entries once)' if plan.rewrites else ''}")
    return 1 if plan.refused else 0
