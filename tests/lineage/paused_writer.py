"""A job run that stops itself with SIGSTOP before the N-th storage write of its commit.

Run by tests/lineage/test_paused_writer.py as a separate process, so the pause is a
real one: every thread stops, the lease heartbeat too (a VM freeze, a long GC pause).
Arguments: ``INPUT STORAGE OUTPUT RUN_ID PAUSE_AT MARKER ENGINE``. The commit path starts
when the driver calls `CheckpointStore.commit`; from then on the driver thread's storage
mutations are counted, and before mutation number PAUSE_AT (0: the `_metadata` create) the
process writes MARKER (naming the mutation) and stops itself. Exit code: 0 committed or
skipped, 3 refused (a CkptError, printed on stderr).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import statebackend.storage.local
import statebackend.storage.memory
import statebackend.storage.s3  # noqa: F401 - every scheme's class, to patch its methods
from jobs.keyed_aggregation import JobConfig, run
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CkptError
from statebackend.storage import Storage

MUTATIONS = ("write_bytes", "write_exclusive", "write_atomic", "put_file", "copy",
             "copy_checked", "delete_many", "delete_tree")


def main(argv: list[str]) -> int:
    input_dir, storage, output, run_id, pause_at, marker, engine = argv
    state = {"committing": False, "count": 0}
    target = int(pause_at)

    def counted(name, original):
        def mutation(self, *args, **kwargs):
            if state["committing"] and threading.current_thread() is threading.main_thread():
                if state["count"] == target:
                    with open(marker, "w") as fh:
                        fh.write(f"{name} {args[0] if args else ''}")
                    os.kill(os.getpid(), signal.SIGSTOP)
                state["count"] += 1
            return original(self, *args, **kwargs)
        return mutation

    for cls in (Storage, *Storage.__subclasses__()):
        for name in MUTATIONS:
            if name in vars(cls):
                setattr(cls, name, counted(name, vars(cls)[name]))
    real_commit = CheckpointStore.commit

    def commit(self, meta, **kwargs):
        state["committing"] = True
        return real_commit(self, meta, **kwargs)

    CheckpointStore.commit = commit
    try:
        summary = run(JobConfig(input=input_dir, storage=storage, job="agg", run_id=run_id,
                                output=output, parallelism=2, engine=engine))
    except CkptError as exc:
        print(f"refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    print(f"done: checkpoint {summary['checkpoint_id']} skipped={summary['skipped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
