"""``ckpt run MODULE:ATTR --input ... --storage ... --run-id ...``: run any job once.

The job is the `statebackend.job.Job` at ``MODULE:ATTR`` (imported from the
Python path; the current directory comes first, as with ``python -m``). The
options every job shares are fixed; the job's own options (`Job.options`) become
flags once the job is loaded, e.g. ``--normalize-case false``. A user writes no
``main``. The arguments and the program are `statebackend.job.command`'s, which
the spark-submit entry point (``statebackend/cli/submit.py``) and a job module's
own ``main`` share; this module registers them as a ``ckpt`` command.
"""

from __future__ import annotations

import argparse

from statebackend.cli.app import json_flag
from statebackend.job.command import JobParser, add_run_arguments, print_summary, run_from_args
from statebackend.progress import Progress


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", parents=[json_flag()], help="run a job (MODULE:ATTR) once",
        description="Run a stateful job once: read the input folder, update the state from "
                    "the latest checkpoint, write the outputs, commit a new checkpoint. "
                    "Idempotent by --run-id. The job's own options appear as flags once "
                    "MODULE:ATTR is given (`ckpt run MODULE:ATTR --help`).")
    p.__class__ = JobParser  # the job's flags are known only once MODULE:ATTR is read
    add_run_arguments(p, with_storage=False)
    p.set_defaults(handler=cmd_run, scope="root")


def cmd_run(args: argparse.Namespace, _storage) -> int:
    with Progress("run") as progress:
        summary = run_from_args(args, progress)
    print_summary(args, summary, "ckpt run")
    return 0
