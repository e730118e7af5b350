"""spark-submit entry point for any job: ``spark-submit .../statebackend/cli/submit.py
MODULE:ATTR --input ... --storage ... --run-id ... [options]``.

The arguments are `ckpt run`'s (`statebackend.cli.run`), with ``--storage`` and
``--job``; the Spark master comes from spark-submit's ``--master``. Prints the
summary (``--json``: one JSON object) and exits 0, or one error line and the
error's exit code.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # Run as a file: this folder is sys.path[0]; the library's root must come instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))

PROG = "ckpt run"


def main(argv: list[str] | None = None) -> int:
    from statebackend.cli.app import json_flag
    from statebackend.cli.run import _JobParser, add_run_arguments, print_summary, run_from_args
    from statebackend.errors import CkptError
    from statebackend.progress import Progress

    parser = _JobParser(prog="submit.py", parents=[json_flag()],
                        description="Run a stateful job (MODULE:ATTR) once under spark-submit.")
    add_run_arguments(parser, with_storage=True)
    args = parser.parse_args(argv)
    try:
        with Progress("run") as progress:  # periodic lines in the Airflow task log
            summary = run_from_args(args, progress)
    except CkptError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print_summary(args, summary, PROG)
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        # Re-enter through the package so Spark pickles task functions by reference.
        from statebackend.cli.submit import main as _main

        sys.exit(_main())
    sys.exit(main())
