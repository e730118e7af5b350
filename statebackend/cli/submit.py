"""spark-submit entry point for any job: ``spark-submit .../statebackend/cli/submit.py
MODULE:ATTR --input ... --storage ... --run-id ... [options]``.

The arguments are `ckpt run`'s (`statebackend.cli.run`), with ``--storage`` and
``--job``; the Spark master comes from spark-submit's ``--master``. Prints the
summary (``--json``: one JSON object) and exits 0, or one error line and the
error's exit code.

A job module's own entry point (``python -m jobs.dedup ARGS``, ``spark-submit
jobs/dedup.py ARGS``) is the same program with its job already named:
``main = entry_point("jobs.dedup:JOB")``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

if __package__ in (None, ""):
    # Run as a file: this folder is sys.path[0]; the library's root must come instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))

PROG = "ckpt run"


def main(argv: list[str] | None = None, *, job_ref: str | None = None, prog: str = PROG,
         require_job: bool = False, json_line: bool = False) -> int:
    """Run the job named in ``argv`` (or ``job_ref``, then ``argv`` holds only options) once.

    ``prog`` starts error and warning lines; ``require_job`` makes ``--job`` required
    and ``json_line`` prints the ``--json`` summary on one line (both: the release-1
    CLI of ``jobs.keyed_aggregation``).
    """
    from statebackend.cli.app import json_flag
    from statebackend.cli.run import _JobParser, add_run_arguments, print_summary, run_from_args
    from statebackend.errors import CkptError
    from statebackend.progress import Progress

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _JobParser(
        prog=prog if job_ref else "submit.py", parents=[json_flag()],
        description=f"Run the job {job_ref} once (also under spark-submit)." if job_ref
        else "Run a stateful job (MODULE:ATTR) once under spark-submit.")
    parser.fixed_job_ref = job_ref
    add_run_arguments(parser, with_storage=True, job_ref=job_ref)
    args = parser.parse_args(argv)
    if require_job and not args.job:
        parser.error("the following arguments are required: --job")
    try:
        with Progress("run") as progress:  # periodic lines in the Airflow task log
            summary = run_from_args(args, progress)
    except CkptError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print_summary(args, summary, prog, json_line=json_line)
    return 0


def entry_point(job_ref: str, **kw) -> Callable[[list[str] | None], int]:
    """``main(argv)`` of a job module: `main` with ``job_ref`` (and ``kw``) fixed."""

    def job_main(argv: list[str] | None = None) -> int:
        return main(argv, job_ref=job_ref, **kw)

    job_main.__doc__ = f"``ckpt run {job_ref}`` with the given arguments (spark-submit too)."
    return job_main


if __name__ == "__main__":
    if __package__ in (None, ""):
        # Re-enter through the package so Spark pickles task functions by reference.
        from statebackend.cli.submit import main as _main

        sys.exit(_main())
    sys.exit(main())
