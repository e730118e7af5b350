"""``ckpt validate [ID|latest] [--deep | --full] [--sample N] [--seed S] [--report now|none]
[--report-dir DIR] [--json]``.

Levels (`statebackend.validation.validate`): manifest (default), ``--deep`` (content:
RocksDB's own facts for every entry, per-entry checks on a sample) and ``--full``
(every entry through every check). The output names the level that ran.

Exit codes (the CLI's one table, see cli.py): 0 when every critical
expectation passes, 1 when any fails, 2 for usage or access errors (bad storage
URL or access, unknown job, unknown checkpoint, bad id): nothing was validated
then. Those are checked before Great Expectations is imported (it takes
seconds); the verdict is computed without it, and GE is then imported to render
the Data Docs (``--report now``, the default) or not at all (``--report none``).
Progress shows on stderr.
"""

from __future__ import annotations

import argparse

from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import emit_json, json_flag, state_db_flags, state_db_of
from statebackend.errors import UsageError
from statebackend.job.load import load_job
from statebackend.progress import Progress
from statebackend.validation.options import ValidationOptions
from statebackend.validation.validate import resolve_checkpoint_id, validate_checkpoint

MAX_ROWS_PRINTED = 5


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate", parents=[json_flag(), state_db_flags()],
        help="validate a checkpoint, write a report",
        description="Check a checkpoint with Great Expectations suites: the manifest (files "
                    "exist, sizes and checksums match, key-group ranges tile [0, M), P and M "
                    "consistent, parent present, paths inside the job root) and with --deep "
                    "or --full its content (keys in the right key group, values decode, row "
                    "counts, job checks). Levels: manifest (default); --deep: every subtask "
                    "downloaded with CRC32 and opened read-only, for every entry what "
                    "RocksDB knows without reading it (first/last key of each state inside "
                    "the subtask's range, row counts from SST properties when exact, else a "
                    "keys-only scan), and the per-entry checks on a sample (--sample N "
                    "entries per state and subtask; a state of at most max(N, 4096) entries is "
                    "checked whole): about the cost of a restore; --full: every entry "
                    "through every check and every block read (about a full scan of the "
                    "state). Writes Data Docs and summary.json under "
                    "<job>/reports/chk-<id>/ (or --report-dir). Exit 0 when every critical "
                    "check passes, 1 when one fails, 2 on usage or access errors. Never "
                    "modifies the checkpoint.")
    p.add_argument("checkpoint", nargs="?", default="latest", help="ID, chk-ID or latest")
    level = p.add_mutually_exclusive_group()
    level.add_argument("--deep", action="store_true",
                       help="also restore every subtask read-only and check the state "
                            "content; per-entry checks on a sample (see above)")
    level.add_argument("--full", action="store_true",
                       help="like --deep, with every entry through every per-entry check")
    p.add_argument("--sample", type=int, default=None, metavar="N",
                   help="with --deep: entries checked one by one per state and subtask "
                        "(default 1024)")
    p.add_argument("--seed", type=int, default=None,
                   help="with --deep: seed of the sample (the report records the one used)")
    p.add_argument("--report-dir", default=None,
                   help="write the report to DIR/chk-<id>/ instead of the checkpoint storage")
    p.add_argument("--report", default="now", choices=("now", "none"),
                   help="now (default): render Great Expectations Data Docs after the verdict; "
                        "none: store only the verdict (summary.json, overview page), without "
                        "importing Great Expectations")
    p.add_argument("--job-def", default=None, metavar="MODULE:ATTR",
                   help="with --deep or --full, also run the expectations the job declares on its "
                        "states (at --deep on the sampled entries) "
                        "(e.g. jobs.keyed_aggregation:JOB)")
    p.set_defaults(handler=cmd_validate)


def cmd_validate(args: argparse.Namespace, store: CheckpointStore) -> int:
    if (args.sample is not None or args.seed is not None) and not args.deep:
        raise UsageError("--sample and --seed apply to --deep only (--full checks every "
                         "entry)")
    level = "full" if args.full else "deep" if args.deep else "manifest"
    # refuse an unknown job or checkpoint before paying for the Great Expectations import
    cid = resolve_checkpoint_id(store, args.checkpoint)
    state_checks = None
    if args.job_def:
        # The job comes from the caller's argument, never from the checkpoint's metadata.
        state_checks = load_job(args.job_def).expectations
    options = ValidationOptions(level=level, sample=args.sample, seed=args.seed,
                                report=args.report, report_dir=args.report_dir,
                                state_checks=state_checks, state_db=state_db_of(args))
    with Progress("validate") as progress:
        result = validate_checkpoint(store, cid, options, progress)
    summary = result.summary
    if args.json:
        emit_json(summary)
        return 0 if result.success else 1
    status = "PASSED" if result.success else "FAILED"
    sampled = ""
    if level == "deep":
        f = summary["figures"]
        sampled = (f"; {f.get('entries_checked', 0):,} of {f.get('state_rows', 0):,} entries "
                   f"checked one by one, seed {f.get('sample_seed')}")
    print(f"checkpoint {result.checkpoint_id} of job {store.job}: {status} ({level} validation, "
          f"{sum(s['checks'] for s in summary['suites'])} checks in "
          f"{len(summary['suites'])} suites, {summary['duration_seconds']} s{sampled})")
    for suite in summary["suites"]:
        mark = "ok  " if suite["success"] else "FAIL"
        print(f"  {mark} {suite['name']:28} {suite['rows']:>9} rows  "
              f"{suite['checks'] - suite['failed']}/{suite['checks']} passed")
    for check in summary["checks"]:
        if check["success"]:
            continue
        kind = "critical" if check["critical"] else "warning"
        print(f"  {kind}: {check['name']} ({check['suite']}): {check['description']}; "
              f"{check['unexpected_count']} of {check['element_count']} rows"
              + (f"; error: {check['error']}" if check["error"] else ""))
        for row in check["offending_rows"][:MAX_ROWS_PRINTED]:
            print(f"      {row}")
        if len(check["offending_rows"]) > MAX_ROWS_PRINTED:
            print(f"      ... (see summary.json: up to {len(check['offending_rows'])} rows)")
    print(f"  report: {result.report_location}")
    if result.data_docs_index:
        print(f"  data docs: {result.data_docs_index}")
    return 0 if result.success else 1
