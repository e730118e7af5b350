"""``ckpt list | show | dump``: read-only commands."""

from __future__ import annotations

import argparse

from .checkpoints import CheckpointStore
from .cli import emit_json, json_flag
from .dump import DUMP_FORMATS, checkpoint_rows, write_dump
from .metadata import CheckpointMetadata


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

    p = sub.add_parser("dump", help="write every state entry as rows",
                       description="Restore a checkpoint read-only into a temp folder and write "
                                   "each state entry as a row: state, key, user_key, value, "
                                   "key_group, subtask.")
    p.add_argument("checkpoint", nargs="?", default="latest", help="ID, chk-ID or latest")
    p.add_argument("--out", required=True, help="output file")
    p.add_argument("--format", choices=DUMP_FORMATS, default="jsonl")
    p.set_defaults(handler=cmd_dump)


def describe(meta: CheckpointMetadata) -> str:
    what = meta.kind
    if meta.rescaled_from is not None:
        what = f"rescaled from {meta.rescaled_from} to {meta.parallelism}"
    return what


def cmd_list(args: argparse.Namespace, store: CheckpointStore) -> int:
    store.require_job()
    metas = store.load_all()
    if args.json:
        emit_json([m.summary() for m in metas])
        return 0
    print(f"{'id':>6}  {'parent':>6}  {'created_at':32}  {'P':>3}/{'M':<4}  {'files':>6}  "
          f"{'bytes':>12}  {'uploaded':>12}  run_id / kind")
    for m in metas:
        print(f"{m.checkpoint_id:>6}  {m.parent if m.parent is not None else '-':>6}  "
              f"{m.created_at:32}  {m.parallelism:>3}/{m.max_parallelism:<4}  "
              f"{len(m.files):>6}  {m.bytes_referenced:>12}  {m.bytes_uploaded:>12}  "
              f"{m.run_id or '-'} ({describe(m)})")
    if not metas:
        print("(no committed checkpoints)")
    return 0


def cmd_show(args: argparse.Namespace, store: CheckpointStore) -> int:
    meta = store.resolve(args.checkpoint)
    if args.json:
        emit_json(meta.summary())
        return 0
    s = meta.summary()
    print(f"checkpoint {meta.checkpoint_id} of job {meta.job} ({describe(meta)})")
    for key in ("parent", "created_at", "run_id", "parallelism", "max_parallelism",
                "files_referenced", "bytes_referenced", "bytes_uploaded", "rows", "states"):
        print(f"  {key:17} {s[key]}")
    if meta.source:
        print(f"  {'source':17} {meta.source}")
    print("  subtasks:")
    for st in s["subtasks"]:
        print(f"    {st['index']:>3}  key groups [{st['key_group_start']}, {st['key_group_end']}]  "
              f"{st['files']} files  {st['bytes']} bytes  {st['rows']} rows")
    return 0


def cmd_dump(args: argparse.Namespace, store: CheckpointStore) -> int:
    meta = store.resolve(args.checkpoint)
    count = write_dump(checkpoint_rows(store, meta), args.out, args.format)
    print(f"wrote {count} rows of checkpoint {meta.checkpoint_id} to {args.out}")
    return 0
