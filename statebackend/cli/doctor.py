"""``ckpt doctor``: diagnose a job's lineage and apply its safe repairs.

Without an action it reads everything once and prints each problem with its repair
(exit 1 while a problem blocks runs, gc or retention; 0 when healthy or only
self-healing problems remain). Actions (each prints its plan with ``--dry-run``;
the execution first records the reason and what it removes in
``runs/repairs/``): ``--repair`` (only repairs that cannot lose a committed run),
``--rollback-to N --reason TEXT`` (explicit: checkpoint N becomes the latest, the
runs committed above it count again), ``--clear-lease NAME`` (``--force`` for a
live one). With ``--state-db`` an external-backend job's latest checkpoint is checked
against its database: a commit a crash cut short is reported, and ``--repair`` finishes
it. See `statebackend.lifecycle.doctor`.
"""

from __future__ import annotations

import argparse

from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import emit_json, json_flag, state_db_flags, state_db_of
from statebackend.errors import UsageError
from statebackend.lifecycle import doctor


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", parents=[json_flag(), state_db_flags()],
        help="diagnose the lineage; safe repairs, roll back",
        description="Check a job's lineage: forks, lost or replaced commit records, runs the "
                    "ledger forgot, malformed records, dead or corrupt leases. Prints each "
                    "problem with its repair. --repair applies the repairs that cannot lose a "
                    "committed run; --rollback-to N --reason TEXT makes checkpoint N the latest "
                    "(the runs committed above it count again); --clear-lease NAME removes a "
                    "lease file. Every change is recorded first (runs/repairs/), with the "
                    "bytes of what it removes. With --state-db, an external-backend job's "
                    "latest checkpoint is checked against its database; --repair finishes a "
                    "commit a crash cut short.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--repair", action="store_true",
                      help="apply the safe repairs (log entries, ledger records, lost middle "
                           "records marked retired, malformed old records quarantined, dead "
                           "leases, with --state-db an external commit cut short)")
    what.add_argument("--rollback-to", type=int, metavar="N",
                      help="make checkpoint N the latest (needs --reason)")
    what.add_argument("--clear-lease", metavar="NAME",
                      help="remove lease NAME (e.g. writer); a live one only with --force")
    p.add_argument("--reason", help="why (recorded with a roll back)")
    p.add_argument("--force", action="store_true", help="with --clear-lease: even a live lease")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.set_defaults(handler=cmd_doctor)


def cmd_doctor(args: argparse.Namespace, store: CheckpointStore) -> int:
    store.require_job()
    if args.reason and args.rollback_to is None:
        raise UsageError("--reason goes with --rollback-to")
    state_db = state_db_of(args)
    diagnosis = doctor.diagnose(store, state_db=state_db)
    if args.rollback_to is not None:
        plan = doctor.plan_rollback(diagnosis, args.rollback_to, args.reason or "")
    elif args.clear_lease:
        plan = doctor.plan_clear_lease(diagnosis, args.clear_lease, args.force)
    elif args.repair:
        plan = doctor.plan_repair(diagnosis)
    else:
        return _report(args, diagnosis)
    if args.dry_run:
        report = doctor.RepairReport(plan, True, None)
    else:
        report = doctor.execute(store, plan, diagnosis, state_db)
    if args.json:
        emit_json(report.to_json())
    else:
        print("\n".join(plan.lines(args.dry_run)))
        if report.record:
            print(f"recorded in {store.storage.url_of(report.record)}")
        if args.dry_run:
            print("(dry run: nothing changed)")
    return 0


def _report(args: argparse.Namespace, d: doctor.Diagnosis) -> int:
    if args.json:
        emit_json(d.to_json())
    else:
        print(f"job {d.job}: checkpoints {list(d.committed) or 'none'}, "
              f"{len(d.problems)} problem(s)")
        for p in d.problems:
            print(f"  {'BLOCKING' if p.blocking else 'repairable'} {p.kind}: {p.message}")
            print(f"    repair: {p.repair}")
        for lease in d.leases:
            print(f"  lease {lease.name}: {lease.state} ({lease.detail})")
        if d.commit is not None and not d.commit.pending:
            print(f"  external state: {d.commit.store} holds {d.commit.mode} version "
                  f"{d.commit.held} (checkpoint {d.commit.checkpoint_id}: {d.commit.version})")
        elif d.unchecked_store:
            print(f"  external state in {d.unchecked_store}: not checked (pass --state-db to "
                  "check that the latest commit reached it)")
        if not d.problems:
            print("  healthy: no fork, no lost record, every committed run recorded")
    return 1 if d.blocking else 0
