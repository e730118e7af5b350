"""``make ui``: ``airflow standalone`` in the foreground; Ctrl-C (or SIGTERM) stops all of it.

Why a wrapper: on Ctrl-C, standalone terminates its components and then waits for the
scheduler's output pipe to close. The LocalExecutor's idle workers ignore SIGINT and
keep that pipe open, so standalone sometimes stayed up for minutes (it depends on
timing). Standalone runs here in a process group of its own. The first SIGINT or
SIGTERM this process gets is passed on as SIGINT (standalone's own shutdown). What is
still running after ``--grace`` seconds gets SIGTERM, and whatever outlives that,
SIGKILL. The exit status is standalone's own when it stopped by itself, else 130.

    python -m demo.ui [--grace SECONDS] [-- COMMAND ...]   (COMMAND: tests run a stand-in)
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import threading

from bench.connect_server import stop_group

TERM_GRACE_S = 30.0  # after SIGTERM, before SIGKILL


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m demo.ui", description=__doc__.splitlines()[0])
    ap.add_argument("--grace", type=float, default=5.0,
                    help="seconds standalone gets to stop on SIGINT before SIGTERM (default 5)")
    ap.add_argument("command", nargs="*",
                    help="command to run instead of `airflow standalone` (tests)")
    args = ap.parse_args(argv)
    command = args.command or ["airflow", "standalone"]
    if shutil.which(command[0]) is None:
        print(f"make ui: {command[0]!r} is not on PATH (run `make install`)", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # A group of its own, so the terminal's Ctrl-C reaches this process only: the group
    # is then stopped in order (SIGINT, SIGTERM, SIGKILL) instead of all at once.
    # (exec resets the handlers set above: the command gets SIGINT's default action)
    proc = subprocess.Popen(command, start_new_session=True)
    while proc.poll() is None and not stop.wait(0.5):
        pass
    if proc.poll() is not None:
        return proc.returncode
    print(f"make ui: stopping {' '.join(command)} (SIGINT, then SIGTERM after "
          f"{args.grace:g} s)", file=sys.stderr, flush=True)
    stop_group(proc, (signal.SIGINT, args.grace), (signal.SIGTERM, TERM_GRACE_S))
    return 130


if __name__ == "__main__":
    sys.exit(main())
