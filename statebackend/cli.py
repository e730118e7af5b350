"""``ckpt``: inspect and maintain the checkpoints of stateful jobs.

Every command takes ``--storage URL --job NAME`` (or CKPT_STORAGE / CKPT_JOB from
the environment), prints a human summary or, with ``--json``, one JSON document
on stdout. Errors are one line on stderr and a non-zero exit: 1 for a failed
check or a refused operation, 2 for usage or access errors.

Commands live in small modules that each expose ``register(subparsers)``; a
command's handler receives (args, store) and returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence

from .checkpoints import CheckpointStore
from .errors import CkptError
from .storage import open_storage

COMMAND_MODULES = (
    "statebackend.cli_inspect",
    "statebackend.cli_lifecycle",
    "statebackend.cli_validate",
    "statebackend.cli_rescale",
)

Handler = Callable[[argparse.Namespace, CheckpointStore], int]


def emit_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def json_flag() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt",
        description="Inspect and maintain incremental RocksDB checkpoints of stateful jobs.",
        epilog="Storage URLs: a path or file:///dir, memory://name[?max_bytes=N], "
               "s3://bucket/prefix (credentials and endpoint from AWS_* environment variables).",
    )
    parser.add_argument("--storage", default=os.environ.get("CKPT_STORAGE"),
                        help="checkpoint storage root URL (env CKPT_STORAGE)")
    parser.add_argument("--job", default=os.environ.get("CKPT_JOB"),
                        help="job name: the folder under the storage root (env CKPT_JOB)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # optional command group not installed
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.storage or not args.job:
        parser.error("--storage and --job are required (or set CKPT_STORAGE and CKPT_JOB)")
    try:
        store = CheckpointStore(open_storage(args.storage), args.job)
        return int(args.handler(args, store) or 0)
    except CkptError as exc:
        print(f"ckpt: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ckpt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
