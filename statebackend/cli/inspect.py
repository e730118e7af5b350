"""``ckpt list | show | dump``: read-only commands."""

from __future__ import annotations

import argparse
import sys

from statebackend.checkpoint import lineage as log
from statebackend.checkpoint.dump import DUMP_FORMATS, STDOUT, check_dump_target, write_lines
from statebackend.checkpoint.dump_columns import checkpoint_lines
from statebackend.checkpoint.dump_parquet import check_parquet_target, dump_parquet
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import emit_json, json_flag, state_db_flags, state_db_of
from statebackend.errors import CheckpointNotFoundError, MetadataError, UsageError
from statebackend.formatting import age_of, epoch_ms, human_bytes, rows_text
from statebackend.progress import Progress
from statebackend.state.schema import describe_schema


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", parents=[json_flag()], help="list committed checkpoints",
                       description="List the committed checkpoints of a job, oldest first.")
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("show", parents=[json_flag()], help="show one checkpoint",
                       description="Show one checkpoint's metadata summary. With --json the "
                                   "object documented in the README (id, parent, created_at, "
                                   "parallelism, max_parallelism, files_referenced, "
                                   "bytes_referenced, bytes_uploaded, subtasks ...).")
    p.add_argument("checkpoint", nargs="?", default="latest", help="ID, chk-ID or latest")
    p.set_defaults(handler=cmd_show)

    p = sub.add_parser("dump", parents=[json_flag(), state_db_flags()],
                       help="write every state entry as rows",
                       description="Restore a checkpoint read-only into a temp folder and write "
                                   "each state entry as a row: state, key, user_key, value, "
                                   "key_group, subtask. An external-backend checkpoint is read "
                                   "from its database (--state-db) at its version. With --json "
                                   "(not with --out -) the report is one JSON object: "
                                   "checkpoint, rows, out, format.")
    p.add_argument("checkpoint", nargs="?", default="latest", help="ID, chk-ID or latest")
    p.add_argument("--out", required=True,
                   help="output file (jsonl), folder (parquet: one part file per subtask, "
                        "written in parallel), or - for stdout (jsonl only; the row count "
                        "then goes to stderr)")
    p.add_argument("--format", choices=DUMP_FORMATS, default="jsonl")
    p.set_defaults(handler=cmd_dump)


def describe(meta: CheckpointMetadata) -> str:
    what = meta.kind
    if meta.rescaled_from is not None:
        what = f"rescaled from {meta.rescaled_from} to {meta.parallelism}"
    return what


def cmd_list(args: argparse.Namespace, store: CheckpointStore) -> int:
    """Every committed checkpoint; a malformed record is reported in its row and skipped
    (an old damaged record must not hide the others), and the lineage's problems (a
    fork, a lost commit, ...) are printed on stderr with their repair: exit 1 when a
    record is malformed or a problem blocks runs."""
    store.require_job()
    metas, broken = [], {}
    for cid in store.checkpoint_ids():
        try:
            metas.append(store.load(cid))
        except MetadataError as exc:
            broken[cid] = str(exc)
        except CheckpointNotFoundError:
            continue  # retired while listing
    problems = lineage_problems(store, metas)
    for p in problems:
        print(f"ckpt: {'error' if p.blocking else 'warning'}: {p.message}; {p.repair}",
              file=sys.stderr)
    code = 1 if broken or any(p.blocking for p in problems) else 0
    if args.json:
        emit_json([m.summary() for m in metas])
        return code
    print(f"{'id':>6}  {'parent':>6}  {'created':>12}  {'P':>3}/{'M':<4}  {'backend':<8}  "
          f"{'files':>6}  {'size':>10}  {'uploaded':>10}  run_id (kind)")
    for m in metas:
        print(f"{m.checkpoint_id:>6}  {m.parent if m.parent is not None else '-':>6}  "
              f"{age_of(m.created_at):>12}  {m.parallelism:>3}/{m.max_parallelism:<4}  "
              f"{m.state_backend:<8}  "
              f"{len(m.files):>6}  {human_bytes(m.bytes_referenced):>10}  "
              f"{human_bytes(m.bytes_uploaded):>10}  {m.run_id or '-'} ({describe(m)})")
    for cid, why in sorted(broken.items()):
        print(f"{cid:>6}  malformed record: {why}")
    if not metas and not broken:
        print("(no committed checkpoints)")
    return code


def lineage_problems(store: CheckpointStore, metas: list[CheckpointMetadata]) -> list:
    """The commit log's problems and forks among ``metas`` (checkpoint/lineage.py)."""
    ids = sorted(m.checkpoint_id for m in metas)
    names = log.read_log(store.storage, ids[0] if ids else None)
    return log.check_log(ids, names) + log.find_forks(
        ids, {m.checkpoint_id: m.parent for m in metas},
        {m.checkpoint_id: m.epoch for m in metas})


def cmd_show(args: argparse.Namespace, store: CheckpointStore) -> int:
    meta = store.resolve(args.checkpoint)
    if args.json:
        emit_json(meta.summary())
        return 0
    s = meta.summary()
    shown = dict(s, created_at=f"{meta.created_at} ({age_of(meta.created_at)})",
                 bytes_referenced=human_bytes(s["bytes_referenced"]),
                 bytes_uploaded=human_bytes(s["bytes_uploaded"]),
                 rows=s["rows"] if s["rows"] is not None else
                 "not recorded (a rescale that read nothing; the next run counts them)")
    print(f"checkpoint {meta.checkpoint_id} of job {meta.job} ({describe(meta)})")
    for key in ("parent", "created_at", "run_id", "parallelism", "max_parallelism",
                "state_backend", "files_referenced", "bytes_referenced", "bytes_uploaded",
                "rows"):
        print(f"  {key:17} {shown[key]}")
    print("  states (schemas):")
    for state in meta.states:
        print(f"    {state['name']:18} {describe_schema(state)}")
    for key in ("watermark", "processing_time"):
        print(f"  {key:17} {epoch_ms(s[key])}")
    if meta.source:
        print(f"  {'source':17} {meta.source}")
    if meta.external is not None:
        ext = meta.external
        print(f"  {'external':17} {ext.mode} version {ext.version} (over "
              f"{ext.parent or '-'}) of {ext.job} in {ext.store}")
    memory = meta.state_memory()
    if memory is not None:
        print(f"  {'state in memory':17} {memory.held()}")
    print("  subtasks:")
    for st in s["subtasks"]:
        print(f"    {st['index']:>3}  key groups [{st['key_group_start']}, {st['key_group_end']}]  "
              f"{st['files']} files  {human_bytes(st['bytes'])}  {rows_text(st['rows'])}")
    return 0


def cmd_dump(args: argparse.Namespace, store: CheckpointStore) -> int:
    if args.json and args.out == STDOUT:
        raise UsageError("dump --json: stdout carries the rows with --out -; write them to "
                         "a file or folder to get the JSON report")
    check_dump_target(args.out, args.format)  # refuse before restoring anything
    if args.format == "parquet":
        check_parquet_target(args.out)
    meta = store.resolve(args.checkpoint)
    with Progress("dump") as progress:
        if args.format == "parquet":  # one file per subtask, written in parallel
            progress.phase(f"checkpoint {meta.checkpoint_id}", total=meta.parallelism,
                           unit="subtasks")
            count = dump_parquet(store, meta, args.out, progress=progress,
                                 state_db=state_db_of(args))
        else:
            progress.phase(f"checkpoint {meta.checkpoint_id}", total=meta.summary()["rows"],
                           unit="rows")
            parts = checkpoint_lines(store, meta, state_db_of(args))
            count = write_lines(progress.wrap(parts, size=len), args.out)
    if args.json:
        emit_json({"checkpoint": meta.checkpoint_id, "rows": count, "out": args.out,
                   "format": args.format})
        return 0
    where = "stdout" if args.out == STDOUT else args.out
    # with --out - stdout carries the rows: the report goes to stderr
    print(f"wrote {count} rows of checkpoint {meta.checkpoint_id} to {where}",
          file=sys.stderr if args.out == STDOUT else sys.stdout)
    return 0
