"""``ckpt``: inspect and maintain the checkpoints of stateful jobs.

Every command takes ``--storage URL`` and, except ``jobs``, ``--job NAME``
(before or after the command name; defaults CKPT_STORAGE / CKPT_JOB), prints
a human summary (sizes like ``1.2 MiB``, ages like ``3 min ago``: `statebackend.formatting`,
shared with the Checkpoints page) or, with
``--json``, one JSON document with exact values on stdout. Errors are one
line on stderr; the exit code follows one table (the error classes' ``exit_code``, printed by
``ckpt --help``): 0 ok, 1 a check failed or an operation was refused, 2 a usage
or access error (bad arguments, unreachable storage, unknown job, checkpoint or
savepoint). A closed stdout (``ckpt list --json | head -1``) ends the command
quietly with 141, the status of a tool killed by SIGPIPE, as ``cat`` or
``seq`` give under ``set -o pipefail``.

Commands live in small modules that each expose ``register(subparsers)``; a
command's handler receives (args, store) and returns the exit code. A handler
registered with ``scope="root"`` receives the root `Storage` instead and needs
no ``--job``. Long work reports progress on stderr (`statebackend.progress`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata as importlib_metadata
from pathlib import Path

from statebackend import settings
from statebackend.checkpoint.store import CheckpointStore
from statebackend.defaults import CONNECT_SESSIONS
from statebackend.errors import (
    CkptError,
    UsageError,
)
from statebackend.formatting import human_bytes  # noqa: F401 - cli/rescale.py imports it here
from statebackend.state.external_store import DEFAULT_TABLE, ExternalStore
from statebackend.storage import open_storage

COMMAND_MODULES = (
    "statebackend.cli.jobs",
    "statebackend.cli.inspect",
    "statebackend.cli.lifecycle",
    "statebackend.cli.validate",
    "statebackend.cli.rescale",
    "statebackend.cli.doctor",
    "statebackend.cli.check",
    "statebackend.cli.bootstrap",
    "statebackend.cli.migrate",
    "statebackend.cli.run",  # `ckpt run` (job API); skipped until installed
)
DISTRIBUTION = "ckpt-lifecycle"

EXIT_OK = 0
EXIT_FAILED = 1      # a check failed, or an operation was refused
EXIT_USAGE = 2       # usage or access error: nothing was done
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE: stdout was closed by the reader
EXIT_INTERRUPTED = 130

# The one exit-code table lives on the error classes (`CkptError.exit_code`):
# 1 for a failed check or a refusal, 2 for usage, access and not-found errors.

EPILOG = f"""\
global options (--storage, --job) may come before or after the command.
storage URLs: a path or file:///dir, memory://name[?max_bytes=N], s3://bucket/prefix
(credentials and endpoint from AWS_* environment variables).

exit codes (every command):
  {EXIT_OK}    ok
  {EXIT_FAILED}    a check failed or the operation was refused
  {EXIT_USAGE}    usage or access error: bad arguments, storage unreachable, unknown job,
       checkpoint or savepoint
  {EXIT_CLOSED_PIPE}  stdout was closed by the reader (e.g. `ckpt list --json | head -1`)

progress goes to stderr: a bar on a terminal, a line every few seconds otherwise
(CKPT_PROGRESS=off|bar|lines, CKPT_PROGRESS_INTERVAL=seconds).
"""

Handler = Callable[[argparse.Namespace, CheckpointStore], int]


# -- output helpers (used by the command modules) ---------------------------
def emit_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def json_flag() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    return parent


def connect_session_flag(commands: str) -> argparse.ArgumentParser:
    """``--connect-session job|new`` for a command that can run as a Spark Connect client
    (``--remote``): ``commands`` names what shares the kept session (`ckpt run` has its
    own flag, from its run options)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--connect-session", choices=CONNECT_SESSIONS, default="job",
        help=f"with --remote: job (default) attaches the job's {commands} to one session the "
             "server keeps, so each finds the last one's Python workers idle; new opens a "
             "session of this command's own, released at its end (the server keeps its "
             "workers until it cleans it up; docs/performance.md)")
    return parent


def state_db_flags() -> argparse.ArgumentParser:
    """``--state-db``/``--state-table``: where an external-backend job keeps its state."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--state-db", metavar="URL",
                        help="external backend: its PostgreSQL database, postgresql://user@"
                             "host:port/db (keep a password in ~/.pgpass, not here)")
    parent.add_argument("--state-table", metavar="NAME", default=DEFAULT_TABLE,
                        help=f"external backend: its state table (default {DEFAULT_TABLE})")
    return parent


def state_db_of(args: argparse.Namespace) -> ExternalStore | None:
    """The ``--state-db`` database (None: not given)."""
    return ExternalStore(args.state_db, args.state_table) if args.state_db else None


def exit_code_of(exc: BaseException) -> int:
    return exc.exit_code if isinstance(exc, CkptError) else EXIT_FAILED


def ckpt_version() -> str:
    """The installed package's version, else the source tree's (pyproject.toml)."""
    try:
        return importlib_metadata.version(DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        pass
    import tomllib

    try:
        with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as fh:
            return str(tomllib.load(fh)["project"]["version"]) + " (source)"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


# -- parser -----------------------------------------------------------------
def add_global_options(parser: argparse.ArgumentParser, *, with_defaults: bool) -> None:
    """--storage/--job. Subcommands get them with SUPPRESS defaults, so a value given
    after the command overrides one given before it (or the environment) and an
    absent one leaves it alone."""
    group = parser.add_argument_group("global options")
    storage = {"default": os.environ.get("CKPT_STORAGE")} if with_defaults \
        else {"default": argparse.SUPPRESS}
    job = {"default": os.environ.get("CKPT_JOB")} if with_defaults \
        else {"default": argparse.SUPPRESS}
    group.add_argument("--storage", metavar="URL", **storage,
                       help="checkpoint storage root URL (env CKPT_STORAGE)")
    group.add_argument("--job", metavar="NAME", **job,
                       help="job name: the folder under the storage root (env CKPT_JOB)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt",
        description="Run stateful jobs; inspect and maintain their incremental checkpoints\n"
                    "(state in RocksDB, in memory or in an external database).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ckpt {ckpt_version()}")
    add_global_options(parser, with_defaults=True)
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
    seen: set[int] = set()
    for command in sub.choices.values():
        if id(command) not in seen:  # aliases share one parser
            seen.add(id(command))
            add_global_options(command, with_defaults=False)
    return parser


# -- main -------------------------------------------------------------------
def fail(exc: BaseException, code: int | None = None) -> int:
    """Print ``exc`` as the one error line; return its exit code."""
    print(f"ckpt: error: {exc}", file=sys.stderr)
    return exit_code_of(exc) if code is None else code


def run_command(args: argparse.Namespace) -> int:
    scope = getattr(args, "scope", "job")
    if not args.storage:
        raise UsageError(f"`ckpt {args.command}` needs --storage URL (or CKPT_STORAGE)")
    if scope == "job" and not args.job:
        raise UsageError(f"`ckpt {args.command}` needs --job NAME (or CKPT_JOB); "
                         "`ckpt jobs` lists the jobs under a storage root")
    settings.check_environment()  # every CKPT_* setting, checked once, before any work
    storage = open_storage(args.storage)
    target = storage if scope == "root" else CheckpointStore(storage, args.job)
    return int(args.handler(args, target) or 0)


# Optional dependencies (top-level module -> the package extra that installs it).
EXTRA_OF_MODULE = {"pandas": "validate", "great_expectations": "validate", "pyspark": "spark",
                   "s3fs": "s3", "airflow": "airflow"}


def missing_extra(exc: ModuleNotFoundError) -> UsageError | None:
    """A one-line install hint for a missing optional dependency, else None."""
    module = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    return UsageError(f"this command needs the {extra} extra: pip install "
                      f"'{DISTRIBUTION}[{extra}]' (missing module {module})")


def _dispatch(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)  # usage errors: argparse exits 2
    try:
        return run_command(args)
    except CkptError as exc:
        return fail(exc)
    except ModuleNotFoundError as exc:
        hint = missing_extra(exc)
        if hint is None:
            raise
        return fail(hint)
    except BrokenPipeError:
        raise  # handled once, in main
    except OSError as exc:  # e.g. dump --out into a folder that cannot be written
        return fail(exc, EXIT_USAGE)
    except KeyboardInterrupt:
        print("ckpt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _silence_stdout() -> None:
    """Point stdout at devnull so the interpreter's final flush cannot fail again
    (the recipe of CPython's signal module docs, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (captured in tests): nothing will flush it later


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _dispatch(argv)
        finally:
            sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    sys.exit(main())
