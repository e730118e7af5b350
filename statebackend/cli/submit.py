"""spark-submit entry point for any job: ``spark-submit .../statebackend/cli/submit.py
MODULE:ATTR --input ... --storage ... --run-id ... [options]``.

The arguments are `ckpt run`'s (`statebackend.job.command`), with ``--storage`` and
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

if __package__ in (None, ""):
    # Run as a file: this folder is sys.path[0]; the library's root must come instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))

# (after the path fix above: run as a file, the library must be importable first)
from statebackend.job.command import entry_point, main  # noqa: E402

__all__ = ["entry_point", "main"]


if __name__ == "__main__":
    if __package__ in (None, ""):
        # Re-enter through the package so Spark pickles task functions by reference.
        from statebackend.cli.submit import main as _main

        sys.exit(_main())
    sys.exit(main())
